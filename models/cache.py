"""Functional KV cache: a pytree passed into the model and returned updated (never mutated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.config import MoeConfig
from models.stacking import layer_groups


@struct.dataclass
class KVCache:
    """Keys and values stacked per run of identical layers, the groups of
    :func:`models.stacking.layer_groups` (dense-first layers, then MoE layers; an empty run is absent),
    in both layer layouts: ``k[g]``, ``v[g]``: [n_g, B, S, Hkv, Dh], layer j of group g at index j.
    Slot s holds absolute position s.

    A query at position p attends to slots <= p, so a slot past a row's length may hold stale data
    until it is overwritten: right padding and reuse need no extra bookkeeping.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, cfg: MoeConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = cfg.dtype if dtype is None else dtype
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = lambda: tuple(jnp.zeros((len(ids),) + shape, dtype) for _, ids in layer_groups(cfg))
        return cls(k=zeros(), v=zeros())

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def layer(self, cfg: MoeConfig, i: int) -> tuple[jax.Array, jax.Array]:
        """Global layer i's ``(k, v)`` [B, S, Hkv, Dh]."""
        for g, (_, ids) in enumerate(layer_groups(cfg)):
            if i in ids:
                j = ids.index(i)
                return self.k[g][j], self.v[g][j]
        raise ValueError(f"layer={i}: expected a layer id in [0, num_layers={cfg.num_layers})")
