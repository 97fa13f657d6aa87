"""The echo variant of the arithmetic dialogue (the demo's task) and the max_addend option."""

import pytest

from r3jax.rollout import ArithmeticEnv, make_env


def test_echo_asks_to_repeat_the_total_every_turn():
    env = make_env("echo")
    env.reset(5)
    total = env.state.total
    for turn in range(3):
        assert env.state.addend == 0 and env.state.total == total
        obs, reward, done = env.step(env.reference_action())
        assert reward == pytest.approx(1 / 3) and done == (turn == 2)
    assert obs == []


def test_max_addend_bounds_the_questions_and_is_validated():
    env = ArithmeticEnv(max_addend=2, num_turns=20)
    env.reset(0)
    seen = set()
    for _ in range(20):
        seen.add(env.state.addend)
        env.step(env.reference_action())
    assert seen <= {0, 1, 2} and len(seen) > 1
    with pytest.raises(ValueError, match=r"max_addend=10: expected an int in \[0, 9\]"):
        ArithmeticEnv(max_addend=10)
