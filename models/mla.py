"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over the same functional KV cache as GQA.

Queries come from a low-rank path (``q_a_proj`` -> RMSNorm -> ``q_b_proj``, or one ``q_proj`` when
``q_lora_rank == 0``); keys and values from a shared latent (``kv_a_proj_with_mqa`` -> RMSNorm ->
``kv_b_proj``) plus one RoPE key shared by every head. Each head's query/key is
``[nope (qk_nope_head_dim) | rope (qk_rope_head_dim)]``, ``head_dim`` in all.

Two cache forms (``MoeConfig.mla_cache``, models/cache.py):

- ``"latent"`` (default): the cache holds the normalised latent c_kv [B, S, 1, kv_lora_rank] and the
  roped shared key k_rot [B, S, 1, qk_rope_head_dim] (DeepSeek-V3: 576 numbers per token and layer).
  Attention over it absorbs the up-projection ``kv_b_proj = [W_uk | W_uv]`` per head: the query's
  nope half goes through W_uk into latent space (q_lat [B, T, H, kv_lora_rank]), so
  ``score = q_lat . c_kv + q_rot . k_rot`` without expanding any key, and the output is
  ``(probs @ c_kv) @ W_uv`` per head. Full-sequence calls (no cache) use the expanded form.
- ``"expanded"``: every head's full key [B, S, H, head_dim] and its value zero-padded to head_dim,
  the GQA layout read by :func:`models.layers.attend` (``2 * H * head_dim`` numbers: 49152).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.cache import is_latent
from models.config import MoeConfig
from models.layers import RMSNorm, apply_rope, attend

_init = nnx.initializers.normal(stddev=0.02)
_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def rope_interleaved(x, positions, theta: float):
    """DeepSeek's interleaved RoPE (pairs (x0, x1), (x2, x3), ... share a frequency) on x [B, T, H, R].

    Returned de-interleaved (evens then odds), as transformers does; q and k get the same
    permutation, so their dot products are unchanged.
    """
    return apply_rope(jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), positions, theta)


class MLAttention(nnx.Module):
    """``attn(x, positions, segment_ids=None, kv=None) -> (y [B, T, D], new kv or None)`` (see
    :func:`models.layers.attend` for masking and the cache)."""

    def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
        d, h, hd, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.param_dtype
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.q_a_proj = nnx.Param(_init(rngs.params(), (d, cfg.q_lora_rank), pd), logical_axes=("embed", "q_lora"))
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, pd)
            self.q_b_proj = nnx.Param(_init(rngs.params(), (cfg.q_lora_rank, h * hd), pd),
                                     logical_axes=("q_lora", "heads"))
        else:
            self.q_proj = nnx.Param(_init(rngs.params(), (d, h * hd), pd), logical_axes=("embed", "heads"))
        self.kv_a_proj = nnx.Param(_init(rngs.params(), (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), pd),
                                  logical_axes=("embed", "kv_lora"))
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS, pd)
        self.kv_b_proj = nnx.Param(_init(rngs.params(), (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim
                                                                                 + cfg.v_head_dim)), pd),
                                  logical_axes=("kv_lora", "heads"))
        self.o_proj = nnx.Param(_init(rngs.params(), (h * cfg.v_head_dim, d), pd), logical_axes=("heads", "embed"))

    def __call__(self, x, positions, segment_ids=None, kv=None):
        """x [B, T, D]; positions [B, T]; kv: this layer's cache (models/cache.py: latent
        ``(c_kv [B, S, 1, kv_lora_rank], k_rot [B, S, 1, rope])`` or expanded ``(k, v)`` [B, S, H,
        head_dim]) or None."""
        cfg, dt = self.cfg, self.cfg.dtype
        b, t, _ = x.shape
        h, nope, rope, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        w = lambda p: p[...].astype(dt)
        if cfg.q_lora_rank:
            q = self.q_a_norm(x @ w(self.q_a_proj)) @ w(self.q_b_proj)
        else:
            q = x @ w(self.q_proj)
        q = q.reshape(b, t, h, cfg.head_dim)
        latent = x @ w(self.kv_a_proj)  # [B, T, kv_lora_rank + rope]
        kv_nope = self.kv_a_norm(latent[..., :cfg.kv_lora_rank])
        k_rot = latent[..., cfg.kv_lora_rank:][:, :, None, :]  # [B, T, 1, rope]: shared by the heads
        rot = rope_interleaved if cfg.rope_interleave else apply_rope
        q_rot, k_rot = rot(q[..., nope:], positions, cfg.rope_theta), rot(k_rot, positions, cfg.rope_theta)
        if kv is not None and is_latent(cfg):
            w_kv = w(self.kv_b_proj).reshape(cfg.kv_lora_rank, h, nope + vd)  # [R, H, nope + vd]
            out, kv = self._attend_latent(q[..., :nope], q_rot, kv_nope, k_rot, w_kv, positions, kv)
            return out.reshape(b, t, h * vd) @ w(self.o_proj), kv
        q = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
        kvb = (kv_nope @ w(self.kv_b_proj)).reshape(b, t, h, nope + vd)
        k = jnp.concatenate([kvb[..., :nope], jnp.broadcast_to(k_rot, (b, t, h, rope))], axis=-1)
        v = jnp.pad(kvb[..., nope:], ((0, 0), (0, 0), (0, 0), (0, cfg.head_dim - vd)))
        out, kv = attend(cfg, q, k, v, positions, segment_ids, kv)  # [B, T, H, head_dim]
        return out[..., :vd].reshape(b, t, h * vd) @ w(self.o_proj), kv

    def _attend_latent(self, q_nope, q_rot, c_kv, k_rot, w_kv, positions, kv):
        """Absorbed attention over the latent cache.

        q_nope [B, T, H, nope]; q_rot [B, T, H, rope]; c_kv [B, T, R]; k_rot [B, T, 1, rope]; w_kv
        [R, H, nope + vd]; kv ``(c [B, S, 1, R], r [B, S, 1, rope])``. New entries are written at their
        positions; a query at position p sees slots <= p (as :func:`models.layers.attend`). Returns
        ``(out [B, T, H, vd], new kv)``."""
        cfg, dt = self.cfg, self.cfg.dtype
        nope = cfg.qk_nope_head_dim
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_kv[..., :nope])  # the key half absorbed
        if not isinstance(kv, tuple):  # a page pool (models/paged.py): the same MQA over the latent pages
            from models import paged

            c = paged.write(kv.k, c_kv[:, :, None, :], kv.meta, dt, kv.layer)
            r = paged.write(kv.v, k_rot, kv.meta, dt, kv.layer)
            out_lat = paged.ragged_attention(jnp.concatenate([q_lat, q_rot], axis=-1), (c, r), c, positions, kv.meta,
                                             scale=cfg.head_dim ** -0.5, dtype=dt, impl=cfg.attention_impl,
                                             layer=kv.layer)
            return jnp.einsum("bthr,rhv->bthv", out_lat, w_kv[..., nope:]), (c, r)
        rows = jnp.arange(q_nope.shape[0])[:, None]
        c = kv[0].at[rows, positions].set(c_kv[:, :, None, :].astype(kv[0].dtype))
        r = kv[1].at[rows, positions].set(k_rot.astype(kv[1].dtype))
        c_s, r_s = c[:, :, 0].astype(dt), r[:, :, 0].astype(dt)  # [B, S, R], [B, S, rope]
        # one shared latent "kv head": keys [c_kv | k_rot], values c_kv (MQA over the latent), so every
        # attention kernel applies and no [H, T, S] scores are held beyond the kernel's blocks
        out_lat = attention(jnp.concatenate([q_lat, q_rot], axis=-1),
                            jnp.concatenate([c_s, r_s], axis=-1)[:, :, None], c_s[:, :, None],
                            scale=cfg.head_dim ** -0.5, q_positions=positions, impl=cfg.attention_impl,
                            block=cfg.attention_block)  # [B, T, H, R]
        return jnp.einsum("bthr,rhv->bthv", out_lat, w_kv[..., nope:]), (c, r)  # the value half absorbed
