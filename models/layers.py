"""Small NNX building blocks: RMSNorm, rotary embeddings, GQA attention over a functional KV cache,
and the dense SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.config import MoeConfig

_init = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, statistics in float32 (as Hugging Face Qwen3 does)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None) -> jax.Array:
    """Rotary embedding, half-split ("rotate_half") convention. x [B, T, H, Dh], positions [B, T].

    rotary_dim (default Dh): rotate the first rotary_dim features only, pass the rest through
    (GLM-4.5's ``partial_rotary_factor``)."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        rot = apply_rope(x[..., :rotary_dim], positions, theta)
        return jnp.concatenate([rot, x[..., rotary_dim:]], axis=-1)
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE and optional q/k RMSNorm: per head (Qwen3, GLM-4.5) or over
    the whole projection (OLMoE, ``qk_norm_scope="full"``); optional q/k/v bias (GLM-4.5), partial
    RoPE (GLM-4.5) and q/k/v clipping (OLMoE ``clip_qkv``)."""

    def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
        d, hd, pd = cfg.hidden_size, cfg.head_dim, cfg.param_dtype
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.cfg = cfg
        self.q_proj = nnx.Param(_init(rngs.params(), (d, q), pd), logical_axes=("embed", "heads"))
        self.k_proj = nnx.Param(_init(rngs.params(), (d, kv), pd), logical_axes=("embed", "kv_heads"))
        self.v_proj = nnx.Param(_init(rngs.params(), (d, kv), pd), logical_axes=("embed", "kv_heads"))
        self.o_proj = nnx.Param(_init(rngs.params(), (q, d), pd), logical_axes=("heads", "embed"))
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((q,), pd), logical_axes=("heads",))
            self.k_bias = nnx.Param(jnp.zeros((kv,), pd), logical_axes=("kv_heads",))
            self.v_bias = nnx.Param(jnp.zeros((kv,), pd), logical_axes=("kv_heads",))
        if cfg.qk_norm:
            full = cfg.qk_norm_scope == "full"
            self.q_norm = RMSNorm(q if full else hd, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(kv if full else hd, cfg.rms_norm_eps, pd)

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
        q, k, v = (x @ self.q_proj[...].astype(dt), x @ self.k_proj[...].astype(dt),
                   x @ self.v_proj[...].astype(dt))
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt), v + self.v_bias[...].astype(dt)
        if cfg.qk_norm and cfg.qk_norm_scope == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and cfg.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
        q = apply_rope(q, positions, cfg.rope_theta, rotary)
        k = apply_rope(k, positions, cfg.rope_theta, rotary)
        out, kv = attend(cfg, q, k, v, positions, segment_ids, kv)
        return out.reshape(b, t, -1) @ self.o_proj[...].astype(dt), kv



def attend(cfg: MoeConfig, q, k, v, positions, segment_ids=None, kv=None):
    """Masked softmax attention over a functional cache (shared by GQA and MLA).

    q [B, T, H, Dh]; k, v [B, T, Hkv, Dh] (after RoPE); positions [B, T]; segment_ids [B, T] or None;
    kv None (full sequence) or the layer's cache ``(k [B, S, Hkv, Dh], v [B, S, Hkv, Dh])``.
    Returns ``(out [B, T, H, Dh], new kv or None)``; scores are scaled by ``cfg.head_dim ** -0.5``.
    The kernel is ``cfg.attention_impl`` (models/attention.py).
    """
    dt = cfg.dtype
    if kv is not None and not isinstance(kv, tuple):  # a page pool (models/paged.py)
        from models import paged

        if kv.v is None:  # one combined pool, keys and values interleaved by head
            pk, pv = paged.write_kv(kv.k, k, v, kv.meta, dt, kv.layer), None
        else:
            pk, pv = paged.write(kv.k, k, kv.meta, dt, kv.layer), paged.write(kv.v, v, kv.meta, dt, kv.layer)
        out = paged.ragged_attention(q, (pk,), pv, positions, kv.meta, scale=cfg.head_dim ** -0.5, dtype=dt,
                                     impl=cfg.attention_impl, layer=kv.layer)
        return out, (pk, pv)
    if kv is None:
        # Causal by index within the row, never by position value: right padding (positions 0)
        # then sits after every real token and stays invisible to them (docs/design.md §5).
        keys, values, q_positions = k, v, None
    else:
        rows = jnp.arange(q.shape[0])[:, None]
        keys = kv[0].at[rows, positions].set(k.astype(kv[0].dtype))
        values = kv[1].at[rows, positions].set(v.astype(kv[1].dtype))
        kv = (keys, values)
        keys, values, q_positions, segment_ids = keys.astype(dt), values.astype(dt), positions, None
    out = attention(q, keys, values, scale=cfg.head_dim ** -0.5, segment_ids=segment_ids,
                    q_positions=q_positions, impl=cfg.attention_impl, block=cfg.attention_block)
    return out, kv


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward block used by the leading dense layers (``dense_intermediate_size``) and
    as the MoE layers' shared experts (``intermediate_size`` given)."""

    def __init__(self, cfg: MoeConfig, *, intermediate_size: int | None = None, rngs: nnx.Rngs):
        d, pd = cfg.hidden_size, cfg.param_dtype
        i = cfg.dense_intermediate_size if intermediate_size is None else intermediate_size
        self.dtype = cfg.dtype
        self.gate_proj = nnx.Param(_init(rngs.params(), (d, i), pd), logical_axes=("embed", "mlp"))
        self.up_proj = nnx.Param(_init(rngs.params(), (d, i), pd), logical_axes=("embed", "mlp"))
        self.down_proj = nnx.Param(_init(rngs.params(), (i, d), pd), logical_axes=("mlp", "embed"))

    def __call__(self, x):
        dt = self.dtype
        h = jax.nn.silu(x @ self.gate_proj[...].astype(dt)) * (x @ self.up_proj[...].astype(dt))
        return h @ self.down_proj[...].astype(dt)
