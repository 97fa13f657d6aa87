"""Prefix cache: whole token blocks' KV *and route rows*, reused by later prompts that start with them.

A block of ``block_size`` tokens is keyed by a hash chain over the tokens of every block up to and
including it, rooted at the weight version, so a key names the exact prefix it was computed from.
Blocks live on device in one preallocated pool (capacity = byte budget // bytes per block); the host
keeps the key -> pool slot index in LRU order. Evicting takes the least recently used block; a chain
is touched leaf-first, so its root stays the most recent and leaves go first. Route rows of a reused
block are the ones recorded when its tokens were first processed.
"""

from __future__ import annotations

import collections
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models import KVCache, MoeConfig
from models.cache import cache_bytes_per_token


@struct.dataclass
class BlockPool:
    """k[g], v[g]: [n_g, C, bs, Hc, Dc] per run of layers (the groups of ``KVCache``), holding the
    cache's bit patterns as unsigned ints of its width (:func:`bits_dtype`); routes: [C, bs, L, K]
    compact dtype.

    Bits rather than floats because the pool is updated in place by a scatter, and XLA:CPU runs a
    bf16 scatter in f32: it converts the whole pool there and back on every store (80 ms per store of
    a 64 MiB pool, the demo's rollout time), where a uint16 scatter touches only the stored blocks."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    routes: jax.Array


def bits_dtype(dtype) -> np.dtype:
    """The unsigned int dtype of ``dtype``'s width (what the pool stores a float cache as)."""
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def _to_bits(x):
    return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x


def init_pool(cfg: MoeConfig, route_dtype, *, capacity: int, block_size: int) -> BlockPool:
    kv = KVCache.init(cfg, capacity, block_size)  # [n_g, C, bs, Hc, Dc]
    routes = jnp.zeros((capacity, block_size, cfg.num_moe_layers, cfg.top_k), route_dtype)
    return BlockPool(k=tuple(map(_to_bits, kv.k)), v=tuple(map(_to_bits, kv.v)), routes=routes)


def _blocked(x, block_size, axis=0):
    """[..., B, S, ...] -> [..., B, S / bs, bs, ...] (B at ``axis``)."""
    lead, s = x.shape[:axis + 1], x.shape[axis + 1]
    return x.reshape(*lead, s // block_size, block_size, *x.shape[axis + 2:])


def load_blocks(pool: BlockPool, cache: KVCache, routes, row, blk, slot):
    """Copy pool blocks into batch rows: block ``blk[n]`` of row ``row[n]`` <- ``pool[slot[n]]``.

    row, blk, slot [N] int32; entries with ``row == B`` are padding and dropped. Returns (cache, routes).
    """
    bs = pool.routes.shape[1]

    def put(dst, src):
        shape = dst.shape
        return _blocked(dst, bs).at[row, blk].set(src[slot], mode="drop").reshape(shape)

    def put_kv(dst, src):  # [n, B, S, ...] <- [n, C, bs, ...]
        shape = dst.shape
        blocks = jax.lax.bitcast_convert_type(src[:, slot], dst.dtype)  # only the N loaded blocks
        return _blocked(dst, bs, 1).at[:, row, blk].set(blocks, mode="drop").reshape(shape)

    cache = KVCache(k=tuple(map(put_kv, cache.k, pool.k)), v=tuple(map(put_kv, cache.v, pool.v)))
    return cache, put(routes, pool.routes)


def store_blocks(pool: BlockPool, cache: KVCache, routes, row, blk, slot) -> BlockPool:
    """Copy batch blocks into the pool: ``pool[slot[n]]`` <- block ``blk[n]`` of row ``row[n]``.

    row, blk, slot [N] int32; entries with ``slot == C`` are padding and dropped. Returns the pool.
    """
    bs = pool.routes.shape[1]
    take = lambda dst, src: dst.at[slot].set(_blocked(src, bs)[row, blk], mode="drop")
    take_kv = lambda dst, src: dst.at[:, slot].set(_to_bits(_blocked(src, bs, 1)[:, row, blk]), mode="drop")
    return BlockPool(k=tuple(map(take_kv, pool.k, cache.k)), v=tuple(map(take_kv, pool.v, cache.v)),
                     routes=take(pool.routes, routes))


class PrefixCache:
    """Host index over a device pool of ``capacity`` blocks. The engine runs the device programs
    (:func:`load_blocks` / :func:`store_blocks`) with the index arrays planned here."""

    def __init__(self, cfg: MoeConfig, route_dtype, *, block_size: int, budget_bytes: int):
        self.cfg, self.route_dtype, self.block_size = cfg, np.dtype(route_dtype), block_size
        kv_bytes = cache_bytes_per_token(cfg)
        self.block_bytes = block_size * (kv_bytes + cfg.num_moe_layers * cfg.top_k * self.route_dtype.itemsize)
        self.capacity = int(budget_bytes) // self.block_bytes
        self.pool: BlockPool | None = None  # set by the engine (preallocated when enabled)
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free: list[int] = []
        self._root = b""
        self.evictions = 0
        self.clear(weight_version=0)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def clear(self, weight_version: int) -> None:
        """Forget every block (the pool memory is kept and reused); new keys are rooted at weight_version."""
        self._index.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._root = hashlib.blake2b(f"r3jax-prefix/{weight_version}/{self.block_size}".encode(),
                                     digest_size=16).digest()

    def block_keys(self, tokens: np.ndarray, n_blocks: int) -> list[bytes]:
        """Hash-chain keys of the first n_blocks whole blocks of ``tokens [N] int32``."""
        keys, parent, bs = [], self._root, self.block_size
        for j in range(n_blocks):
            block = np.ascontiguousarray(tokens[j * bs:(j + 1) * bs], dtype=np.int32)
            parent = hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()
            keys.append(parent)
        return keys

    def match(self, prompt: np.ndarray) -> list[int]:
        """Pool slots of the longest cached chain of whole blocks of ``prompt [P]``, leaving at least
        the last prompt token to be prefilled (its logits start decoding). Touches the chain."""
        if not self.enabled:
            return []
        keys = self.block_keys(prompt, (len(prompt) - 1) // self.block_size)
        hit = []
        for key in keys:
            if key not in self._index:
                break
            hit.append(key)
        self._touch(hit)
        return [self._index[k] for k in hit]

    def load_plan(self, slots_per_row: list[list[int]], rows: int, seq_len: int):
        """Index arrays ``(row, blk, slot) [rows * seq_len / bs] int32`` for :func:`load_blocks`:
        each row's matched blocks into blocks 0.. of that row (row == rows: padding)."""
        n = rows * (seq_len // self.block_size)
        row, blk, slot = np.full(n, rows, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        i = 0
        for r, slots in enumerate(slots_per_row):
            for j, sl in enumerate(slots):
                row[i], blk[i], slot[i] = r, j, sl
                i += 1
        return row, blk, slot

    def store_plan(self, fed: np.ndarray, row_index: int, seq_len: int):
        """Index arrays ``(row, blk, slot) [seq_len / bs] int32`` for :func:`store_blocks` adding the
        whole blocks of ``fed [N]`` (``prompt + output[:-1]``, in buffer row ``row_index``) not cached
        yet (slot == capacity: padding), or None when nothing is added."""
        if not self.enabled:
            return None
        n = seq_len // self.block_size
        row, blk, slot = np.full(n, row_index, np.int32), np.zeros(n, np.int32), np.full(n, self.capacity, np.int32)
        keys = self.block_keys(fed, len(fed) // self.block_size)
        protected = set(keys)  # blocks of this chain: evicting one would orphan the rest
        added = 0
        for j, key in enumerate(keys):
            if key in self._index:
                continue
            free = self._allocate(protected)
            if free is None:
                keys = keys[:j]  # a block past a missing one could never be matched
                break
            self._index[key] = free
            blk[added], slot[added] = j, free
            added += 1
        self._touch(keys)
        return (row, blk, slot) if added else None

    def _allocate(self, protected: set[bytes]) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((k for k in self._index if k not in protected), None)
        if victim is None:
            return None
        self.evictions += 1
        return self._index.pop(victim)

    def _touch(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # root last = most recent, so leaves are evicted first
            self._index.move_to_end(key)
