"""Built-in toy environments: deterministic seeds, oracle actions, rewards and partial credit."""

import random

import pytest

from r3jax.rollout import ArithmeticEnv, ArithmeticState, ByteTokenizer, GuessNumberEnv, make_env

tok = ByteTokenizer()
say = lambda text: tok.encode(text) + [tok.EOS]


def _episode(env, seed, policy):
    obs, total, turns = env.reset(seed), 0.0, 0
    while True:
        obs, r, done = env.step(policy(env))
        total, turns = total + r, turns + 1
        if done:
            return total, turns


def test_arithmetic_dialogue_and_rewards():
    env = ArithmeticEnv(num_turns=3)
    first = env.reset(7)
    assert first == ArithmeticEnv(num_turns=3).reset(7)  # deterministic per seed
    s = env.state
    assert tok.decode(first) == f"{s.total}+{s.addend}="
    answer = (s.total + s.addend) % 10
    assert env.reference_action() == say(str(answer))
    obs, r, done = env.step(say(str((answer + 1) % 10)))  # wrong digit: format credit
    assert r == pytest.approx(0.2 / 3) and not done
    # the next question starts from the correct total
    assert tok.decode(obs) == f"{answer}+{env.state.addend}=" and env.state.total == answer
    obs, r, done = env.step(say("no"))  # not a digit
    assert r == 0.0 and not done
    obs, r, done = env.step(env.reference_action())
    assert r == pytest.approx(1 / 3) and done and obs == []
    assert env.reference_action(ArithmeticState(8, 5, 0, 3)) == say("3")


def test_guess_number_feedback_and_rewards():
    env = GuessNumberEnv()
    env.reset(0)
    secret = env.state.secret
    low = 0 if secret != 0 else 9
    obs, r, done = env.step(say(str(low)))
    assert tok.decode(obs) == ("h" if low < secret else "l") and r == 0.0 and not done
    obs, r, done = env.step(say("x"))
    assert tok.decode(obs) == "?" and r == 0.0
    obs, r, done = env.step(say(str(secret)))
    assert done and r == pytest.approx(1.0 - 0.1 * 2)
    # never found: partial credit by the distance of the last digit guessed
    env.reset(0)
    wrong = (secret + 1) % 10
    for _ in range(4):
        obs, r, done = env.step(say(str(wrong)))
    assert done and r == pytest.approx(0.3 * (1 - abs(wrong - secret) / 9))


@pytest.mark.parametrize("name", ["arithmetic", "echo", "guess_number"])
def test_oracle_is_optimal_and_random_play_stays_in_unit_interval(name):
    env = make_env(name)
    rng = random.Random(0)
    for seed in range(30):
        total, turns = _episode(env, seed, lambda e: e.reference_action())
        if name in ("arithmetic", "echo"):
            assert total == pytest.approx(1.0) and turns == 3
        else:
            assert turns <= 4 and total == pytest.approx(1.0 - 0.1 * (turns - 1))
        total, _ = _episode(env, seed, lambda e: say(rng.choice(["0", "5", "9", "a", " 3 ", ""])))
        assert 0.0 <= total <= 1.0


def test_env_validation():
    with pytest.raises(ValueError, match=r"env='chess': expected one of \['arithmetic', 'echo', 'guess_number'\]"):
        make_env("chess")
    with pytest.raises(ValueError, match=r"num_turns=0: expected an int >= 1"):
        ArithmeticEnv(num_turns=0)
    with pytest.raises(ValueError, match=r"GuessNumberEnv.state: call reset\(seed\) first"):
        GuessNumberEnv().reference_action()
