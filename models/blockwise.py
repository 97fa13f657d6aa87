"""Blockwise (flash-style) attention in plain XLA: online softmax over key blocks, queries blocked too.

The forward keeps, per query block, the running max ``m``, the running sum ``l`` and the unnormalised
output in float32, visiting key blocks in order; it stores only ``out`` and the log-sum-exp. The
backward (a ``jax.custom_vjp``) recomputes each block's probabilities from them (FlashAttention-2), so
neither pass holds more than one ``[B, Hkv, G, bq, bk]`` block of scores: live memory is O(T * block)
instead of O(T * S).

Key blocks past the last slot any query of the block may see are skipped (a ``fori_loop`` with a
bound computed per query block): causal training does about half the work of the dense form, and a
decode step reads only the part of the cache up to its furthest position.

The mask contract is :mod:`models.attention`'s. T and S need not be multiples of the block: the
inputs are padded, padded keys are past every query's last slot and padded queries see nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.attention import MASK_VALUE

_f32 = jnp.float32


def pick_block(n: int, block: int) -> int:
    """A block size for a length n: n itself when it fits, else a divisor of n in [block/2, block]
    (no padding), else ``block`` (n is padded up to a multiple)."""
    if n <= block:
        return n
    for b in range(block, block // 2 - 1, -1):
        if n % b == 0:
            return b
    return block


def blockwise_attention(q, k, v, *, scale: float, segment_ids=None, q_positions=None, block: int = 512):
    """q [B, T, H, Dh]; k [B, S, Hkv, Dh]; v [B, S, Hkv, Dv] -> out [B, T, H, Dv] in q's dtype.

    segment_ids [B, T] (full-sequence form) or q_positions [B, T] (cache form), as
    :func:`models.attention.attention`. ``block`` bounds both the query and the key block.
    """
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    bq, bk = pick_block(t, block), pick_block(s, block)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    causal = q_positions is None
    lim = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if causal else q_positions.astype(jnp.int32)
    lim = jnp.minimum(lim, s - 1)  # a slot past the cache does not exist
    lim = jnp.pad(lim, ((0, 0), (0, tp - t)), constant_values=-1)  # padded queries see nothing
    if segment_ids is None:
        seg_q, seg_k = jnp.zeros((b, tp), jnp.int32), jnp.zeros((b, sp), jnp.int32)
    else:
        seg = segment_ids.astype(jnp.int32)
        seg_q = jnp.pad(seg, ((0, 0), (0, tp - t)))
        seg_k = jnp.pad(seg, ((0, 0), (0, sp - s)))
    q5 = jnp.pad(q.reshape(b, t, hkv, h // hkv, d), ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    kp = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    vp = jnp.pad(v.astype(q.dtype), ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    out = _flash(float(scale), bq, bk, causal, q5, kp.astype(q.dtype), vp, lim, seg_q, seg_k)
    return out[:, :t].reshape(b, t, h, -1)


def _num_key_blocks(i, lim_i, bq: int, bk: int, nk: int, causal: bool):
    """Key blocks query block i needs: up to the furthest slot one of its queries sees."""
    last = (i + 1) * bq - 1 if causal else jnp.max(lim_i)  # causal: known from the index, no reduction
    return jnp.clip(last // bk + 1, 0, nk) if not causal else jnp.minimum(last // bk + 1, nk)


def _block_scores(qi, kj, lim_i, seg_qi, seg_kj, j, bk: int, scale: float):
    """Scores [B, Hkv, G, bq, bk] in float32 and the block's mask [B, 1, 1, bq, bk]."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=_f32) * scale
    slot = j * bk + jnp.arange(bk, dtype=jnp.int32)
    mask = (slot[None, None, :] <= lim_i[:, :, None]) & (seg_qi[:, :, None] == seg_kj[:, None, :])
    mask = mask[:, None, None]
    return jnp.where(mask, s, MASK_VALUE), mask


def _slice(x, i, size, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)


def _forward(scale, bq, bk, causal, q, k, v, lim, seg_q, seg_k):
    """q [B, Tp, Hkv, G, D]; k [B, Sp, Hkv, D]; v [B, Sp, Hkv, Dv] -> out [B, Tp, Hkv, G, Dv] (q's dtype),
    lse [B, Hkv, G, Tp] float32 (0 for a row that sees nothing)."""
    b, tp, hkv, g, _ = q.shape
    dv = v.shape[-1]
    nq, nk = tp // bq, k.shape[1] // bk

    def q_block(i, carry):
        out, lse = carry
        qi, lim_i, seg_qi = _slice(q, i, bq), _slice(lim, i, bq), _slice(seg_q, i, bq)

        def k_block(j, acc):
            m, l, o = acc
            s, mask = _block_scores(qi, _slice(k, j, bk), lim_i, seg_qi, _slice(seg_k, j, bk), j, bk, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _slice(v, j, bk), preferred_element_type=_f32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * o + pv

        init = (jnp.full((b, hkv, g, bq), MASK_VALUE, _f32), jnp.zeros((b, hkv, g, bq), _f32),
                jnp.zeros((b, hkv, g, bq, dv), _f32))
        m, l, o = jax.lax.fori_loop(0, _num_key_blocks(i, lim_i, bq, bk, nk, causal), k_block, init)
        seen = l > 0
        o = o / jnp.where(seen, l, 1.0)[..., None]
        out = jax.lax.dynamic_update_slice_in_dim(out, o.transpose(0, 3, 1, 2, 4).astype(out.dtype), i * bq, 1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0),
                                                  i * bq, 3)
        return out, lse

    init = (jnp.zeros((b, tp, hkv, g, dv), q.dtype), jnp.zeros((b, hkv, g, tp), _f32))
    return jax.lax.fori_loop(0, nq, q_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(scale, bq, bk, causal, q, k, v, lim, seg_q, seg_k):
    return _forward(scale, bq, bk, causal, q, k, v, lim, seg_q, seg_k)[0]


def _flash_fwd(scale, bq, bk, causal, q, k, v, lim, seg_q, seg_k):
    out, lse = _forward(scale, bq, bk, causal, q, k, v, lim, seg_q, seg_k)
    return out, (q, k, v, out, lse, lim, seg_q, seg_k)


def _flash_bwd(scale, bq, bk, causal, res, dout):
    """Recompute each block's probabilities from the stored log-sum-exp; dq per query block, dk and dv
    accumulated over query blocks in float32."""
    q, k, v, out, lse, lim, seg_q, seg_k = res
    b, tp, hkv, g, d = q.shape
    nq, nk = tp // bq, k.shape[1] // bk
    dt = q.dtype
    # delta_i = sum_d dout * out (the softmax's row term), [B, Hkv, G, Tp]
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dout.astype(_f32), out.astype(_f32))

    def q_block(i, carry):
        dq, dk, dv = carry
        qi, doi = _slice(q, i, bq), _slice(dout, i, bq).astype(dt)
        lim_i, seg_qi = _slice(lim, i, bq), _slice(seg_q, i, bq)
        lse_i, delta_i = _slice(lse, i, bq, 3), _slice(delta, i, bq, 3)

        def k_block(j, acc):
            dqi, dk, dv = acc
            kj, vj = _slice(k, j, bk), _slice(v, j, bk)
            s, mask = _block_scores(qi, kj, lim_i, seg_qi, _slice(seg_k, j, bk), j, bk, scale)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            dvj = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dt), doi, preferred_element_type=_f32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=_f32)
            ds = (p * (dp - delta_i[..., None])).astype(dt)
            dqi = dqi + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=_f32) * scale
            dkj = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=_f32) * scale
            dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, j, bk) + dkj, j * bk, 1)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, j, bk) + dvj, j * bk, 1)
            return dqi, dk, dv

        init = (jnp.zeros(qi.shape, _f32), dk, dv)
        dqi, dk, dv = jax.lax.fori_loop(0, _num_key_blocks(i, lim_i, bq, bk, nk, causal), k_block, init)
        return jax.lax.dynamic_update_slice_in_dim(dq, dqi.astype(dq.dtype), i * bq, 1), dk, dv

    init = (jnp.zeros(q.shape, dt), jnp.zeros(k.shape, _f32), jnp.zeros(v.shape, _f32))
    dq, dk, dv = jax.lax.fori_loop(0, nq, q_block, init)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
