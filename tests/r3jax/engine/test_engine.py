"""Engine behaviour against a full-sequence forward of the same model (what the old static engine
returned): greedy tokens, logprobs and the row rule for s = 0, 0 < s < P, s = P over many requests
admitted at different times; sampling, seeds, stop tokens; continuous admission and cancellation."""

import concurrent.futures
import time

import jax
import numpy as np
import pytest

from models import MoeConfig
from r3jax.engine import GenerateOutput, GenerateRequest
from r3jax.routes import route_dtype

L, K, V = MoeConfig.tiny().num_moe_layers, MoeConfig.tiny().top_k, MoeConfig.tiny().vocab_size


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def check_against_reference(reference, reqs, outs):
    """Greedy tokens = argmax of the teacher-forced full forward; logprobs = its log_softmax; routes =
    its live routes at rows [s, P + G - 1), exactly P - s + G - 1 of them, in the compact dtype."""
    full = reference([list(r.prompt_ids) + o.output_ids[:-1] for r, o in zip(reqs, outs)])
    for req, out, (logits, live) in zip(reqs, outs, full):
        p, s, g = len(req.prompt_ids), req.routed_experts_prompt_start, len(out.output_ids)
        assert out.prompt_tokens == p and 1 <= g <= req.max_tokens
        assert out.output_ids == np.argmax(logits[p - 1:], axis=-1).tolist()
        want_lp = np.take_along_axis(jax.nn.log_softmax(logits[p - 1:]), np.array(out.output_ids)[:, None], 1)
        np.testing.assert_allclose(out.logprobs, want_lp[:, 0], atol=2e-5)
        assert out.routed_experts.dtype == route_dtype(8) == np.uint8
        assert out.routed_experts.shape == (p - s + g - 1, L, K) and out.routed_experts_start == s
        np.testing.assert_array_equal(out.routed_experts, live[s:])


def test_mixed_requests_admitted_at_different_times_equal_the_full_forward(engine, reference):
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(14):
        p = int(rng.integers(1, 40))
        s = [0, p, int(rng.integers(0, p + 1))][i % 3]  # s = 0, s = P, and anything in between
        reqs.append(GenerateRequest(prompt_ids=_prompt(i, p), max_tokens=int(rng.integers(1, 64 - p + 1)) // 2 + 1,
                                    temperature=0.0, return_routed_experts=True, routed_experts_prompt_start=s))
    # waves: 14 requests over 4 slots, the later ones submitted while earlier ones decode
    futures = [engine.submit(r) for r in reqs[:5]]
    futures[0].result()
    futures += [engine.submit(r) for r in reqs[5:10]]
    futures[6].result()
    futures += [engine.submit(r) for r in reqs[10:]]
    outs = [f.result(timeout=120) for f in futures]
    assert {(r.routed_experts_prompt_start == len(r.prompt_ids), r.routed_experts_prompt_start == 0) for r in reqs} \
        >= {(True, False), (False, True)}
    check_against_reference(reference, reqs, outs)
    # s = P with a single generated token: no row at all
    [out] = engine.generate([GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=1, temperature=0.0,
                                             return_routed_experts=True, routed_experts_prompt_start=3)])
    assert len(out.output_ids) == 1 and out.routed_experts.shape == (0, L, K)


MIXED = [dict(temperature=0.0), dict(temperature=0.9, seed=11), dict(temperature=1.3, top_k=5, seed=12),
         dict(temperature=0.7, top_p=0.8, seed=13), dict(temperature=1.0, top_k=3, top_p=0.9, seed=14)]


def test_sampled_rows_do_not_depend_on_their_neighbours(engine):
    reqs = [GenerateRequest(prompt_ids=_prompt(20 + i, p), max_tokens=g, return_routed_experts=True,
                            routed_experts_prompt_start=p // 2, **kw)
            for i, ((p, g), kw) in enumerate(zip([(9, 7), (33, 12), (2, 15), (20, 4), (40, 9)], MIXED))]
    together = engine.generate(reqs)  # 5 requests > 4 slots
    for req, out in zip(reqs, together):
        [alone] = engine.generate([req])
        assert out.output_ids == alone.output_ids and out.finish_reason == alone.finish_reason
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=2e-5)
        np.testing.assert_array_equal(out.routed_experts, alone.routed_experts)
    free = GenerateRequest(prompt_ids=_prompt(30, 6), max_tokens=10)
    assert engine.generate([free])[0].output_ids != engine.generate([free])[0].output_ids


def test_stop_token_is_included_and_ends_the_request(engine):
    req = GenerateRequest(prompt_ids=_prompt(7, 17), max_tokens=8, temperature=0.0, return_routed_experts=True,
                          routed_experts_prompt_start=5)
    [full] = engine.generate([req])
    stop = full.output_ids[2]
    first = full.output_ids.index(stop)
    [out] = engine.generate([GenerateRequest(
        prompt_ids=req.prompt_ids, max_tokens=8, temperature=0.0, stop_token_ids=[271, stop],
        return_routed_experts=True, routed_experts_prompt_start=5)])
    assert out.output_ids == full.output_ids[:first + 1] and out.finish_reason == "stop"
    np.testing.assert_array_equal(out.routed_experts, full.routed_experts[:17 - 5 + first])
    assert full.finish_reason == "length"


def test_capture_off_and_logprobs_off(engine):
    req = dict(prompt_ids=_prompt(8, 11), max_tokens=6, temperature=0.7, seed=3)
    on, off = engine.generate([GenerateRequest(**req, return_routed_experts=True),
                               GenerateRequest(**req, return_logprobs=False)])
    assert on.output_ids == off.output_ids and off.routed_experts is None and off.logprobs is None
    assert isinstance(on, GenerateOutput) and on.routed_experts.shape == (11 + 6 - 1, L, K)


def _until(cond, timeout_s=60.0):
    """Poll ``cond`` every millisecond; fail (never hang) if it does not hold within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        time.sleep(0.001)


def _long(i, n=50):
    return GenerateRequest(prompt_ids=_prompt(40 + i, 4), max_tokens=n, temperature=0.0)


def test_a_request_submitted_while_others_decode_starts_before_they_finish(engine):
    decode_calls = engine.stats["decode_calls"]
    long = [engine.submit(_long(i)) for i in range(2)]
    _until(lambda: engine.stats["decode_calls"] != decode_calls)  # the long ones are decoding
    short = engine.submit(GenerateRequest(prompt_ids=[3, 4], max_tokens=2, temperature=0.0))
    short.result(timeout=60)
    assert not any(f.done() for f in long)  # 50 tokens take >= 6 decode calls; the short one needed 1
    assert all(len(f.result(timeout=60).output_ids) == 50 for f in long)


def test_cancellation_frees_the_slot(engine):
    cancelled = engine.stats["cancelled"]
    running = [engine.submit(_long(i, 44)) for i in range(4)]  # every slot and page busy for 44 steps
    _until(lambda: engine.stats["live_slots"] >= 4)
    waiting = engine.submit(GenerateRequest(prompt_ids=[3, 4], max_tokens=2, temperature=0.0))
    assert running[1].cancel()
    waiting.result(timeout=60)  # got the cancelled request's slot and pages...
    assert not any(f.done() for f in (running[0], running[2], running[3]))  # ...long before the others end
    assert running[1].cancelled() and engine.stats["cancelled"] == cancelled + 1
    for f in (running[0], running[2], running[3]):
        assert len(f.result(timeout=60).output_ids) == 44
    assert engine.stats["live_slots"] == 0


def test_cancelling_a_waiting_request_drops_it(engine):
    running = [engine.submit(_long(i, 30)) for i in range(4)]
    queued = engine.submit(_long(9, 30))
    assert queued.cancel()
    for f in running:
        f.result(timeout=60)
    with pytest.raises(concurrent.futures.CancelledError):
        queued.result(timeout=0)
    assert engine.stats["queued"] == 0


def test_on_token_sees_every_token_in_order_before_the_answer(engine):
    """Engine.submit(request, on_token=...): each token and its logprob as it reaches the host (the
    decode loop's and mixed steps' alike), in order, all of them before the future completes; an
    on_token that raises does not stop the request."""
    seen, stops = [], []
    req = GenerateRequest(prompt_ids=_prompt(70, 9), max_tokens=21, temperature=1.0, seed=3)
    fut = engine.submit(req, on_token=lambda t, lp: seen.append((t, lp)))
    out = fut.result(timeout=120)
    assert seen == list(zip(out.output_ids, out.logprobs))
    quiet = GenerateRequest(prompt_ids=_prompt(71, 5), max_tokens=6, temperature=0.0, return_logprobs=False)

    def boom(t, lp):
        stops.append(lp)
        raise RuntimeError("a caller's bug")

    out = engine.submit(quiet, on_token=boom).result(timeout=120)
    assert len(out.output_ids) == 6 and stops == [None] * 6  # no logprob asked for: None


def test_on_token_answering_true_stops_the_request_there(engine):
    req = GenerateRequest(prompt_ids=_prompt(72, 7), max_tokens=30, temperature=0.0, return_routed_experts=True)
    [full] = engine.generate([req])
    seen = []

    def third(t, lp):
        seen.append(t)
        return len(seen) == 3

    out = engine.submit(req, on_token=third).result(timeout=120)
    assert out.output_ids == full.output_ids[:3] and out.finish_reason == "stop" and seen == out.output_ids
    np.testing.assert_array_equal(out.routed_experts, full.routed_experts[:7 + 3 - 1])


def test_submit_many_checks_every_request_before_queueing_any(engine):
    from r3jax.checks import FieldError

    steps = engine.stats["steps"]
    good = GenerateRequest(prompt_ids=_prompt(1, 5), max_tokens=2, temperature=0.0)
    with pytest.raises(FieldError, match=r"requests\[1\]\.max_tokens") as err:
        engine.submit_many([good, GenerateRequest(prompt_ids=_prompt(2, 5), max_tokens=0)])
    assert err.value.field == "requests[1].max_tokens"
    with pytest.raises(FieldError, match="on_tokens") as err:
        engine.submit_many([good, good], on_tokens=[None])
    assert err.value.value == 1
    assert engine.stats["steps"] == steps and engine.stats["queued"] == 0  # nothing was queued
    outs = [f.result(timeout=60) for f in engine.submit_many([good, good])]
    assert outs[0].output_ids == outs[1].output_ids == engine.generate([good])[0].output_ids
