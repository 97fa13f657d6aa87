"""Softmax attention with one mask contract and a kernel per backend.

:func:`attention` is the one entry point. The mask, in every implementation:

- full-sequence form (``q_positions=None``, T == S): query i sees key j iff ``j <= i`` (the index within
  the row, never the position value, so right padding sits after every real token and stays invisible
  to it) and, when ``segment_ids`` is given, the two share a segment id;
- cache form (``q_positions [B, T]``): query t sees slot j iff ``j <= q_positions[b, t]`` (the caller
  has written the new keys at their positions).

Implementations (``impl``, :data:`ATTENTION_IMPLS`):

- ``"xla"``: the einsum reference; it materialises the f32 scores ``[B, Hkv, G, T, S]``.
- ``"blockwise"``: online softmax over key blocks, queries blocked too (:mod:`models.blockwise`); live
  memory O(T * block), and a flash-style backward that recomputes each block from ``out`` and the
  log-sum-exp, so the gradient never holds an S x S buffer either. Key blocks past a query block's last
  visible slot are skipped (causal work halves; a decode step reads only the filled part of the cache).
- ``"splash"``: the TPU Pallas splash kernel (full-sequence form; :mod:`models.splash`), in a
  ``jax.shard_map`` over the batch axes of the current mesh; the cache form falls back to blockwise.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` where cuDNN covers the mask
  (full-sequence form, no segment ids, 16-bit inputs); anything else falls back to blockwise.
- ``"auto"``: splash on TPU, cudnn on GPU, blockwise elsewhere (the einsum when the keys fit in one
  block: the same memory, a cheaper compile), decided from ``jax.default_backend()`` at trace time. Compiling ahead of time for a TPU topology from a CPU host traces on the CPU backend,
  so such a program must set ``"splash"`` explicitly.

A query row with no visible key (only possible for blockwise padding, never under the contract above:
a query always sees its own slot) gives zeros in blockwise; the reference averages every value there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("auto", "xla", "blockwise", "splash", "cudnn")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays NaN-free


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The implementation ``"auto"`` stands for on ``backend`` (default: ``jax.default_backend()``)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: expected one of {', '.join(map(repr, ATTENTION_IMPLS))}")
    if impl != "auto":
        return impl
    backend = jax.default_backend() if backend is None else backend
    return {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "cudnn"}.get(backend, "blockwise")


def attention(q, k, v, *, scale: float, segment_ids=None, q_positions=None, impl: str = "auto",
              block: int = 512):
    """Masked softmax attention (the module docstring has the mask contract).

    q [B, T, H, Dh]; k [B, S, Hkv, Dh]; v [B, S, Hkv, Dv]; H a multiple of Hkv (query head h uses kv head
    ``h // (H / Hkv)``); segment_ids [B, T] int or None (full-sequence form only); q_positions [B, T]
    int or None. Scores are ``scale * q . k`` in float32. Returns out [B, T, H, Dv] in q's dtype.
    """
    auto, impl = impl == "auto", resolve_impl(impl)
    if auto and impl == "blockwise" and k.shape[1] <= block:
        # one key block: blockwise would hold the same [T, S] tile of scores, and the einsum compiles faster
        impl = "xla"
    if q_positions is not None and segment_ids is not None:
        raise ValueError("segment_ids: expected None in the cache form (q_positions given)")
    if q_positions is None and q.shape[1] != k.shape[1]:
        raise ValueError(f"full-sequence attention: expected T == S, got T={q.shape[1]}, S={k.shape[1]}")
    if impl == "splash" and q_positions is None:
        from models import splash

        if splash.supports(q, k, v):
            return splash.splash_attention(q, k, v, scale=scale, segment_ids=segment_ids)
    if impl == "cudnn" and _cudnn_supports(q, k, v, segment_ids, q_positions):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    if impl == "xla":
        return reference_attention(q, k, v, scale=scale, segment_ids=segment_ids, q_positions=q_positions)
    from models.blockwise import blockwise_attention

    return blockwise_attention(q, k, v, scale=scale, segment_ids=segment_ids, q_positions=q_positions,
                               block=block)


def _cudnn_supports(q, k, v, segment_ids, q_positions) -> bool:
    """cuDNN's fused kernel: index-causal full sequence without segments, fp16/bf16, equal head dims
    of at most 256 (a multiple of 8), on a GPU backend."""
    return (jax.default_backend() in ("gpu", "cuda", "rocm") and q_positions is None and segment_ids is None
            and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] == v.shape[-1] and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0)


def visible(b: int, t: int, s: int, segment_ids=None, q_positions=None) -> jax.Array:
    """The mask of the contract as a dense bool [B, T, S] (the reference and the tests use it)."""
    if q_positions is None:
        idx = jnp.arange(t)
        mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, t, s))
        if segment_ids is not None:
            mask &= segment_ids[:, None, :] == segment_ids[:, :, None]
        return mask
    return jnp.arange(s)[None, None, :] <= q_positions[:, :, None]


def reference_attention(q, k, v, *, scale: float, segment_ids=None, q_positions=None):
    """The einsum reference: scores [B, Hkv, G, T, S] in float32, softmax, probs in q's dtype."""
    dt = q.dtype
    b, t, h, d = q.shape
    hkv = k.shape[2]
    mask = visible(b, t, k.shape[1], segment_ids, q_positions)
    q = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(dt)).reshape(b, t, h, -1)
