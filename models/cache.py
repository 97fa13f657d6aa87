"""Functional KV cache: a pytree passed into the model and returned updated (never mutated).

What a layer caches per token comes from one place, :func:`cache_layout`: the engine allocates slots,
scratch buffers and prefix-cache pools, sizes them in bytes and places them on a mesh from it, so a
cache form needs no engine change.

- GQA, and MLA with ``mla_cache="expanded"``: ``k``, ``v`` [.., Hkv, head_dim] (MLA: every head's full
  key and its value padded to head_dim); heads split over ``tensor`` (logical axis ``kv_heads``).
- MLA with ``mla_cache="latent"``: ``k`` = the normalised latent c_kv [.., 1, kv_lora_rank], ``v`` = the
  shared roped key k_rot [.., 1, qk_rope_head_dim]. No head axis to split, so the slots take the
  logical axis ``attn_batch``: split over every data-like serving axis (DP attention, models/axes.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import MoeConfig
from models.stacking import layer_groups


class CacheLayout(NamedTuple):
    """Per-token shapes of one layer's cache buffers and the logical axes of a stacked buffer.

    k, v: ``(Hc, Dc)`` of the ``k`` / ``v`` buffer; axes: logical axes of ``[n, B, S, Hc, Dc]``
    (models/axes.py RULES)."""

    k: tuple[int, int]
    v: tuple[int, int]
    axes: tuple

    @property
    def batch_axis(self) -> str:
        """The logical axis of the slots (B) dim."""
        return self.axes[1]


def is_latent(cfg: MoeConfig) -> bool:
    """True when the model caches MLA's latent (``attention="mla"``, ``mla_cache="latent"``)."""
    return cfg.attention == "mla" and cfg.mla_cache == "latent"


def cache_layout(cfg: MoeConfig) -> CacheLayout:
    """The cache form of ``cfg`` (see the module docstring)."""
    if is_latent(cfg):
        return CacheLayout(k=(1, cfg.kv_lora_rank), v=(1, cfg.qk_rope_head_dim),
                           axes=("layers", "attn_batch", None, None, None))
    hd = (cfg.num_kv_heads, cfg.head_dim)
    return CacheLayout(k=hd, v=hd, axes=("layers", "batch", None, "kv_heads", None))


def cache_bytes_per_token(cfg: MoeConfig, dtype=None) -> int:
    """Bytes of cache one token takes over all layers (``dtype`` default: ``cfg.dtype``)."""
    lay = cache_layout(cfg)
    item = np.dtype(cfg.dtype if dtype is None else dtype).itemsize
    return cfg.num_layers * (math.prod(lay.k) + math.prod(lay.v)) * item


@struct.dataclass
class KVCache:
    """Cache buffers stacked per run of identical layers, the groups of
    :func:`models.stacking.layer_groups` (dense-first layers, then MoE layers; an empty run is absent),
    in both layer layouts: ``k[g]``, ``v[g]``: [n_g, B, S, Hc, Dc] with ``(Hc, Dc)`` from
    :func:`cache_layout` (GQA: ``(Hkv, head_dim)``), layer j of group g at index j.
    Slot s holds absolute position s.

    A query at position p attends to slots <= p, so a slot past a row's length may hold stale data
    until it is overwritten: right padding and reuse need no extra bookkeeping.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, cfg: MoeConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = cfg.dtype if dtype is None else dtype
        lay = cache_layout(cfg)
        zeros = lambda hd: tuple(jnp.zeros((len(ids), batch, max_len) + hd, dtype) for _, ids in layer_groups(cfg))
        return cls(k=zeros(lay.k), v=zeros(lay.v))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def layer(self, cfg: MoeConfig, i: int) -> tuple[jax.Array, jax.Array]:
        """Global layer i's ``(k, v)`` [B, S, Hc, Dc]."""
        for g, (_, ids) in enumerate(layer_groups(cfg)):
            if i in ids:
                j = ids.index(i)
                return self.k[g][j], self.v[g][j]
        raise ValueError(f"layer={i}: expected a layer id in [0, num_layers={cfg.num_layers})")
