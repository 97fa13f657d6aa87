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
  block: the same memory, a cheaper compile), decided at trace time by :func:`target_platform` (the
  current mesh's devices, so a program compiled ahead of time for a TPU topology from a CPU host
  gets splash; else the default backend), the one rule every ``"auto"`` here and in
  :mod:`models.paged` uses.

An implementation named explicitly that does not cover a call (splash in the cache form or off its
tiling, cudnn off GPU or outside its mask) runs blockwise and says so once (a ``UserWarning`` naming
the option and why) instead of falling back silently.

A query row with no visible key (only possible for blockwise padding, never under the contract above:
a query always sees its own slot) gives zeros in blockwise; the reference averages every value there.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("auto", "xla", "blockwise", "splash", "cudnn")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays NaN-free


_WARNED: set = set()


def warn_fallback(key, message: str) -> None:
    """One ``UserWarning`` per ``key`` per process: an option asked for did not run, and what did."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def target_platform() -> str:
    """The platform a program is built for: the current (abstract) mesh's devices, which are an
    ahead-of-time TPU topology's when one is traced on a CPU host, else ``jax.default_backend()``."""
    dev = jax.sharding.get_abstract_mesh().abstract_device
    return dev.platform if dev is not None else jax.default_backend()


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The implementation ``"auto"`` stands for on ``backend`` (default: :func:`target_platform`)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: expected one of {', '.join(map(repr, ATTENTION_IMPLS))}")
    if impl != "auto":
        return impl
    backend = target_platform() if backend is None else backend
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
    if not auto and impl in ("splash", "cudnn"):
        why = _splash_misses(q, k, q_positions) if impl == "splash" else _cudnn_misses(q, k, v, segment_ids, q_positions)
        warn_fallback(("attention", impl, why), f"attention_impl={impl!r} does not cover this call ({why}): "
                                                f"blockwise attention runs instead")
    from models.blockwise import blockwise_attention

    return blockwise_attention(q, k, v, scale=scale, segment_ids=segment_ids, q_positions=q_positions,
                               block=block)


def _cudnn_supports(q, k, v, segment_ids, q_positions) -> bool:
    """cuDNN's fused kernel: index-causal full sequence without segments, fp16/bf16, equal head dims
    of at most 256 (a multiple of 8), on a GPU backend."""
    return _cudnn_misses(q, k, v, segment_ids, q_positions) is None


def _cudnn_misses(q, k, v, segment_ids, q_positions) -> str | None:
    """Why cuDNN's fused kernel cannot take the call, or None."""
    if target_platform() not in ("gpu", "cuda", "rocm"):
        return f"it runs on GPU, the target is {target_platform()}"
    if q_positions is not None or segment_ids is not None:
        return "it takes the full-sequence form without segment ids"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"it takes fp16 / bf16 inputs, got {q.dtype}"
    if not (q.shape[-1] == v.shape[-1] and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0):
        return f"it takes equal head dims <= 256 in multiples of 8, got {q.shape[-1]} and {v.shape[-1]}"
    return None


def _splash_misses(q, k, q_positions) -> str:
    from models import splash

    if q_positions is not None:
        return "the cache form (q_positions)"
    return f"T={q.shape[1]}, S={k.shape[1]}: splash tiles by {splash.BLOCK}"


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
