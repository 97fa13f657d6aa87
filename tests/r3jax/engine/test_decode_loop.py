"""Engine(decode_steps=k): k decode steps per device call give the same tokens, logprobs and route rows
as one step per call, stop mid-call at a stop token or max_tokens, and take fewer calls. The shared
engine runs the default loop (8 steps); these tests set the steps on both sides."""

import numpy as np
import pytest

from models import MoeConfig
from r3jax.checks import FieldError
from r3jax.engine import Engine, GenerateRequest

V = MoeConfig.tiny().vocab_size
STEPS = 4


@pytest.fixture(scope="module")
def looped(tiny_model, make_engine):
    return make_engine(tiny_model, decode_steps=STEPS)


@pytest.fixture(scope="module")
def plain(tiny_model, make_engine):
    """The loop without return_at_finish."""
    return make_engine(tiny_model, decode_steps=STEPS, return_at_finish=False)


@pytest.fixture(scope="module")
def engine(tiny_model, make_engine):
    """One decode step per call (overrides the shared engine in this file)."""
    return make_engine(tiny_model, decode_steps=1)


def _requests(seed=0):
    """Greedy and seeded sampled requests (top-k, top-p), max_tokens on and off multiples of STEPS."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, new) in enumerate([(5, 9), (17, 4), (30, 13), (3, 1), (41, 7), (12, 16)]):
        hot = i % 2 == 1
        out.append(GenerateRequest(prompt_ids=rng.integers(0, V, n).tolist(), max_tokens=new,
                                   temperature=0.8 if hot else 0.0, top_k=5 if i == 3 else 0,
                                   top_p=0.9 if i == 5 else 1.0, seed=100 + i, return_logprobs=True,
                                   return_routed_experts=True, routed_experts_prompt_start=int(rng.integers(0, n + 1))))
    return out


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(g.routed_experts, w.routed_experts)


def test_a_decode_loop_equals_one_step_per_call(engine, looped):
    reqs = _requests()
    before = dict(one=engine.stats, loop=looped.stats)
    want = engine.generate(reqs)
    got = looped.generate(reqs)
    _assert_same(got, want)
    for g, r in zip(got, reqs):
        p, s = len(r.prompt_ids), r.routed_experts_prompt_start
        assert len(g.output_ids) == r.max_tokens and g.routed_experts.shape == (p - s + r.max_tokens - 1, 2, 2)
    calls = {k: e.stats["decode_calls"] - before[k]["decode_calls"] for k, e in (("one", engine), ("loop", looped))}
    assert calls["loop"] < calls["one"]
    assert looped.stats["compiled_programs"] == len(looped.layouts())  # the loop replaces the decode-only step


def test_a_stop_token_mid_call_ends_the_request_there(engine, looped):
    prompt = np.random.default_rng(5).integers(0, V, 9).tolist()
    [free] = engine.generate([GenerateRequest(prompt_ids=prompt, max_tokens=12, temperature=0.0)])
    # a token first sampled inside a call (not at a call's first step), so the loop must stop mid-call
    at = next(i for i, t in enumerate(free.output_ids) if i % STEPS not in (0, 1) and t not in free.output_ids[:i])
    req = GenerateRequest(prompt_ids=prompt, max_tokens=12, temperature=0.0, stop_token_ids=[free.output_ids[at]],
                          return_logprobs=True, return_routed_experts=True)
    [want] = engine.generate([req])
    [got] = looped.generate([req])
    assert got.output_ids == free.output_ids[:at + 1] and got.finish_reason == "stop"
    _assert_same([got], [want])
    # the engine goes on serving: requests after it (on the pages it gave back) are unchanged
    _assert_same(looped.generate(_requests(1)), engine.generate(_requests(1)))


def test_decode_steps_is_checked(tiny_model):
    with pytest.raises(FieldError, match="decode_steps") as e:
        Engine(tiny_model, max_seq_len=64, max_batch_size=2, decode_steps=0)
    assert e.value.field == "decode_steps" and e.value.value == 0


@pytest.mark.parametrize("at_finish, together", [(True, False), (False, False), (True, True)])
def test_a_request_returns_when_it_finishes_not_at_the_end_of_the_call(engine, looped, plain, at_finish, together):
    """A long request (queued first: its row is read first) and a short one, admitted in one step: with
    return_at_finish the call that finishes the short one runs only its last steps, so the short answer
    is out when the long request has as many tokens as it (3); without, the call runs its STEPS. Queued
    by one submit_many, their caller waits for both, so the call is not cut at the short one."""
    eng = looped if at_finish else plain
    rng = np.random.default_rng(9)
    long_req, short_req = (GenerateRequest(prompt_ids=rng.integers(0, V, 6).tolist(), max_tokens=n, temperature=0.0,
                                           return_routed_experts=True) for n in (20, 3))
    seen = []
    on_long = lambda t, lp: seen.append(t)  # noqa: E731
    if together:
        futures = eng.submit_many([long_req, short_req], on_tokens=[on_long, None])
    else:  # two submits queued from the scheduler thread itself, so that its next turn admits both
        futures = eng._sched.control(lambda: [eng.submit(long_req, on_long), eng.submit(short_req)],
                                     drain=False, abort=None)
    at_short = []
    futures[1].add_done_callback(lambda f: at_short.append(len(seen)))
    got = [f.result(timeout=60) for f in futures]
    assert at_short == [3 if at_finish and not together else 1 + STEPS]
    _assert_same(got, engine.generate([long_req, short_req]))


def test_a_batch_prefilled_over_several_steps_takes_no_more_calls_for_returning_at_finish(looped, plain):
    """RL's case: more prompts than a step prefills, one max_tokens. The batch's requests finish a step
    apart per prefill step; its caller waits for all, so return_at_finish cuts no call short for the
    first ones, and the batch takes the calls it takes without it, with the same tokens."""
    rng = np.random.default_rng(3)
    reqs = [GenerateRequest(prompt_ids=rng.integers(0, V, 30).tolist(), max_tokens=13, temperature=0.0,
                            return_routed_experts=True) for _ in range(looped.max_batch_size)]
    calls, outs = [], []
    for eng in (looped, plain):
        before = eng.stats["steps"]
        outs.append(eng.generate(reqs))
        calls.append(eng.stats["steps"] - before)
    _assert_same(*outs)
    assert calls[0] == calls[1]
