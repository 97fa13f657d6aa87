"""Sampling rules on hand-made logits: greedy, top-k, top-p, seeds, temperature-1 logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.engine.sampling import filter_logits, sample_tokens, seed_words, token_logprobs

B, V = 64, 8
# one row's distribution, repeated: probabilities 0.5, 0.3, 0.15, 0.05 on tokens 3, 0, 6, 1
PROBS = np.zeros(V, np.float32)
PROBS[[3, 0, 6, 1]] = [0.5, 0.3, 0.15, 0.05]
LOGITS = np.log(np.maximum(PROBS, 1e-30)).astype(np.float32)

_sample = jax.jit(sample_tokens)


def _draw(temperature=1.0, top_k=0, top_p=1.0, seeds=None, index=0):
    """B draws from LOGITS, one per row (each row its own seed unless given)."""
    seeds = range(B) if seeds is None else seeds
    key_data = np.stack([seed_words(s) for s in seeds])
    full = lambda v, dt: np.full((B,), v, dt)
    return np.asarray(_sample(np.tile(LOGITS, (B, 1)), key_data, full(index, np.int32),
                              full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32)))


def test_greedy_is_argmax():
    assert (_draw(temperature=0.0) == 3).all()


def test_unfiltered_sampling_covers_the_support_and_only_it():
    draws = np.concatenate([_draw(index=i) for i in range(4)])
    assert set(draws.tolist()) == {3, 0, 6, 1}


@pytest.mark.parametrize("top_k, allowed", [(1, {3}), (2, {3, 0}), (3, {3, 0, 6})])
def test_top_k_keeps_the_k_most_likely(top_k, allowed):
    draws = np.concatenate([_draw(temperature=2.0, top_k=top_k, index=i) for i in range(4)])
    assert set(draws.tolist()) == allowed


@pytest.mark.parametrize("top_p, allowed", [(0.3, {3}), (0.5, {3}), (0.7, {3, 0}), (0.8, {3, 0}),
                                            (0.9, {3, 0, 6})])
def test_top_p_keeps_the_shortest_prefix_reaching_p(top_p, allowed):
    draws = np.concatenate([_draw(top_p=top_p, index=i) for i in range(4)])
    assert set(draws.tolist()) == allowed


def test_filter_masks_exactly_outside_the_set():
    out = np.asarray(filter_logits(jnp.asarray(LOGITS[None].repeat(2, 0)), jnp.array([2, 0]),
                                   jnp.array([1.0, 0.7], jnp.float32)))
    assert np.isfinite(out).sum(-1).tolist() == [2, 2]
    np.testing.assert_array_equal(out[:, [3, 0]], LOGITS[None, [3, 0]].repeat(2, 0))


def test_same_seed_same_token_different_index_or_seed_differs():
    a = _draw(seeds=[7] * B, index=0)
    assert (a == a[0]).all()  # same seed and index in every row: same token, whatever the row
    by_index = np.array([_draw(seeds=[7] * B, index=i)[0] for i in range(16)])
    by_seed = _draw()
    assert len(set(by_index.tolist())) > 1 and len(set(by_seed.tolist())) > 1


def test_logprobs_are_temperature_one_log_softmax():
    logits = jax.random.normal(jax.random.key(0), (3, V))
    tokens = jnp.array([0, 5, 7])
    want = jax.nn.log_softmax(logits, -1)[jnp.arange(3), tokens]
    np.testing.assert_allclose(token_logprobs(logits, tokens), want, rtol=1e-6)


def test_seed_words_are_high_and_low_halves():
    np.testing.assert_array_equal(seed_words((5 << 32) + 9), np.array([5, 9], np.uint32))


def _sorted_filter(scaled, top_k, top_p):
    """The full-sort definition (numpy): mask outside the top k, then outside the shortest prefix of
    the sorted k whose renormalised mass reaches top_p; ties with the last kept value stay."""
    out = np.full_like(scaled, -np.inf)
    for r, row in enumerate(scaled):
        desc = np.sort(row)[::-1]
        k = len(row) if top_k[r] == 0 else min(top_k[r], len(row))
        p = np.exp(desc[:k] - desc[0])
        p /= p.sum()
        before = np.cumsum(p) - p
        n = max(int(np.sum((before < top_p[r]) | (top_p[r] >= 1))), 1)
        out[r] = np.where(row >= desc[n - 1], row, -np.inf)
    return out


@pytest.mark.parametrize("spread", [0.3, 3.0])  # a flat distribution (the nucleus needs many tokens), a peaked one
def test_filter_without_a_full_sort_equals_the_sorted_definition(spread):
    rng = np.random.default_rng(int(spread * 10))
    scaled = (rng.normal(size=(6, 300)) * spread).astype(np.float32)
    top_k = np.array([0, 5, 40, 0, 250, 0], np.int32)  # 250 > the 32 candidates: the sorting fallback
    top_p = np.array([0.9, 1.0, 0.7, 0.5, 0.95, 0.99], np.float32)
    want = _sorted_filter(scaled, top_k, top_p)
    for rows in (np.ones(6, bool), np.array([1, 1, 1, 1, 0, 0], bool)):  # with and without the fallback row
        got = np.asarray(jax.jit(lambda *a: filter_logits(*a, candidates=32))(scaled, top_k, top_p, rows))
        np.testing.assert_array_equal(np.isinf(got[rows]), np.isinf(want[rows]))
        np.testing.assert_array_equal(got[rows][~np.isinf(got[rows])], want[rows][~np.isinf(want[rows])])


def test_top_p_one_keeps_all_of_the_top_k_however_small_the_tail():
    """top_p = 1 with top_k keeps exactly the top k, on the candidates' path and on the sorting one,
    even where the mass before the tail rounds to 1 in f32 (one logit 50 above the rest)."""
    row = np.concatenate([[50.0], np.linspace(0.0, -1.0, 299)]).astype(np.float32)
    scaled = np.stack([row, row, row])
    top_k = np.array([5, 200, 0], np.int32)  # 200 > the 8 candidates: the sorting path
    top_p = np.ones(3, np.float32)
    for rows in (None, np.ones(3, bool)):
        got = np.asarray(jax.jit(lambda *a: filter_logits(*a, candidates=8))(scaled, top_k, top_p, rows))
        assert np.isfinite(got).sum(axis=1).tolist() == [5, 200, 300]
        np.testing.assert_array_equal(got[1][np.isfinite(got[1])], row[:200])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_all_greedy_step_draws_nothing_and_answers_as_the_sampling_path(dtype):
    """With no row sampling, the sampler skips the draw; its tokens and logprobs (raw and processed
    rows) equal the sampling path's bit for bit, and a batch with one hot row takes that path."""
    from r3jax.engine.sampling import _sample_hot, sample_with_logprobs

    rng = np.random.default_rng(0)
    n = 16
    logits = jnp.asarray(rng.normal(size=(n, 50)) * 3, dtype)
    key_data = np.stack([seed_words(s) for s in range(n)])
    index, top_k, top_p = np.arange(n, dtype=np.int32), np.full(n, 5, np.int32), np.full(n, 0.9, np.float32)
    processed = np.arange(n) % 2 == 0
    both = jax.jit(sample_with_logprobs), jax.jit(_sample_hot)
    for temperature in (np.zeros(n, np.float32), np.where(np.arange(n) == 3, 0.7, 0.0).astype(np.float32)):
        (t1, l1), (t2, l2) = (f(logits, key_data, index, temperature, top_k, top_p, processed) for f in both)
        np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    greedy = np.asarray(jnp.argmax(logits, -1))
    assert (np.asarray(t1)[np.arange(n) != 3] == greedy[np.arange(n) != 3]).all()
    # the draw sits behind a branch: no random op outside a cond
    jaxpr = jax.make_jaxpr(sample_with_logprobs)(logits, key_data, index, np.zeros(n, np.float32), top_k, top_p,
                                                 processed)
    assert not {p for p in _primitives(jaxpr.jaxpr) if "random" in p or "threefry" in p}


def _primitives(jaxpr) -> set[str]:
    """Primitive names of a jaxpr and its sub-jaxprs, except what runs inside a ``cond``."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        if eqn.primitive.name == "cond":
            continue
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out |= _primitives(inner)
    return out
