"""A paged KV cache and ragged attention over it: what the engine's mixed prefill + decode steps run on.

Pool layout (per run of identical layers, as :class:`models.KVCache`): GQA keeps keys and values in
one pool per run, ``k[g]`` [n_g, num_pages, page_size, 2 * Hkv, head_dim] interleaved by head (key
head h at 2h, value head h at 2h + 1) and ``v`` empty: the layout the TPU ragged paged attention kernel
reads in place (as tpu-inference stores it), so a step copies nothing of the pool for it, and one
scatter writes a token's keys and values. MLA's latent cache (key and value dims differ) keeps two
pools, ``k[g]``, ``v[g]`` [n_g, num_pages, page_size, Hc, Dc] with ``(Hc, Dc)`` from
:func:`models.cache.cache_layout`. Page 0 is the trash page: padding writes there and nothing real
is ever read from it. A float pool may be stored as the unsigned ints of its width (CPU: XLA runs a
16-bit float scatter in f32 over the whole buffer; an int scatter touches only the written rows);
reads bitcast back.

A step feeds ``N = decode_rows + prefill_rows * prefill_len`` tokens as one ``[1, N]`` batch (the
model's projections, MLPs and experts see every token of the step at once, so the weights are read
once per step). Attention splits them by the static :class:`RaggedLayout`: ``decode_rows`` rows of
one token (the first ``decode_rows`` tokens), then ``prefill_rows`` rows of ``prefill_len`` tokens (a
chunk of some prompt each; several rows may be consecutive chunks of one prompt). Each row has a page
table; each token is written at ``(page, offset)`` first (:class:`PagedMeta`), then every query
attends over its row's pages to keys at positions ``<=`` its own, so a chunk sees the chunks before it
in the same step.

Kernels (:func:`ragged_attention`, ``impl``): ``"pallas"``, the TPU Pallas ragged paged attention
kernel (:mod:`models.ragged_tpu`; GQA with a head dim that is a multiple of 128; it reads the combined
pool in place, separate k and v pools it interleaves at the call, see there); ``"xla"``, an XLA kernel that
walks the row's pages in blocks with an online softmax, for as many blocks as the longest row in the
group needs (a dynamic trip count: a decode step reads the live pages only, never ``max_seq_len``);
``"auto"``: pallas when the target is a TPU and the kernel covers the call, xla otherwise. The target
is the current mesh's device platform when a mesh is set (so a program compiled ahead of time for a
TPU topology under ``jax.set_mesh`` gets the Pallas kernel), else ``jax.default_backend()``; on a
host of several TPU devices a program traced without a mesh gets xla (the kernel then runs in a
``jax.shard_map`` over the mesh, which it needs to know: trace the step under
``jax.set_mesh(placement.mesh)``). The
model passes ``MoeConfig.attention_impl``, whose full-sequence names map here as: ``"splash"`` -> auto
(the TPU Pallas kernel where the target is a TPU and it covers the call), ``"blockwise"`` and
``"cudnn"`` -> xla (there is no ragged cuDNN kernel).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.attention import MASK_VALUE
from models.cache import cache_layout
from models.config import MoeConfig
from models.stacking import layer_groups


@dataclasses.dataclass(frozen=True)
class RaggedLayout:
    """Static shape of one step: ``decode_rows`` rows of 1 token, then ``prefill_rows`` rows of
    ``prefill_len`` tokens; ``pages_per_row`` columns of every page table; ``block_pages`` pages per
    key block of the XLA kernel (``pages_per_row`` is a multiple of it)."""

    decode_rows: int
    prefill_rows: int
    prefill_len: int
    pages_per_row: int
    block_pages: int = 1

    @property
    def rows(self) -> int:
        return self.decode_rows + self.prefill_rows

    @property
    def tokens(self) -> int:
        return self.decode_rows + self.prefill_rows * self.prefill_len


@struct.dataclass
class PagedMeta:
    """Where a step's tokens go and what each row reads (device arrays).

    table [R, pages_per_row] int32: row r's pages in position order (unused entries 0); page [N],
    offset [N] int32: where token n's key/value is written (padding: page 0); kv_len [R] int32: one past
    the last position any query of row r attends to (a padding row: 1). layout: static."""

    table: jax.Array
    page: jax.Array
    offset: jax.Array
    kv_len: jax.Array
    layout: RaggedLayout = struct.field(pytree_node=False)

    @property
    def real(self) -> jax.Array:
        """[N] bool: the step's real tokens. Padding (of a prefill row, or a decode row with no
        request) writes to the trash page 0 and nothing reads its outputs, so the model may skip its
        work (the MoE kernels do: :class:`models.moe.MoeBlock`)."""
        return self.page > 0


@struct.dataclass
class PagedCache:
    """The page pool handed to the model (``model(tokens [1, N], positions [1, N], cache=...)``):
    ``k``, ``v`` per layer group (module docstring; ``v`` is ``()`` for a combined GQA pool) plus this
    step's :class:`PagedMeta`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    meta: PagedMeta

    @staticmethod
    def init_pool(cfg: MoeConfig, num_pages: int, page_size: int, *, bits: bool = False, dtype=None):
        """``(k, v)`` tuples of zeroed pages (:func:`pool_shapes`); ``bits``: stored as unsigned ints of
        the float's width."""
        dtype = np.dtype(cfg.dtype if dtype is None else dtype)
        if bits and jnp.issubdtype(dtype, jnp.floating):  # np.issubdtype: False for bfloat16
            dtype = np.dtype(f"uint{8 * dtype.itemsize}")
        k, v = pool_shapes(cfg)
        zeros = lambda hd: tuple(jnp.zeros((len(ids), num_pages, page_size) + hd, dtype)
                                 for _, ids in layer_groups(cfg))
        return zeros(k), (() if v is None else zeros(v))


def pool_shapes(cfg: MoeConfig) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Trailing ``(Hc, Dc)`` of the k and v pools: GQA ``((2 * Hkv, head_dim), None)`` (one combined pool,
    module docstring), MLA :func:`models.cache.cache_layout`'s two."""
    lay = cache_layout(cfg)
    if lay.k == lay.v:
        return (2 * lay.k[0], lay.k[1]), None
    return lay.k, lay.v


@struct.dataclass
class PagedLayer:
    """One layer's view inside the model: its group's whole pools ``k``, ``v`` [n, P, ps, Hc, Dc] (``v``
    None for a combined GQA pool in ``k``), its index ``layer`` in them ([] int32) and the step's meta.
    Indexable like the ``(k, v)`` tuple of a contiguous cache (``kv[0]``, ``kv[1]``).

    The layer writes into and gathers from the stacked pools at ``layer`` instead of slicing its
    ``[P, ...]`` pages out and back: that slice is a copy of the layer's whole pool (XLA does not alias
    it), three passes over the KV per layer per step whatever the tokens."""

    k: jax.Array
    v: jax.Array | None
    meta: PagedMeta
    layer: jax.Array | None = None

    def __getitem__(self, i):
        return (self.k, self.v)[i]


def _stored(x, like, dtype):
    """``x`` in the storage dtype of ``like`` (the bit patterns of ``dtype`` for an unsigned-int pool)."""
    if jnp.issubdtype(like.dtype, jnp.unsignedinteger):
        return jax.lax.bitcast_convert_type(x.astype(dtype), like.dtype)
    return x.astype(like.dtype)


def _loaded(x, dtype):
    """Pages read back as ``dtype`` (the cache's float dtype; an unsigned-int pool holds its bits)."""
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return jax.lax.bitcast_convert_type(x, dtype)
    return x.astype(dtype)


def write(pages, new, meta: PagedMeta, dtype, layer=None):
    """Write ``new`` [1, N, Hc, Dc] (this step's keys or values, cache dtype ``dtype``) into ``pages``
    [P, ps, Hc, Dc], or into layer ``layer`` of stacked pages [n, P, ps, Hc, Dc] (in place)."""
    if layer is None:
        return pages.at[meta.page, meta.offset].set(_stored(new[0], pages, dtype))
    return pages.at[layer, meta.page, meta.offset].set(_stored(new[0], pages, dtype))


def write_kv(pages, k, v, meta: PagedMeta, dtype, layer=None):
    """Write this step's keys ``k`` and values ``v`` [1, N, Hkv, D] into a combined pool ``pages`` [P,
    ps, 2 * Hkv, D] (or [n, P, ...] at ``layer``), interleaved by head (module docstring): one scatter."""
    kv = jnp.stack([k, v.astype(k.dtype)], axis=-2)  # [1, N, Hkv, 2, D]: k head h then v head h
    return write(pages, kv.reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3]), meta, dtype, layer)


def ragged_attention(q, keys, values, positions, meta: PagedMeta, *, scale: float, dtype, impl: str = "auto",
                     layer=None):
    """Attention of a step's queries over their rows' pages (the module docstring has the layout).

    q [1, N, H, Dq]; keys: a tuple of page arrays [P, ps, Hkv, d_i] whose gathers are concatenated on
    the last axis into the key (MLA's latent cache: ``(c_kv, k_rot)``), or ``(kv,)``, a combined GQA
    pool [P, ps, 2 * Hkv, D], with ``values`` None; values [P, ps, Hkv, Dv] (separate pools); positions
    [1, N]. Returns [1, N, H, Dv] in q's dtype. ``impl``: :data:`RAGGED_IMPLS` or a full-sequence
    ``MoeConfig.attention_impl`` name (module docstring). ``layer``: the pages are stacked [n, P, ps,
    ...] and this is layer ``layer`` of them (read in place by either kernel).
    """
    if _resolve(impl, q, keys, values, dtype) == "pallas":
        from models import ragged_tpu

        return ragged_tpu.ragged_paged_attention(q, keys, values, positions, meta, scale=scale, dtype=dtype,
                                                 layer=layer)
    lay = meta.layout
    q, pos = q[0], positions[0]
    d, p = lay.decode_rows, lay.prefill_rows
    outs = []
    if d:
        outs.append(_paged_rows(q[:d][:, None], keys, values, pos[:d][:, None], meta.table[:d], meta.kv_len[:d],
                                block_pages=lay.block_pages, scale=scale, dtype=dtype, layer=layer)[:, 0])
    if p:
        t = lay.prefill_len
        qp = q[d:].reshape(p, t, *q.shape[1:])
        out = _paged_rows(qp, keys, values, pos[d:].reshape(p, t), meta.table[d:], meta.kv_len[d:],
                          block_pages=lay.block_pages, scale=scale, dtype=dtype, layer=layer)
        outs.append(out.reshape(p * t, *out.shape[2:]))
    return jnp.concatenate(outs, axis=0)[None] if len(outs) > 1 else outs[0][None]


RAGGED_IMPLS = ("auto", "xla", "pallas")
_FROM_FULL_SEQUENCE = {"splash": "auto", "blockwise": "xla", "cudnn": "xla"}


def _target_platform() -> str:
    """The one "auto" rule (:func:`models.attention.target_platform`)."""
    from models.attention import target_platform

    return target_platform()


def _resolve(impl: str, q, keys, values, dtype) -> str:
    """``"pallas"`` or ``"xla"`` for this call (module docstring; pages may be stacked [n, P, ...])."""
    impl = _FROM_FULL_SEQUENCE.get(impl, impl)
    if impl not in RAGGED_IMPLS:
        raise ValueError(f"ragged_attention impl={impl!r}: expected one of {', '.join(map(repr, RAGGED_IMPLS))} "
                         f"or a full-sequence attention_impl ({', '.join(map(repr, _FROM_FULL_SEQUENCE))})")
    if impl in ("xla", "pallas"):
        return impl  # an explicit "pallas" raises in models.ragged_tpu when the kernel cannot take the call
    if _target_platform() != "tpu":
        return "xla"
    from models.attention import warn_fallback

    if jax.sharding.get_abstract_mesh().empty and jax.device_count() > 1:
        # a Mosaic kernel cannot be partitioned automatically and, without a mesh, not by us
        warn_fallback(("paged", "no mesh"), f"paged attention 'auto' runs 'xla' on this TPU: {jax.device_count()} "
                                            "devices and no mesh in context (the Pallas kernel needs one)")
        return "xla"
    from models import ragged_tpu

    why = ragged_tpu.unsupported(q, keys, values, dtype)
    if why is not None:
        warn_fallback(("paged", why), f"paged attention 'auto' runs 'xla' on this TPU: the Pallas kernel does not take "
                                      f"this call ({why})")
        return "xla"
    return "pallas"


def _heads_a_chip(pages) -> int:
    """The heads (dim -2) of ``pages`` that one chip holds: split over ``tensor`` where the mesh has it."""
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)
    return max(pages.shape[-2] // tensor, 1)


def _paged_rows(q, keys, values, q_pos, table, kv_len, *, block_pages: int, scale: float, dtype, layer=None):
    """Online-softmax attention of rows of queries over their page tables.

    q [R, T, H, Dq]; q_pos [R, T]; table [R, Pmax]; kv_len [R]. Key block i covers the row's pages
    ``[i * block_pages, (i + 1) * block_pages)``; the loop runs ``ceil(max(kv_len) / block)`` times.
    Returns [R, T, H, Dv] in q's dtype. ``layer``: the pages are stacked [n, P, ...]; read layer ``layer``.
    ``values`` None: ``keys`` is ``(kv,)``, a combined pool (keys and values gathered from it apart)."""
    r, t, h, dq = q.shape
    combined = values is None
    like = keys[0] if combined else values
    hkv, dv = like.shape[-2] // (2 if combined else 1), like.shape[-1]
    g = h // hkv
    ps = like.shape[-3]
    block = block_pages * ps
    qg = q.reshape(r, t, hkv, g, dq).astype(dtype)
    n_blocks = (jnp.max(kv_len) + block - 1) // block
    # a combined pool's keys and values, on CPU: picked inside the gather (slicing a gathered block copies
    # it); elsewhere: sliced from one gathered block (the index form re-tiles the pool on TPU every step)
    pick_in_gather = combined and _target_platform() == "cpu"
    if layer is not None and combined and _target_platform() == "tpu" and _heads_a_chip(like) < 8:
        # the layer's pages sliced out before the key-block loop: with under 8 interleaved k/v heads a chip
        # XLA lays the loop's pages out anew and copies the pool it reads after every layer's write, so the
        # copy is this layer's, not the whole stack's; with more heads (or a latent pool) the stack is read
        # in place and a slice would itself be the copy
        keys = tuple(kp[layer] for kp in keys)
        values, layer = (None if values is None else values[layer]), None

    def gather(pages, cols, half=None):  # pages [P, ps, Hkv, d] (or [n, P, ...] at layer) -> [R, block, Hkv, d]
        if half is not None:  # a combined pool viewed [.., Hkv, 2, d]: k (0) or v (1) picked in the gather
            pages = pages.reshape(*pages.shape[:-2], hkv, 2, pages.shape[-1])
            x = pages[cols, :, :, half] if layer is None else pages[layer, cols, :, :, half]
        else:
            x = pages[cols] if layer is None else pages[layer, cols]  # [R, block_pages, ps, Hkv, d]
        return _loaded(x.reshape(r, -1, *x.shape[3:]), dtype)

    def load(cols):  # cols [R, c] page ids -> keys [R, c * ps, Hkv, dq], values [R, c * ps, Hkv, dv]
        if pick_in_gather:  # two gathers that each pick their half: slicing one gathered block copies it
            return gather(keys[0], cols, 0), gather(keys[0], cols, 1)
        if combined:  # one gather, then the halves: an index inside the gather re-tiles the whole pool on TPU
            both = gather(keys[0], cols).reshape(r, -1, hkv, 2, dv)
            return both[..., 0, :], both[..., 1, :]
        k = jnp.concatenate([gather(kp, cols) for kp in keys], axis=-1) if len(keys) > 1 else gather(keys[0], cols)
        return k, gather(values, cols)

    if table.shape[1] <= block_pages:
        # every row's table fits one key block (short contexts): one gather and a plain softmax, no loop
        # and no online-softmax carry
        k, v = load(table)
        s = jnp.einsum("rtkgd,rskd->rkgts", qg, k).astype(jnp.float32) * scale
        vis = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]  # [R, T, S]
        p = jax.nn.softmax(jnp.where(vis[:, None, None], s, MASK_VALUE), axis=-1)
        out = jnp.einsum("rkgts,rskd->rkgtd", p.astype(dtype), v).astype(jnp.float32)  # [R, Hkv, G, T, Dv]
        return jnp.moveaxis(out, 3, 1).reshape(r, t, h, dv).astype(q.dtype)

    def body(i, carry):
        m, l, acc = carry
        k, v = load(jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, axis=1))
        s = jnp.einsum("rtkgd,rskd->rkgts", qg, k).astype(jnp.float32) * scale
        k_pos = i * block + jnp.arange(block)
        vis = k_pos[None, None, :] <= q_pos[:, :, None]  # [R, T, block]
        s = jnp.where(vis[:, None, None], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        corr = jnp.exp(m - m_new)
        pr = jnp.exp(s - m_new[..., None])
        l = l * corr + pr.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("rkgts,rskd->rkgtd", pr.astype(dtype), v).astype(jnp.float32)
        return m_new, l, acc

    init = (jnp.full((r, hkv, g, t), MASK_VALUE, jnp.float32), jnp.zeros((r, hkv, g, t), jnp.float32),
            jnp.zeros((r, hkv, g, t, dv), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [R, Hkv, G, T, Dv]
    return jnp.moveaxis(out, 3, 1).reshape(r, t, h, dv).astype(q.dtype)


def pages_reference(q, keys, values, positions, meta: PagedMeta, *, scale: float, dtype=jnp.float32):
    """Dense numpy reference of :func:`ragged_attention` (tests): gathers every row's whole page table.
    Pages unstacked ([P, ...]); ``values`` None for a combined pool, as there."""
    q, pos = np.asarray(q[0], np.float64), np.asarray(positions[0])
    lay = meta.layout
    if values is None:
        both = np.asarray(_loaded(keys[0], dtype).astype(jnp.float32), np.float64)
        both = both.reshape(*both.shape[:2], both.shape[2] // 2, 2, both.shape[3])
        keys, values = (both[..., 0, :],), both[..., 1, :]
    keys = [np.asarray(_loaded(k, dtype).astype(jnp.float32), np.float64) for k in keys]
    values = np.asarray(_loaded(values, dtype).astype(jnp.float32), np.float64)
    table, out = np.asarray(meta.table), np.zeros(q.shape[:2] + (values.shape[-1],))
    row_of = [r for r in range(lay.decode_rows)] + [lay.decode_rows + r for r in range(lay.prefill_rows)
                                                   for _ in range(lay.prefill_len)]
    h, hkv = q.shape[1], values.shape[2]
    for n, r in enumerate(row_of):
        k = np.concatenate([kp[table[r]].reshape(-1, hkv, kp.shape[-1]) for kp in keys], -1)
        v = values[table[r]].reshape(-1, hkv, values.shape[-1])
        seen = np.arange(k.shape[0]) <= pos[n]
        for head in range(h):
            kh = head // (h // hkv)
            s = (k[seen, kh] @ q[n, head]) * scale
            w = np.exp(s - s.max())
            out[n, head] = (w / w.sum()) @ v[seen, kh]
    return out[None]
