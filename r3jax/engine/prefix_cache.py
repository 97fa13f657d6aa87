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


@struct.dataclass
class BlockPool:
    """k[i], v[i]: [C, bs, Hkv, Dh] per layer; routes: [C, bs, L, K] compact dtype."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    routes: jax.Array


def init_pool(cfg: MoeConfig, route_dtype, *, capacity: int, block_size: int) -> BlockPool:
    kv = (capacity, block_size, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(kv, cfg.dtype) for _ in range(cfg.num_layers))
    routes = jnp.zeros((capacity, block_size, cfg.num_moe_layers, cfg.top_k), route_dtype)
    return BlockPool(k=zeros(), v=zeros(), routes=routes)


def _blocked(x, block_size):
    """[B, S, ...] -> [B, S / bs, bs, ...]."""
    return x.reshape(x.shape[0], x.shape[1] // block_size, block_size, *x.shape[2:])


def load_blocks(pool: BlockPool, cache: KVCache, routes, row, blk, slot):
    """Copy pool blocks into batch rows: block ``blk[n]`` of row ``row[n]`` <- ``pool[slot[n]]``.

    row, blk, slot [N] int32; entries with ``row == B`` are padding and dropped. Returns (cache, routes).
    """
    bs = pool.routes.shape[1]

    def put(dst, src):
        shape = dst.shape
        return _blocked(dst, bs).at[row, blk].set(src[slot], mode="drop").reshape(shape)

    cache = KVCache(k=tuple(map(put, cache.k, pool.k)), v=tuple(map(put, cache.v, pool.v)))
    return cache, put(routes, pool.routes)


def store_blocks(pool: BlockPool, cache: KVCache, routes, row, blk, slot) -> BlockPool:
    """Copy batch blocks into the pool: ``pool[slot[n]]`` <- block ``blk[n]`` of row ``row[n]``.

    row, blk, slot [N] int32; entries with ``slot == C`` are padding and dropped. Returns the pool.
    """
    bs = pool.routes.shape[1]
    take = lambda dst, src: dst.at[slot].set(_blocked(src, bs)[row, blk], mode="drop")
    return BlockPool(k=tuple(map(take, pool.k, cache.k)), v=tuple(map(take, pool.v, cache.v)),
                     routes=take(pool.routes, routes))


_POOL_STATICS = ("cfg", "route_dtype", "capacity", "block_size")
# shared by every engine: programs depend on shapes only
_init_pool = jax.jit(init_pool, static_argnames=_POOL_STATICS)
_load_blocks = jax.jit(load_blocks, donate_argnames=("cache", "routes"))
_store_blocks = jax.jit(store_blocks, donate_argnames=("pool",))


class PrefixCache:
    """Host index + device pool. ``jit(jitted, name, **kw)`` wraps the device programs to count them."""

    def __init__(self, cfg: MoeConfig, route_dtype, *, block_size: int, budget_bytes: int, jit):
        self.cfg, self.route_dtype, self.block_size = cfg, np.dtype(route_dtype), block_size
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
        self.block_bytes = block_size * (kv_bytes + cfg.num_moe_layers * cfg.top_k * self.route_dtype.itemsize)
        self.capacity = int(budget_bytes) // self.block_bytes
        self._init = jit(_init_pool, "prefix_pool_init", static_argnames=_POOL_STATICS)
        self._load = jit(_load_blocks, "prefix_load")
        self._store = jit(_store_blocks, "prefix_store")
        self._pool: BlockPool | None = None
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

    def load(self, cache: KVCache, routes, slots_per_row: list[list[int]]):
        """Write each row's matched blocks (slots from :meth:`match`) into blocks 0.. of that row."""
        b, s = routes.shape[:2]
        n = b * (s // self.block_size)
        row, blk, slot = np.full(n, b, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        i = 0
        for r, slots in enumerate(slots_per_row):
            for j, sl in enumerate(slots):
                row[i], blk[i], slot[i] = r, j, sl
                i += 1
        if i == 0:
            return cache, routes
        return self._load(self._pool, cache, routes, row, blk, slot)

    def store(self, cache: KVCache, routes, fed_per_row: list[np.ndarray | None]) -> int:
        """Add the whole blocks of each row's fed tokens (``prompt + output[:-1]``, whose KV and route
        rows are in the batch buffers) that are not cached yet. Returns the number of blocks added."""
        if not self.enabled:
            return 0
        b, s = routes.shape[:2]
        n = b * (s // self.block_size)
        row, blk, slot = np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, self.capacity, np.int32)
        added: set[bytes] = set()
        protected: set[bytes] = set()  # blocks of this call's chains: evicting one would orphan the rest
        for r, fed in enumerate(fed_per_row):
            if fed is None:
                continue
            keys = self.block_keys(fed, len(fed) // self.block_size)
            protected.update(keys)
            for j, key in enumerate(keys):
                if key in self._index:
                    continue
                free = self._allocate(protected)
                if free is None:
                    keys = keys[:j]  # a block past a missing one could never be matched
                    break
                self._index[key] = free
                row[len(added)], blk[len(added)], slot[len(added)] = r, j, free
                added.add(key)
            self._touch(keys)
        if added:
            if self._pool is None:
                self._pool = self._init(cfg=self.cfg, route_dtype=self.route_dtype, capacity=self.capacity,
                                        block_size=self.block_size)
            self._pool = self._store(self._pool, cache, routes, row, blk, slot)
        return len(added)

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
