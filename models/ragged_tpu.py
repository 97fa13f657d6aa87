"""The TPU Pallas ragged paged attention kernel over the engine's page pool.

The kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, jax 0.10.2) takes

- ``q [T, H, D]``: the queries of ``num_seqs`` sequences packed back to back, sequence ``s`` at
  ``q[cu_q_lens[s]:cu_q_lens[s + 1]]``; query ``i`` of a sequence of ``q_len`` queries sits at position
  ``kv_len - q_len + i`` (its queries are the last ``q_len`` tokens of its ``kv_len`` keys; causal);
- ``kv_pages [P, ps, 2 * Hkv, D]``: keys and values in one pool, interleaved by head (key head ``h``
  at ``2h``, value head ``h`` at ``2h + 1``), with one head dim for q, k and v (a multiple of 128: its
  softmax state is held in 128-lane rows);
- ``kv_lens [S]``, ``page_indices [S, pages_per_seq]``, ``cu_q_lens [S + 1]`` int32 and ``num_seqs [1]``.

Our step (:mod:`models.paged`) differs in three ways, converted here:

- **Rows are padded, the kernel's sequences are packed.** A prefill row always holds ``prefill_len``
  tokens; a prompt's last chunk fills only ``k`` of them and the planner
  (``r3jax.engine.planner.build``) gives the padding the last real position, so it sees what the last
  real token sees. The adapter packs each row's ``k = kv_len - positions[first token]`` real tokens
  (clipped to ``[1, prefill_len]``; a padding row, ``kv_len`` 1 at position 0, counts one) and gives
  every padding token its row's last real token's output (the XLA kernel computes it from the padding
  token's own query instead: the values differ, and nothing reads them: the MoE is dropless, padding
  keys go to the trash page, and the engine samples and keeps routes at real tokens only). This is an
  ``[N, H, D]`` scatter and gather, small next to the pool. The contract this relies on, which the
  planner keeps: a row's real tokens sit at consecutive positions ending at ``kv_len - 1``.
- **The pool layout.** The engine's GQA pool is already the kernel's: one combined pool per layer
  group ``kv [n, P, ps, 2 * Hkv, D]`` interleaved by head (:mod:`models.paged`). A layer's pages are
  read in place: the stacked pool is viewed as ``[n * P, ps, 2 * Hkv, D]`` (a reshape, no copy) and
  layer ``j``'s page ids are offset by ``j * P``, so the kernel reads only the live pages of each row.
  Separate ``k``, ``v`` pools (a caller's own) are still taken, interleaved at the call by
  :func:`combined_pages`: a full copy of both, every call.
- **An unsigned-int pool** (the CPU bit-pattern storage) is bitcast back to the float dtype; on TPU the
  pool is stored as floats and the bitcast is absent.

What the kernel does not cover falls back to the XLA kernel under ``impl="auto"`` (and raises under
``impl="pallas"``, :func:`unsupported`): MLA's latent cache (two key arrays, key dim != value dim), a
head dim that is not a multiple of 128, combined kv heads the kernel cannot tile.

**Meshes.** A Mosaic kernel cannot be partitioned automatically, so under a mesh the call runs in a
``jax.shard_map``: heads along ``tensor`` when the mesh has it and it divides the kv heads (the pool's
kv heads live there, :mod:`r3jax.engine.sharding`; interleaving keeps each k/v pair in one shard),
everything else replicated.

**Compiling ahead of time** for a TPU topology from a CPU host needs no patching of JAX when the call
is traced under a mesh of the topology's devices (``jax.set_mesh(mesh)``; a one-chip slice: a mesh of
one device): Pallas's TPU lowering asks ``tpu_info.get_device_kind()``, which reads the current
abstract mesh's device (``"TPU v5"`` for a v5p topology) before the default backend's. Without a mesh
it asks the default device (the CPU) and raises ``Unsupported TPU device kind: cpu``. The kernel's own
block-size lookup (``get_tuned_block_sizes``) always asks ``jax.devices()[0]``, so
:func:`block_sizes` does the same lookup for the target device kind and the kernel is called with
explicit block sizes.

**Interpret mode**: the kernel's ``pallas_call`` takes no ``interpret`` argument; under
``pltpu.force_tpu_interpret_mode()`` jax 0.10.2's TPU interpreter stops at two of its memory accesses (a
read through a reshaped VMEM ref, ``kv_bufs...wait().reshape(...)``, and a masked store into a buffer
whose later dims are smaller than its first). The tests fill both gaps around the interpreter's own
callbacks (tests/models/pallas_interpret.py) and run the real kernel on CPU against
:func:`models.paged.pages_reference`, for separate pools and the engine's stacked combined pool; they
also check this adapter through the kernel's pure-JAX reference, ``ref_ragged_paged_attention``, and
compile the real kernel for a TPU topology.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

LANES = 128  # the kernel's head dim granule (its l/m scratch rows are 128 lanes wide)


def unsupported(q, keys, values, dtype) -> str | None:
    """Why the kernel cannot take this call (None: it can). q [1, N, H, Dq]; keys a tuple of [(n,) P,
    ps, Hkv, Dk] and values [(n,) P, ps, Hkv, Dv], or keys ``(kv,)`` [(n,) P, ps, 2 * Hkv, D] and values
    None (a combined pool); dtype: the cache's float dtype."""
    if len(keys) != 1:
        return f"{len(keys)} key arrays (MLA's latent cache): the kernel takes one k and one v per head"
    hkv, dv = _kv_heads(keys, values), (keys[0] if values is None else values).shape[-1]
    dq, dk = q.shape[-1], keys[0].shape[-1]
    if not dq == dk == dv:
        return f"head dims q={dq}, k={dk}, v={dv}: the kernel takes one head dim"
    if dq % LANES:
        return f"head_dim={dq}: the kernel takes a multiple of {LANES}"
    h = q.shape[2]
    if h % hkv:
        return f"num_heads={h} is not a multiple of num_kv_heads={hkv}"
    packing = 4 // jnp.dtype(dtype).itemsize
    c = 2 * hkv
    if c % packing or not (c // packing in (1, 2, 4, 8) or (c // packing) % 8 == 0):
        return f"2 * num_kv_heads={c} combined heads in {jnp.dtype(dtype).name}: the kernel cannot tile them"
    return None


def combined_pages(k, v, dtype):
    """k, v [P, ps, Hkv, D] (float or its unsigned-int bits) -> [P, ps, 2 * Hkv, D] in ``dtype``, k
    head h at 2h, v head h at 2h + 1. A full copy of both pools (module docstring)."""
    from models.paged import _loaded

    k, v = _loaded(k, dtype), _loaded(v, dtype)
    p, ps, hkv, d = k.shape
    return jnp.stack([k, v], axis=3).reshape(p, ps, 2 * hkv, d)


def _kv_heads(keys, values) -> int:
    return keys[0].shape[-2] // 2 if values is None else values.shape[-2]


def layer_pages(kv, table, layer):
    """A stacked combined pool [n, P, ps, 2Hkv, D] viewed as [n * P, ps, 2Hkv, D] (a reshape: no copy)
    and ``table`` [R, pages_per_row] moved to layer ``layer``'s pages (``+ layer * P``)."""
    n, p = kv.shape[:2]
    return kv.reshape(n * p, *kv.shape[2:]), table + layer * p


def packing(positions, meta):
    """Where each of a step's N tokens goes among the kernel's packed queries.

    positions [1, N]; meta: :class:`models.paged.PagedMeta`. Returns ``(slot [N], real [N] bool,
    cu_q_lens [R + 1])``: token n's query is ``q_packed[slot[n]]`` when ``real[n]``; a padding token
    reads its output from ``slot[n]``, its row's last real token."""
    lay = meta.layout
    d, p, t = lay.decode_rows, lay.prefill_rows, lay.prefill_len
    pos = positions[0]
    first = pos[d:].reshape(p, t)[:, 0] if p else jnp.zeros((0,), jnp.int32)
    q_len = jnp.concatenate([jnp.ones((d,), jnp.int32),
                             jnp.clip(meta.kv_len[d:] - first, 1, t).astype(jnp.int32)])
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len, dtype=jnp.int32)])
    j = jnp.arange(t, dtype=jnp.int32)[None]  # index within a prefill row
    k = q_len[d:, None]
    slot = jnp.concatenate([jnp.arange(d, dtype=jnp.int32), (cu[d:-1, None] + jnp.minimum(j, k - 1)).reshape(-1)])
    real = jnp.concatenate([jnp.ones((d,), bool), (j < k).reshape(-1)])
    return slot, real, cu


def kernel_inputs(q, keys, values, positions, meta, dtype, layer=None):
    """Our step's arrays as the kernel's arguments (module docstring).

    q [1, N, H, D]; keys ``(kv,)`` a combined pool [P, ps, 2Hkv, D] with values None, or ``(k,)`` and
    values [P, ps, Hkv, D]; with ``layer``, pages stacked [n, P, ...] (a combined pool is then read in
    place, :func:`layer_pages`); positions [1, N]. Returns ``(inputs, slot)``: inputs = ``(q [N, H, D],
    kv_pages [P', ps, 2Hkv, D], kv_lens [R], page_indices [R, pages_per_row], cu_q_lens [R + 1],
    num_seqs [1])`` in the kernel's order, every row a sequence (a padding row reads its layer's page
    0's first slot); slot [N] for :func:`unpack`."""
    from models.paged import _loaded

    slot, real, cu = packing(positions, meta)
    n = q.shape[1]
    qp = jnp.zeros(q.shape[1:], dtype).at[jnp.where(real, slot, n)].set(q[0].astype(dtype), mode="drop")
    rows = meta.kv_len.shape[0]
    table = meta.table.astype(jnp.int32)
    if values is None:
        kv = keys[0]
        if layer is not None:
            kv, table = layer_pages(kv, table, layer)
        kv = _loaded(kv, dtype)
    else:
        k = keys[0] if layer is None else keys[0][layer]
        kv = combined_pages(k, values if layer is None else values[layer], dtype)
    inputs = (qp, kv, meta.kv_len.astype(jnp.int32), table, cu, jnp.full((1,), rows, jnp.int32))
    return inputs, slot


def unpack(out, slot, like):
    """The kernel's packed output [N, H, D] -> our token order [1, N, H, D] in ``like``'s dtype."""
    return out[slot][None].astype(like.dtype)


def _device_kind() -> str | None:
    """The target's device kind: the current mesh's device (also an ahead-of-time topology), else the
    default device's."""
    dev = jax.sharding.get_abstract_mesh().abstract_device
    if dev is not None:
        return dev.device_kind
    return jax.devices()[0].device_kind


def block_sizes(dtype, heads_per_blk: int, kv_heads_per_blk: int, head_dim: int, page_size: int, tokens: int,
                pages_per_seq: int, device_kind: str | None = None) -> tuple[int, int]:
    """``(num_kv_pages_per_block, num_queries_per_block)``: the kernel's ``get_tuned_block_sizes`` for
    ``device_kind`` (default: :func:`_device_kind`) rather than for ``jax.devices()[0]``."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tb

    kind = _device_kind() if device_kind is None else device_kind
    bkv, bq = 128, 32  # the kernel's defaults
    if kind == "TPU v4" or kind == "TPU v4 lite":
        bkv, bq = 32, 32  # its untuned v4 choice (fits VMEM)
    else:
        name = " ".join(kind.split()[:2])
        key = tb.simplify_key((dtype, dtype, heads_per_blk, kv_heads_per_blk, head_dim, page_size, tokens,
                               pages_per_seq))
        bkv, bq = tb.TUNED_BLOCK_SIZES.get(name, {}).get(key, (bkv, bq))
    return min(pages_per_seq, bkv), min(tokens, bq)


def _heads_axis(mesh, hkv: int) -> str | None:
    """The mesh axis the heads split over inside the shard_map: ``tensor`` when it divides Hkv."""
    if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 and hkv % mesh.shape["tensor"] == 0:
        return "tensor"
    return None


def ragged_paged_attention(q, keys, values, positions, meta, *, scale: float, dtype, layer=None):
    """:func:`models.paged.ragged_attention` on the Pallas kernel. Same arguments and result: q [1, N,
    H, D]; keys ``(kv,)`` [(n,) P, ps, 2Hkv, D] and values None, or keys ``(k,)`` and values [(n,) P,
    ps, Hkv, D]; ``layer`` when the pages are stacked; positions [1, N] -> [1, N, H, D] in q's dtype."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    why = unsupported(q, keys, values, dtype)
    if why is not None:
        raise ValueError(f"ragged_attention impl='pallas': {why}")
    inputs, slot = kernel_inputs(q, keys, values, positions, meta, dtype, layer)
    mesh = jax.sharding.get_abstract_mesh()
    hkv, h, d = _kv_heads(keys, values), q.shape[2], q.shape[3]
    axis = None if mesh.empty else _heads_axis(mesh, hkv)
    shards = 1 if axis is None else mesh.shape[axis]
    min_q, min_c = rpa.get_min_heads_per_blk(h // shards, 2 * hkv // shards, dtype, dtype)
    bkv, bq = block_sizes(dtype, min_q, min_c // 2, d, inputs[1].shape[1], q.shape[1], meta.table.shape[1])

    def call(qp, kv, kv_lens, table, cu, num_seqs):
        return rpa.ragged_paged_attention(qp, kv, kv_lens, table, cu, num_seqs, sm_scale=scale,
                                          num_kv_pages_per_block=bkv, num_queries_per_block=bq)

    if mesh.empty or mesh.size == 1:
        out = call(*inputs)
    else:
        heads = P(None, axis)
        specs = (heads, P(None, None, axis), P(), P(), P(), P())
        out = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*inputs)
    return unpack(out, slot, q)


def reference_via_kernel_contract(q, keys, values, positions, meta, *, scale: float, dtype, layer=None):
    """The same conversion run through the kernel's pure-JAX reference (``ref_ragged_paged_attention``,
    eager: it loops over sequences in Python). What the tests check the adapter with on CPU."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    inputs, slot = kernel_inputs(q, keys, values, positions, meta, dtype, layer)
    return unpack(rpa.ref_ragged_paged_attention(*inputs, sm_scale=scale), slot, q)
