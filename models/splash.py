"""TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) for the full-sequence form.

The kernel takes one sequence, ``q [H, T, D]``, ``k [Hkv, S, D]``, ``v [Hkv, S, Dv]`` (GQA by head
groups), a static causal mask per query head and optional ``SegmentIds``; it is vmapped over the
batch and run inside a ``jax.shard_map`` over the batch axes of the current mesh
(:data:`models.axes.BATCH_AXES` that it has), so each chip runs the kernel on its own rows. The kernel
does not scale the scores: q is multiplied by ``scale`` first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.axes import BATCH_AXES

# the kernel's tiles: a sequence shorter than one, or not a multiple of it, falls back to blockwise
BLOCK = 128


def supports(q, k, v) -> bool:
    """Whether the kernel's tiling covers these shapes (sequence a multiple of :data:`BLOCK`)."""
    return q.shape[1] % BLOCK == 0 and k.shape[1] % BLOCK == 0


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, t: int, s: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kern
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((t, s))] * heads)
    bs = min(BLOCK, t), min(BLOCK, s)
    sizes = kern.BlockSizes(block_q=bs[0], block_kv=bs[1], block_kv_compute=bs[1], block_q_dkv=bs[0],
                            block_kv_dkv=bs[1], block_kv_dkv_compute=bs[1], block_q_dq=bs[0], block_kv_dq=bs[1])
    return kern.make_splash_mha(mask=mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _batch_axes(mesh, b: int) -> tuple[str, ...]:
    """The mesh's batch axes (size > 1) whose product divides b, longest prefix first."""
    axes = [a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1]
    while axes and b % math.prod(mesh.shape[a] for a in axes):
        axes.pop()
    return tuple(axes)


def splash_attention(q, k, v, *, scale: float, segment_ids=None, interpret: bool = False):
    """q [B, T, H, Dh]; k [B, S, Hkv, Dh]; v [B, S, Hkv, Dv]; segment_ids [B, T] or None ->
    out [B, T, H, Dv] in q's dtype. Causal by index; ``interpret=True`` runs the Pallas interpreter."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    b, t, h, _ = q.shape
    kernel = _kernel(h, t, k.shape[1], interpret)

    def local(q, k, v, seg):
        qh = (q * jnp.asarray(scale, q.dtype)).transpose(0, 2, 1, 3)  # [b, H, T, D]
        kh, vh = k.transpose(0, 2, 1, 3), v.astype(q.dtype).transpose(0, 2, 1, 3)
        if seg is None:
            out = jax.vmap(kernel)(qh, kh, vh)
        else:
            out = jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, segment_ids=SegmentIds(q=s_, kv=s_)))(
                qh, kh, vh, seg.astype(jnp.int32))
        return out.transpose(0, 2, 1, 3).astype(q.dtype)

    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else _batch_axes(mesh, b)
    if not axes:
        return local(q, k, v, segment_ids)
    row = P(axes)
    if segment_ids is None:
        fn = jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(row, row, row),
                           out_specs=row, check_vma=False)
        return fn(q, k, v)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(row, row, row, row), out_specs=row, check_vma=False)
    return fn(q, k, v, segment_ids)
