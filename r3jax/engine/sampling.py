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

    Depends only on the request's seed and the token index, never on the batch it ran in.
    """
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, index)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(token) under log_softmax(logits) (raw logits: temperature 1; processed ones: the sampled
    distribution). logits [B, V] f32 (may hold -inf), tokens [B] -> [B] f32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) everything outside each row's top-k and top-p (nucleus) set.

    scaled [B, V] f32 (temperature already applied), top_k [B] int32 (0: off), top_p [B] f32 (1: off).
    The nucleus is the shortest prefix of the sorted tokens whose mass reaches top_p (at least one
    token). Tokens tied with the last kept value are kept too.
    """
    v = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    ranks = jnp.arange(v)[None, :]
    in_k = ranks < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, _NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (mass_before < top_p[:, None])  # a prefix of the ranks; rank 0 always kept
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
    # the sort behind top-k/top-p costs O(V log V) a row: skip it when no row asks for a filter
    filtered = jax.lax.cond(jnp.any(needs), lambda x: filter_logits(x, top_k, top_p), lambda x: x, scaled)
    return hot, jnp.where(needs[:, None], filtered, scaled)


def sample_with_logprobs(logits, key_data, index, temperature, top_k, top_p, processed):
    """Sample one token per row and its logprob: ``(tokens [B] int32, logprobs [B] f32)``.

    Arguments as :func:`sample_tokens`, plus processed [B] bool: the row's logprob is taken under the
    processed distribution (:func:`processed_logits`: temperature, then top-k/top-p, renormalised)
    instead of the raw one (log_softmax of ``logits``). Both are computed; the mode only selects, so
    one compiled program serves any mix of modes.
    """
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
