"""The paged pool under the conditions it exists for, against the full-sequence forward (tokens,
logprobs within 1e-5 in fp32, route rows): prefix hits that end mid-page, eviction, admission waits
and preemption when pages run out, cancellation of running and waiting requests; no page leaks after a burst;
and a short request submitted while a 4k-token prompt prefills gets its first token before that
prefill completes."""

import jax
import numpy as np

from models import MoeConfig
from r3jax.engine import Engine, GenerateRequest
from r3jax.routes import route_dtype
from tests.r3jax.engine.test_engine import _until

L, K, V = MoeConfig.tiny().num_moe_layers, MoeConfig.tiny().top_k, MoeConfig.tiny().vocab_size


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def _check(reference, reqs, outs):
    full = reference([list(r.prompt_ids) + o.output_ids[:-1] for r, o in zip(reqs, outs)])
    for i, (req, out, (logits, live)) in enumerate(zip(reqs, outs, full)):
        p, s, g = len(req.prompt_ids), req.routed_experts_prompt_start, len(out.output_ids)
        assert out.output_ids == np.argmax(logits[p - 1:], axis=-1).tolist(), i
        want = np.take_along_axis(jax.nn.log_softmax(logits[p - 1:]), np.array(out.output_ids)[:, None], 1)[:, 0]
        np.testing.assert_allclose(out.logprobs, want, atol=1e-5, rtol=0, err_msg=f"request {i}")
        assert out.routed_experts.dtype == route_dtype(8) and out.routed_experts.shape == (p - s + g - 1, L, K)
        np.testing.assert_array_equal(out.routed_experts, live[s:], err_msg=f"request {i}")


def _no_leak(eng):
    """Nothing runs: every page is free or a cached prefix, none referenced or reserved."""
    _until(lambda: eng.stats["live_slots"] == 0 and eng.stats["queued"] == 0)
    s = eng.stats
    assert (s["pages_in_use"], s["pages_reserved"]) == (0, 0)
    assert eng.pool.available == s["pages_total"]


def _greedy(prompt, n, s=0):
    return GenerateRequest(prompt_ids=prompt, max_tokens=n, temperature=0.0, return_routed_experts=True,
                           routed_experts_prompt_start=s)


def test_prefix_hits_that_end_mid_page_equal_the_full_forward(tiny_model, make_engine, reference):
    eng = make_engine(tiny_model)  # a fresh pool (programs shared with the session's engine)
    base = _tokens(1, 20)
    [a] = eng.generate([_greedy(base, 6)])  # fed 25 tokens: pages 0..2 indexed, page 3 (1 token) not
    b_req = _greedy(base[:13] + _tokens(2, 9), 5, s=3)  # shares 13 tokens: one whole page, then mid-page
    c_req = _greedy(base + a.output_ids + _tokens(3, 5), 7)  # the next turn: shares 25 fed tokens
    b, c = eng.generate([b_req, c_req])
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 8, 24)
    _check(reference, [_greedy(base, 6), b_req, c_req], [a, b, c])
    np.testing.assert_array_equal(c.routed_experts[:25], a.routed_experts[:25])  # the cached rows
    _no_leak(eng)


def test_eviction_admission_waits_and_cancellation_under_pressure_equal_the_full_forward(tiny_model, make_engine,
                                                                                         reference):
    eng = make_engine(tiny_model)  # 24 pages: a burst needs several times that
    rng = np.random.default_rng(4)
    firsts = [_greedy(_tokens(10 + i, int(rng.integers(9, 30))), int(rng.integers(4, 30)),
                      s=int(rng.integers(0, 9))) for i in range(12)]
    doomed_running = _greedy(_tokens(50, 6), 40)
    doomed_waiting = _greedy(_tokens(51, 6), 40)
    futures = [eng.submit(doomed_running)] + [eng.submit(r) for r in firsts[:6]] + [eng.submit(doomed_waiting)]
    _until(lambda: eng.stats["steps"] > 0)
    futures += [eng.submit(r) for r in firsts[6:]]
    assert eng.stats["queued"] > 0  # they wait (for slots, then pages as cached prefixes fill the pool)
    assert futures[0].cancel() and futures[7].cancel()
    outs = [f.result(timeout=120) for f in futures[1:7] + futures[8:]]
    # repeats of earlier prompts now: some pages survived, others were evicted and are recomputed
    again = [_greedy(list(r.prompt_ids), r.max_tokens, s=0) for r in firsts[::3]]
    outs_again = eng.generate(again)
    s = eng.stats
    assert s["prefix_cache_evictions"] > 0 and s["failed"] == 0 and s["cancelled"] == 2
    assert sum(o.cached_tokens for o in outs_again) > 0
    _check(reference, firsts + again, outs + outs_again)
    _no_leak(eng)


def test_pages_on_demand_preempt_and_the_answers_equal_the_full_forward(tiny_model, make_engine, reference):
    """Four requests whose max_tokens need 32 pages run at once in a 24-page pool: pages are taken as
    tokens are written, the most recent request is preempted when they run out and recomputed later,
    and every greedy answer equals the full forward (none refused, none lost)."""
    eng = make_engine(tiny_model, prefix_cache_bytes=0)
    reqs = [_greedy(_tokens(60 + i, 4), 60, s=i) for i in range(4)]  # 64 tokens = 8 pages each
    outs = eng.generate(reqs)
    s = eng.stats
    assert s["max_live_slots"] == 4  # admitted together: a prompt needs one page, not eight
    assert s["preempted"] > 0 and s["failed"] == 0
    assert all(len(o.output_ids) == 60 for o in outs)
    _check(reference, reqs, outs)
    _no_leak(eng)


def test_a_preempted_sampled_request_equals_its_run_alone(tiny_model, make_engine):
    """Seeded sampling, prompts of 1 to 3 pages, prefix cache on (a preempted request finds its own
    pages again): tokens, logprobs and route rows equal the same request run alone (which fits)."""
    eng = make_engine(tiny_model)
    reqs = [GenerateRequest(prompt_ids=_tokens(80 + i, p), max_tokens=43, temperature=1.0, seed=i,
                            return_routed_experts=True, routed_experts_prompt_start=i)
            for i, p in enumerate((4, 12, 9, 20))]
    before = eng.stats["preempted"]
    outs = eng.generate(reqs)
    assert eng.stats["preempted"] > before
    for req, out in zip(reqs, outs):
        [alone] = eng.generate([req])
        assert out.output_ids == alone.output_ids and out.finish_reason == alone.finish_reason
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=2e-5, rtol=0)
        np.testing.assert_array_equal(out.routed_experts, alone.routed_experts)
    _no_leak(eng)


def test_a_short_request_gets_its_first_token_while_a_4k_prompt_prefills(tiny_model, engine):
    eng = Engine(tiny_model, max_seq_len=4160, max_batch_size=2, block_size=16, prefill_chunk=64, prefill_rows=2,
                 prefix_cache_bytes=0, moe_impl="dense")
    try:
        long = eng.submit(GenerateRequest(prompt_ids=_tokens(70, 4096), max_tokens=1, temperature=0.0))
        _until(lambda: eng.stats["prefill_tokens"] > 0)  # the long prompt is prefilling: 64 chunks of 64
        short_req = _greedy(_tokens(71, 5), 4)
        short = eng.submit(short_req).result(timeout=300)
        # the long request's first token is the end of its prefill: not there yet
        assert not long.done()
        assert len(long.result(timeout=300).output_ids) == 1
        [alone] = engine.generate([short_req])  # the same request on the session's engine
        assert short.output_ids == alone.output_ids
        np.testing.assert_allclose(short.logprobs, alone.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(short.routed_experts, alone.routed_experts)
        assert eng.stats["pages_in_use"] == 0
    finally:
        eng.close()
