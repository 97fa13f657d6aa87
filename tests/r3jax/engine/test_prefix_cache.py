"""Prefix caching by page reference: a multi-turn conversation reuses KV and recorded routes, LRU
eviction of unreferenced pages under pressure (leaves before roots), duplicate prefixes in one batch,
and set_weights dropping everything."""

import numpy as np
from flax import nnx

from models import MoeConfig
from r3jax.engine import GenerateRequest

V = MoeConfig.tiny().vocab_size


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def _conversation(engine, turns=3, first=12, user=6, gen=8):
    """Each turn's prompt is the whole conversation so far plus new user tokens; all rows from 0."""
    history, outs = [], []
    for t in range(turns):
        history = history + _tokens(100 + t, first if t == 0 else user)
        [out] = engine.generate([GenerateRequest(prompt_ids=list(history), max_tokens=gen, temperature=0.0,
                                                 return_routed_experts=True)])
        outs.append(out)
        history = history + out.output_ids
    return outs


def test_three_turns_with_cache_equal_without_and_prefill_far_less(tiny_model, make_engine):
    cached, plain = make_engine(tiny_model), make_engine(tiny_model, prefix_cache_bytes=0)
    with_cache, without = _conversation(cached), _conversation(plain)
    for a, b in zip(with_cache, without):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    # prompts of 12, 26, 40 tokens; the fed tokens of each turn (prompt + output[:-1]) are cached by
    # whole 8-token blocks, and at least the last prompt token is always computed
    assert [o.prompt_tokens for o in with_cache] == [12, 26, 40]
    assert [o.cached_tokens for o in with_cache] == [0, 16, 32]
    assert [o.cached_tokens for o in without] == [0, 0, 0]
    on, off = cached.stats["prefill_tokens"], plain.stats["prefill_tokens"]
    print(f"\nprefill tokens over 3 turns: {on} with the prefix cache, {off} without")
    assert (on, off) == (12 + 10 + 8, 12 + 26 + 40)
    assert cached.stats["cached_tokens"] == 48
    # rows of cached positions are the ones recorded at turn 1
    first_rows = with_cache[0].routed_experts
    np.testing.assert_array_equal(with_cache[2].routed_experts[:len(first_rows)], first_rows)


def _run(engine, prompt):
    [out] = engine.generate([GenerateRequest(prompt_ids=prompt, max_tokens=1, temperature=0.0,
                                             return_routed_experts=True)])
    return out


def test_lru_eviction_under_pressure_drops_leaves_first(tiny_model, make_engine):
    eng = make_engine(tiny_model)  # a fresh pool of 24 pages (programs shared with the other engines)
    prompts = [_tokens(10 + i, 24) for i in range(8)]  # 24 fed tokens: 3 whole pages each
    for p in prompts:
        assert _run(eng, p).cached_tokens == 0
    s = eng.stats
    assert (s["prefix_cache_blocks"], s["pages_in_use"], s["prefix_cache_evictions"]) == (24, 0, 0)  # all cached
    _run(eng, _tokens(30, 16))  # needs 2 pages, none free: the least recently used chain loses its 2 leaves
    assert eng.stats["prefix_cache_evictions"] == 2
    assert _run(eng, prompts[0]).cached_tokens == 8  # its root is left
    assert eng.stats["prefix_cache_evictions"] == 4  # its 2 new pages: the next chain's leaf and middle
    assert _run(eng, prompts[2]).cached_tokens == 16  # untouched: (24 - 1) // 8 pages, the last token computed
    assert _run(eng, prompts[1]).cached_tokens == 0  # its root went for prompt 2's last page
    assert (eng.stats["pages_in_use"], eng.stats["pages_reserved"]) == (0, 0)


def test_set_weights_drops_the_cache_and_bumps_the_version(tiny_model, make_engine):
    eng = make_engine(tiny_model)
    prompt = _tokens(3, 20)
    first = _run(eng, prompt)
    assert _run(eng, prompt).cached_tokens == 16 and first.weight_version == 0
    _, params, _ = nnx.split(tiny_model, nnx.Param, ...)
    assert eng.set_weights(params) == 1
    assert eng.stats["prefix_cache_blocks"] == 0
    again = _run(eng, prompt)
    assert again.cached_tokens == 0 and again.weight_version == 1
    assert again.output_ids == first.output_ids  # same weights: same result, recomputed
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)


def test_identical_prefixes_in_one_batch_are_stored_once(tiny_model, make_engine):
    eng = make_engine(tiny_model)
    prompt = _tokens(4, 20)
    outs = eng.generate([GenerateRequest(prompt_ids=prompt, max_tokens=1, temperature=0.0,
                                         return_routed_experts=True)] * 4)
    assert eng.stats["prefix_cache_blocks"] == 2  # 20 fed tokens: 2 whole pages, not 8
    assert all(o.output_ids == outs[0].output_ids for o in outs)
    assert _run(eng, prompt).cached_tokens == 16


def _samples(prompt, n, max_tokens=6):
    return [GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, temperature=1.0, seed=s, return_logprobs=True,
                            return_routed_experts=True) for s in range(n)]


def _same_as_alone(outs, reqs, plain):
    """Each output equals its request run alone on an engine without a prefix cache."""
    for out, req in zip(outs, reqs):
        [alone] = plain.generate([req])
        assert out.output_ids == alone.output_ids
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=2e-5)
        np.testing.assert_array_equal(out.routed_experts, alone.routed_experts)


def test_samples_of_one_prompt_submitted_together_prefill_it_once(tiny_model, make_engine):
    """GRPO's n samples of a prompt: the first prefills it, the others reference its whole pages as soon
    as the step that writes them is dispatched (and compute only the last token); their prompt route
    rows are the first one's."""
    eng, plain = make_engine(tiny_model), make_engine(tiny_model, prefix_cache_bytes=0)
    prompt = _tokens(7, 41)  # 5 whole pages of 8 and one more token
    before = eng.stats["prefill_tokens"]
    reqs = _samples(prompt, 4)
    outs = eng.generate(reqs)
    assert eng.stats["prefill_tokens"] - before == 41 + 3  # not 4 x 41
    assert [o.cached_tokens for o in outs] == [0, 40, 40, 40]
    for o in outs[1:]:
        np.testing.assert_array_equal(o.routed_experts[:41], outs[0].routed_experts[:41])
    _same_as_alone(outs, reqs, plain)


def test_a_shared_prompt_survives_its_first_request_being_cancelled(tiny_model, make_engine):
    eng, plain = make_engine(tiny_model), make_engine(tiny_model, prefix_cache_bytes=0)
    reqs = _samples(_tokens(8, 33), 3, max_tokens=12)
    futures = [eng.submit(r) for r in reqs]
    futures[0].cancel()  # whenever it lands: before admission, mid-prefill or decoding
    _same_as_alone([f.result(timeout=120) for f in futures[1:]], reqs[1:], plain)
    # the pages it shared serve the next request of that prompt with the same rows
    _same_as_alone(eng.generate(reqs[:1]), reqs[:1], plain)
