"""Per-request token sampling inside jitted code: greedy, temperature, top-k, top-p, seeded keys, and
the sampled token's logprob under the raw or the processed distribution (vLLM's logprobs modes).

Every row of a batch carries its own parameters, so one compiled program serves any mix of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -jnp.inf


def seed_words(seed: int) -> np.ndarray:
    """A 64-bit seed as raw threefry key data ``[2] uint32`` (high word, low word), built on the host."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)


def step_keys(key_data: jax.Array, index: jax.Array) -> jax.Array:
    """Key for the ``index``-th sampled token of each row. key_data [B, 2] uint32, index [B] int32.

    Depends only on the request's seed and the token index, never on the batch it ran in (the
    logits it samples from can: docs/models.md, "What a seed fixes").
    """
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, index)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(token) under log_softmax(logits) (raw logits: temperature 1; processed ones: the sampled
    distribution). logits [B, V] f32 (may hold -inf), tokens [B] -> [B] f32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


# candidates of the sort-free path: lax.top_k of this many logits per row instead of sorting all V
TOP_CANDIDATES = 256


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, rows: jax.Array | None = None, *,
                  candidates: int = TOP_CANDIDATES) -> jax.Array:
    """Mask (to -inf) everything outside each row's top-k and top-p (nucleus) set.

    scaled [B, V] f32 (temperature already applied), top_k [B] int32 (0: off), top_p [B] f32 (1: off);
    rows [B] bool: the rows whose result is used (default all). The nucleus is the shortest prefix of
    the sorted tokens whose mass reaches top_p (at least one token; top_p >= 1: all of the row's top k).
    Tokens tied with the last kept value are kept too.

    No full-vocabulary sort when it is not needed: the ``candidates`` largest logits of each row
    (``lax.top_k``) decide every row whose set lies inside them (top_k <= candidates, or a top-p-only
    nucleus that the candidates' mass already reaches), exactly as the full sort would. Only when some
    used row needs more (a flat distribution with top_p near 1, or top_k > candidates) does the step
    sort the whole vocabulary.
    """
    v = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    if candidates >= v:
        return _nucleus(scaled, -jnp.sort(-scaled, axis=-1), k, top_p, None)
    top, _ = jax.lax.top_k(scaled, candidates)  # [B, C] descending
    lse = jax.nn.logsumexp(scaled, axis=-1)
    whole = k == v  # top-p only: the nucleus is taken under the full distribution
    off = whole & (top_p >= 1.0)  # nothing to filter: the row as it is
    fits = (k <= candidates) | off | (whole & (jnp.exp(top - lse[:, None]).sum(-1) >= top_p))
    used = jnp.ones_like(fits) if rows is None else rows
    filtered = jax.lax.cond(jnp.all(fits | ~used),
                            lambda x: _nucleus(x, top, k, top_p, jnp.where(whole, lse, jnp.nan)),
                            lambda x: _nucleus(x, -jnp.sort(-x, axis=-1), k, top_p, None), scaled)
    return jnp.where(off[:, None], scaled, filtered)


def _nucleus(scaled, desc, k, top_p, lse):
    """The top-k/top-p threshold from ``desc`` [B, C], the C largest logits of each row in order (C = V,
    or C >= every row's set). lse [B]: log-normaliser of rows whose probabilities are over all V (NaN:
    over their top k), or None (all rows over their top k, C = V)."""
    ranks = jnp.arange(desc.shape[-1])[None, :]
    in_k = ranks < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, _NEG_INF), axis=-1)
    if lse is not None:
        probs = jnp.where(jnp.isnan(lse)[:, None], probs, jnp.exp(desc - jnp.nan_to_num(lse)[:, None]))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # a prefix of the ranks; rank 0 always kept; top_p >= 1 keeps all k (no rounding of the tail's mass)
    keep = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, _NEG_INF)


def processed_logits(logits, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array]:
    """The logits each row samples from: ``(hot [B] bool, processed [B, V] f32)``.

    logits [B, V] f32; temperature [B] f32 (0: greedy); top_k [B] int32; top_p [B] f32. Hot rows
    (temperature > 0) are divided by their temperature, then masked to their top-k/top-p set (-inf
    outside). Greedy rows are returned untempered and unfiltered (vLLM's convention), so their
    processed logprobs equal the raw ones.
    """
    logits = logits.astype(jnp.float32)
    hot = temperature > 0
    scaled = logits / jnp.where(hot, temperature, 1.0)[:, None]
    needs = hot & ((top_k > 0) | (top_p < 1.0))
    # filtering costs a top-k (at worst a sort) over V a row: skip it when no row asks for it
    filtered = jax.lax.cond(jnp.any(needs), lambda x: filter_logits(x, top_k, top_p, needs), lambda x: x, scaled)
    return hot, jnp.where(needs[:, None], filtered, scaled)


def sample_with_logprobs(logits, key_data, index, temperature, top_k, top_p, processed):
    """Sample one token per row and its logprob: ``(tokens [B] int32, logprobs [B] f32)``.

    Arguments as :func:`sample_tokens`, plus processed [B] bool: the row's logprob is taken under the
    processed distribution (:func:`processed_logits`: temperature, then top-k/top-p, renormalised)
    instead of the raw one (log_softmax of ``logits``). Both are computed; the mode only selects, so
    one compiled program serves any mix of modes. A step whose rows are all greedy draws nothing: the
    random draw over the vocabulary (most of the sampler's cost: 4-5x an argmax and a log-softmax on
    CPU) runs only when some row samples, and greedy rows' processed logprobs are their raw ones.
    """
    args = (logits, key_data, index, temperature, top_k, top_p, processed)
    return jax.lax.cond(jnp.any(temperature > 0), _sample_hot, _greedy, *args)


def _greedy(logits, key_data, index, temperature, top_k, top_p, processed):
    """:func:`sample_with_logprobs` when no row samples (bit for bit what :func:`_sample_hot` gives then)."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, token_logprobs(logits, tokens)


def _sample_hot(logits, key_data, index, temperature, top_k, top_p, processed):
    hot, scaled = processed_logits(logits, temperature, top_k, top_p)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.vmap(jax.random.categorical)(step_keys(key_data, index), scaled).astype(jnp.int32)
    tokens = jnp.where(hot, sampled, greedy)
    lp = jnp.where(processed, token_logprobs(scaled, tokens), token_logprobs(logits, tokens))
    return tokens, lp


def sample_tokens(logits, key_data, index, temperature, top_k, top_p) -> jax.Array:
    """Sample one token per row. Returns [B] int32.

    logits [B, V] f32; key_data [B, 2] uint32; index [B] int32 (which token of the request this is);
    temperature [B] f32 (0: greedy argmax); top_k [B] int32; top_p [B] f32.
    """
    processed = jnp.zeros(logits.shape[:1], bool)
    return sample_with_logprobs(logits, key_data, index, temperature, top_k, top_p, processed)[0]
