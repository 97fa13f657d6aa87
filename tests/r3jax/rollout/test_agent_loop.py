"""AgentLoop against the deterministic FakeGenerator (routes are a function of absolute position
and token): incremental == full re-gather, starts, row counts, errors, truncation, versions."""

import dataclasses

import numpy as np
import pytest

from r3jax.batch import collate
from r3jax.rollout import (AgentLoop, ArithmeticEnv, ByteTokenizer, FakeGenerator, FullPrompt,
                           GuessNumberEnv, MissingRoutesError, PrefixMismatchError)
from r3jax.trace import RoutedExpertTrace

EOS = ByteTokenizer.EOS


def _loop(gen, env=lambda: ArithmeticEnv(num_turns=3), **kw):
    kw = {"max_turns": 8, "max_seq_len": 96, "sampling": {"max_tokens": 4}, **kw}
    return AgentLoop(gen, env, **kw)


def _no_stop(prompt, req):
    """Always four digits, never a stop token: every turn is cut by max_tokens."""
    return [ord("0") + (len(prompt) + j) % 10 for j in range(4)]


@pytest.mark.parametrize("mode", ["batched", "async"])
def test_incremental_equals_full_regather_row_for_row(mode):
    gen = FakeGenerator()
    inc = _loop(gen, mode=mode).run(3, 2)
    full = _loop(FakeGenerator(), mode=mode, full_regather=True).run(3, 2)
    assert len(inc) == len(full) == 6
    for a, b in zip(inc, full):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.captured, b.captured)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        # every captured row equals the routes of "one full pass" over the final sequence
        n = a.num_tokens
        want = gen.routes_for(a.tokens.tolist(), 0, n)
        np.testing.assert_array_equal(a.routes[a.captured], want[a.captured])
        assert a.routes.dtype == np.uint8 and a.captured.sum() == n - 1
        # full re-gather receives the whole prefix each turn: strictly more rows after turn 1
        assert b.starts == [0] * b.num_turns
        assert b.route_rows == sum(t.prompt_tokens + t.generated_tokens - 1 for t in b.turns)
        assert b.route_rows > a.route_rows


def test_starts_and_total_rows():
    gen = FakeGenerator()
    [traj] = _loop(gen).run(1, 1)
    assert traj.num_turns == 3 and traj.finish_reason == "done"
    expect, start = [], 0
    for t in traj.turns:
        expect.append(start)
        start = t.prompt_tokens + t.generated_tokens - 1  # P_t + G_t - 1
    assert traj.starts == expect
    p1, g1 = traj.turns[0].prompt_tokens, traj.turns[0].generated_tokens
    assert traj.starts[:2] == [0, p1 + g1 - 1]
    assert [c.routed_experts_prompt_start for c in gen.calls] == expect
    assert traj.route_rows == traj.num_tokens - 1
    assert traj.route_bytes == traj.route_rows * 2 * 2  # L=2, K=2, uint8
    assert [t.route_rows for t in traj.turns] == [t.prompt_tokens - s + t.generated_tokens - 1
                                                  for t, s in zip(traj.turns, expect)]


def test_masks_logprobs_and_collate():
    trajs = _loop(FakeGenerator()).run(2, 2)
    for t in trajs:
        n = t.num_tokens
        assert t.tokens.shape == t.loss_mask.shape == t.rollout_logprobs.shape == t.captured.shape == (n,)
        assert t.routes.shape == (n, 2, 2)
        gen_pos = np.flatnonzero(t.loss_mask)
        # generated tokens: digit then EOS each turn; logprobs only there
        assert len(gen_pos) == sum(x.generated_tokens for x in t.turns)
        assert np.all(t.rollout_logprobs[t.loss_mask == 0] == 0)
        assert np.all(t.rollout_logprobs[gen_pos] < 0)
        assert t.loss_mask[: len(t.prompt_ids)].sum() == 0
    batch = collate(trajs, num_experts=8, top_k=2, num_layers=2)
    assert batch.routes.shape[:2] == batch.tokens.shape and batch.routes.dtype == np.uint8
    assert int(np.asarray(batch.route_mask).sum()) == sum(t.num_tokens - 1 for t in trajs)


def test_batched_and_async_give_identical_trajectories():
    a = _loop(FakeGenerator(), mode="batched", seed=3).run(2, 3)
    b = _loop(FakeGenerator(), mode="async", seed=3, max_concurrency=2).run(2, 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.routes, y.routes)
        assert (x.group, x.sample, x.reward) == (y.group, y.sample, y.reward)
    assert [t.group for t in a] == [0, 0, 0, 1, 1, 1] and [t.sample for t in a] == [0, 1, 2] * 2


def test_engine_batches_all_live_trajectories_per_round():
    gen = FakeGenerator(max_batch_size=4)
    _loop(gen, mode="batched").run(3, 2)  # 6 trajectories x 3 turns, batch limit 4
    assert gen.batch_sizes == [4, 2] * 3


def test_synthetic_eos_is_loss_masked_and_gets_a_row_next_turn():
    gen = FakeGenerator(policy=_no_stop)
    [t] = _loop(gen).run(1, 1)
    assert all(x.synthetic_eos and x.finish_reason == "length" for x in t.turns)
    eos_pos = [i for i in range(len(t.prompt_ids), t.num_tokens) if t.tokens[i] == EOS]
    assert len(eos_pos) == 3 and eos_pos[-1] == t.num_tokens - 1
    assert np.all(t.loss_mask[eos_pos] == 0) and np.all(t.rollout_logprobs[eos_pos] == 0)
    # rows: all but the last generated token and the trailing synthetic EOS
    assert t.route_rows == t.num_tokens - 2 and t.captured.sum() == t.num_tokens - 2
    assert t.captured[eos_pos[:-1]].all() and not t.captured[-2:].any()
    full = _loop(FakeGenerator(policy=_no_stop), full_regather=True).run(1, 1)[0]
    np.testing.assert_array_equal(t.routes, full.routes)


def test_loss_active_target_after_the_gap_is_refused():
    [t] = _loop(FakeGenerator(policy=_no_stop)).run(1, 1)
    c = int(t.captured.sum())
    trace = RoutedExpertTrace((1, 2)).record(prompt_len=c, generated_len=1, routes=t.routes[:c])
    trace.finalize(token_count=t.num_tokens, loss_mask=t.loss_mask)  # the loop's own mask is fine
    bad = t.loss_mask.copy()
    bad[-1] = 1.0  # the synthetic EOS, after the last recorded row
    want = f"missing routed-expert row for loss-active target at token {t.num_tokens - 1}"
    with pytest.raises(ValueError, match=want):
        trace.finalize(token_count=t.num_tokens, loss_mask=bad)


class _RewritingEnv(ArithmeticEnv):
    """Returns the full next prompt; with ``rewrite`` it changes a token of the first prompt."""

    def __init__(self, rewrite: int | None):
        super().__init__(num_turns=3)
        self.rewrite, self.history = rewrite, []

    def reset(self, seed):
        self.history = super().reset(seed)
        return list(self.history)

    def step(self, action):
        obs, r, done = super().step(action)
        self.history = self.history + list(action) + obs
        full = list(self.history)
        if self.rewrite is not None:
            full[self.rewrite] = ord("x")
        return FullPrompt(full), r, done


def test_full_prompt_that_extends_history_matches_appending():
    a = _loop(FakeGenerator(), env=lambda: _RewritingEnv(None)).run(1, 2)
    b = _loop(FakeGenerator()).run(1, 2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.routes, y.routes)


@pytest.mark.parametrize("mode", ["batched", "async"])
def test_broken_prefix_raises(mode):
    with pytest.raises(PrefixMismatchError, match=r"prefix invariant broken at token 2 \(inside the rows already "
                                                   r"recorded.*rewrote history"):
        _loop(FakeGenerator(), env=lambda: _RewritingEnv(2), mode=mode).run(1, 1)


def test_missing_routes_raise():
    want = (r"turn 0 of trajectory \(group 0, sample 0\): the generator returned no routed_experts "
            r"although return_routed_experts=True")
    with pytest.raises(MissingRoutesError, match=want):
        _loop(FakeGenerator(drop_routes=True)).run(1, 1)


def test_without_routes_nothing_is_captured():
    gen = FakeGenerator()
    [t] = _loop(gen, return_routed_experts=False).run(1, 1)
    assert not t.captured.any() and t.route_rows == 0
    np.testing.assert_array_equal(t.routes, np.broadcast_to(np.arange(2), (t.num_tokens, 2, 2)))
    assert not any(c.return_routed_experts for c in gen.calls)


@pytest.mark.parametrize("max_seq_len", [24, 27, 30])
def test_max_seq_len_truncation_ends_cleanly(max_seq_len):
    # no stop tokens: each turn is 4 digits + synthetic EOS (5) and each observation 6 tokens;
    # the prompt is 7. Depending on max_seq_len the next observation does not fit, or a turn's
    # generation is cut by the remaining room.
    gen = FakeGenerator(policy=_no_stop)
    loop = _loop(gen, env=lambda: ArithmeticEnv(num_turns=20), max_seq_len=max_seq_len, max_turns=20)
    [t] = loop.run(1, 1)
    n = t.num_tokens
    assert t.finish_reason == "max_seq_len" and t.truncated and n <= max_seq_len
    assert all(c.max_tokens + len(c.prompt_ids) <= max_seq_len for c in gen.calls)
    assert t.captured.sum() == t.route_rows == t.turns[-1].prompt_tokens + t.turns[-1].generated_tokens - 1
    assert t.loss_mask[t.route_rows + 1:].sum() == 0  # nothing loss-active past the terminal gap
    assert t.turns[-1].observation_tokens == 0
    full = _loop(FakeGenerator(policy=_no_stop), env=lambda: ArithmeticEnv(num_turns=20),
                 max_seq_len=max_seq_len, max_turns=20, full_regather=True).run(1, 1)[0]
    np.testing.assert_array_equal(t.routes, full.routes)
    np.testing.assert_array_equal(t.loss_mask, full.loss_mask)
    collate([t], num_experts=8, top_k=2, num_layers=2)


def test_max_turns_stops_the_episode():
    [t] = _loop(FakeGenerator(), env=lambda: ArithmeticEnv(num_turns=5), max_turns=2).run(1, 1)
    assert t.num_turns == 2 and t.finish_reason == "max_turns"
    assert t.tokens[-1] == EOS and t.route_rows == t.num_tokens - 1


class _BumpingGenerator(FakeGenerator):
    """Bumps weight_version after its first batch (a weight sync mid-rollout)."""

    def generate(self, requests):
        out = super().generate(requests)
        self.weight_version += 1
        return out


def test_trajectory_crossing_a_weight_update_is_marked():
    trajs = _loop(_BumpingGenerator(), mode="batched").run(2, 1)
    for t in trajs:
        assert [x.weight_version for x in t.turns] == [0, 1, 2]
        assert t.weight_version == 0 and t.weight_version_changed
    steady = _loop(FakeGenerator()).run(1, 1)[0]
    assert not steady.weight_version_changed


def test_new_env_seeds_each_run_and_explicit_seeds():
    loop = _loop(FakeGenerator())
    a, b = loop.run(2, 1), loop.run(2, 1)
    assert [t.group for t in a + b] == [0, 1, 2, 3]
    assert len({t.env_seed for t in a + b}) == 4
    c = _loop(FakeGenerator()).run(2, 1, env_seeds=[5, 5])
    np.testing.assert_array_equal(c[0].prompt_ids, c[1].prompt_ids)


@pytest.mark.parametrize("env", [lambda: ArithmeticEnv(num_turns=3), lambda: GuessNumberEnv()])
def test_demonstrations_follow_the_oracle(env):
    loop = _loop(FakeGenerator(), env=env)
    demos = loop.demonstrations(6)
    for d in demos:
        assert not d.captured.any() and d.route_rows == 0
        acts = [ByteTokenizer().decode(d.tokens[i:i + 1]) for i in np.flatnonzero(d.loss_mask)]
        assert all(a.isdigit() or a == "" for a in acts)  # a digit, then the EOS (decodes to "")
    if isinstance(env(), ArithmeticEnv):
        assert all(d.reward == pytest.approx(1.0) for d in demos)
    else:  # binary search finds the secret within 4 guesses; 0.1 off per extra guess
        assert all(d.num_turns <= 4 and d.finish_reason == "done" for d in demos)
        assert [d.reward for d in demos] == pytest.approx([1.0 - 0.1 * (d.num_turns - 1) for d in demos])
    collate(demos, num_experts=8, top_k=2, num_layers=2)


def test_constructor_and_run_validation():
    gen = FakeGenerator(max_seq_len=64)
    with pytest.raises(ValueError, match=r"max_seq_len=128: expected <= the generator's max_seq_len=64"):
        _loop(gen, max_seq_len=128).run(1, 1)
    with pytest.raises(ValueError, match=r"max_turns=0: expected an int >= 1"):
        _loop(gen, max_turns=0)
    gen = FakeGenerator()
    with pytest.raises(ValueError, match=r"n_prompts=0: expected an int >= 1"):
        _loop(gen).run(0, 1)
    with pytest.raises(ValueError, match=r"sampling.max_tokens=0"):
        _loop(gen, sampling={"max_tokens": 0})
    with pytest.raises(ValueError, match=r"gave a prompt of 7 tokens: expected 1 .. max_seq_len - 1 = 6"):
        _loop(gen, max_seq_len=7).run(1, 1)
    with pytest.raises(ValueError, match=r"mode='async': generator"):
        AgentLoop(dataclasses.make_dataclass("G", [])(), ArithmeticEnv, max_turns=1, max_seq_len=8, mode="async")


def test_token_versions_follow_each_calls_spans():
    """A call whose tokens two versions sampled (a weight update with mode "keep" mid-call) gives each
    token its own version; a call without spans gives all its tokens its weight_version; tokens outside
    the loss are -1."""
    from r3jax.rollout import Trajectory, TurnStats

    stats = dict(route_rows=0, route_bytes=0, cached_tokens=0, finish_reason="stop", reward=0.0,
                 synthetic_eos=False)
    turns = (TurnStats(routes_start=0, prompt_tokens=3, generated_tokens=4, observation_tokens=2, weight_version=3,
                       weight_versions=((0, 3), (2, 4)), **stats),
             TurnStats(routes_start=8, prompt_tokens=9, generated_tokens=2, observation_tokens=0, weight_version=4,
                       **stats))
    loss = np.array([1, 1, 1, 1, 0, 0, 1, 1], np.float32)  # 3 prompt tokens, then 4 + 2 observation + 2
    traj = Trajectory(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(8, dtype=np.int32),
                      response_loss_mask=loss, response_logprobs=np.zeros(8, np.float32),
                      routes=np.zeros((11, 1, 1), np.uint8), captured=np.zeros(11, bool), reward=0.0,
                      turn_rewards=(0.0, 0.0), turns=turns, weight_version=3, weight_version_changed=True,
                      finish_reason="done")
    np.testing.assert_array_equal(traj.token_versions, [-1, -1, -1, 3, 3, 4, 4, -1, -1, 4, 4])
