"""Functional KV cache: a pytree passed into the model and returned updated (never mutated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.config import MoeConfig


@struct.dataclass
class KVCache:
    """Per-layer keys and values. ``k[i]``, ``v[i]``: [B, S, Hkv, Dh]; slot j holds absolute position j.

    A query at position p attends to slots <= p, so a slot past a row's length may hold stale data
    until it is overwritten: right padding and reuse need no extra bookkeeping.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, cfg: MoeConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = cfg.dtype if dtype is None else dtype
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        return cls(k=zeros(), v=zeros())

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]
