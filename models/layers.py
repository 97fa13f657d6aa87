"""Small NNX building blocks: RMSNorm, rotary embeddings, GQA attention over a functional KV cache,
and the dense SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import MoeConfig

_init = nnx.initializers.normal(stddev=0.02)
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays NaN-free


class RMSNorm(nnx.Module):
    """Root-mean-square norm, statistics in float32 (as Hugging Face Qwen3 does)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split ("rotate_half") convention. x [B, T, H, Dh], positions [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
        d, hd, pd = cfg.hidden_size, cfg.head_dim, cfg.param_dtype
        self.cfg = cfg
        self.q_proj = nnx.Param(_init(rngs.params(), (d, cfg.num_heads * hd), pd))
        self.k_proj = nnx.Param(_init(rngs.params(), (d, cfg.num_kv_heads * hd), pd))
        self.v_proj = nnx.Param(_init(rngs.params(), (d, cfg.num_kv_heads * hd), pd))
        self.o_proj = nnx.Param(_init(rngs.params(), (cfg.num_heads * hd, d), pd))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, pd)

    def __call__(self, x, positions, segment_ids=None, kv=None):
        """x [B, T, D], positions [B, T] int32, segment_ids [B, T] int32 or None.

        kv None (full sequence): token i attends to tokens j <= i of its row (the index, not the
        position value) that share its segment id when segment_ids is given; positions only feed
        RoPE. kv: this layer's cache ``(k [B, S, Hkv, Dh], v [B, S, Hkv, Dh])``. Cache slot j holds
        absolute position j; new keys are written at their positions and a query at position p sees
        slots <= p. Returns ``(y [B, T, D], new kv or None)``.
        """
        cfg, dt = self.cfg, self.cfg.dtype
        b, t, _ = x.shape
        q = (x @ self.q_proj[...].astype(dt)).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = (x @ self.k_proj[...].astype(dt)).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = (x @ self.v_proj[...].astype(dt)).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)

        if kv is None:
            # Causal by index within the row, never by position value: right padding (positions 0)
            # then sits after every real token and stays invisible to them (DESIGN.md §5).
            keys, values = k, v
            idx = jnp.arange(t)
            mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, t, t))  # [B, T, S=T]
            if segment_ids is not None:
                mask &= segment_ids[:, None, :] == segment_ids[:, :, None]
        else:
            rows = jnp.arange(b)[:, None]
            keys = kv[0].at[rows, positions].set(k.astype(kv[0].dtype))
            values = kv[1].at[rows, positions].set(v.astype(kv[1].dtype))
            kv = (keys, values)
            keys, values = keys.astype(dt), values.astype(dt)
            slots = jnp.arange(keys.shape[1])
            mask = slots[None, None, :] <= positions[:, :, None]

        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim)
        scores = jnp.einsum("btkgh,bskh->bkgts", q, keys).astype(jnp.float32)
        scores = scores * (cfg.head_dim ** -0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, values).reshape(b, t, -1)
        return out @ self.o_proj[...].astype(dt), kv


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward block used by the leading dense layers."""

    def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
        d, i, pd = cfg.hidden_size, cfg.dense_intermediate_size, cfg.param_dtype
        self.dtype = cfg.dtype
        self.gate_proj = nnx.Param(_init(rngs.params(), (d, i), pd))
        self.up_proj = nnx.Param(_init(rngs.params(), (d, i), pd))
        self.down_proj = nnx.Param(_init(rngs.params(), (i, d), pd))

    def __call__(self, x):
        dt = self.dtype
        h = jax.nn.silu(x @ self.gate_proj[...].astype(dt)) * (x @ self.up_proj[...].astype(dt))
        return h @ self.down_proj[...].astype(dt)
