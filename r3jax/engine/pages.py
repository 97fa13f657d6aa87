"""Host-side bookkeeping of the page pool: free pages, reservations, reference counts, and the prefix
index over whole pages (their KV on device, their route rows here).

- Page 0 is the trash page (padding writes there), never handed out.
- Admission reserves a request's prompt pages (less its prefix hit); the scheduler reserves decode
  pages a device call at a time, and pages are taken from the reservation as positions are reached.
  A request that finishes gives the rest back. When a reservation does not fit, admission waits and a
  running request is preempted (:mod:`r3jax.engine.loop`).
- A prompt's whole pages enter the prefix index as soon as the step that writes them is dispatched
  (the device runs steps in order, so any later step reads their KV), their route rows once that
  step's outputs reach the host; a finished request's whole pages (output included) enter it then.
  Keys are a hash chain over the tokens of
  every page up to and including it, rooted at the weight version (:meth:`PagePool.clear` re-roots
  it), so a key names the exact prefix it was computed from. A later prompt starting with those tokens
  references the pages (reference counted) instead of recomputing them, and its route rows for those
  positions come from :attr:`PagePool.routes`, the host copy of every indexed page's route rows (every
  route row reaches the host with its step's outputs anyway). Only whole pages are indexed, and a hit
  always leaves the last prompt token to be computed, so a shared page is never written again: no copy
  on write is ever needed.
- Indexed pages no request references are kept in LRU order and evicted (oldest first) when free pages
  run out. A request releases its pages leaf first, so the leaves of a chain go before its root.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens. routes: ``[num_pages, page_size, *route_shape]``
    host copies of indexed pages' route rows. ``prefix=False`` turns the prefix index off."""

    def __init__(self, num_pages: int, page_size: int, *, route_shape: tuple[int, ...], route_dtype,
                 prefix: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: expected >= 2 (page 0 is the trash page)")
        self.num_pages, self.page_size, self.prefix = num_pages, page_size, bool(prefix)
        self.routes = np.zeros((num_pages, page_size) + tuple(route_shape), route_dtype)
        self.ref = np.zeros((num_pages,), np.int32)
        self.evictions = 0
        self.clear(weight_version=0)

    # ---- capacity ----------------------------------------------------------------------------------
    @property
    def cached(self) -> int:
        """Pages in the prefix index."""
        return len(self._key_of)

    @property
    def in_use(self) -> int:
        """Pages some request references."""
        return int(np.count_nonzero(self.ref))

    @property
    def available(self) -> int:
        """Pages a new reservation may claim: free ones plus evictable ones, less outstanding reservations."""
        return len(self._free) + len(self._lru) - self.reserved

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, n: int) -> bool:
        if n > self.available:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        if n > self.reserved:
            raise RuntimeError(f"unreserve({n}): only {self.reserved} pages are reserved")
        self.reserved -= n

    def take(self) -> int:
        """One page out of a reservation (a free one, else the least recently used indexed one)."""
        if self.reserved <= 0:
            raise RuntimeError("take() without a reservation")
        self.reserved -= 1
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.evictions += 1
        self.ref[page] = 1
        return page

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page (leaf first); an unreferenced page is evictable if indexed, else free."""
        for page in reversed(pages):
            if self.ref[page] <= 0:
                raise RuntimeError(f"release(): page {page} is not referenced")
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if page in self._key_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def reset(self, weight_version: int) -> None:
        """Every page free, nothing reserved or indexed (after the device pool was rebuilt)."""
        self.ref[:] = 0
        self.reserved = 0
        del self._free
        self.clear(weight_version)

    # ---- prefix index --------------------------------------------------------------------------------
    def clear(self, weight_version: int) -> None:
        """Forget every indexed page (unreferenced ones become free); new keys are rooted at weight_version."""
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        if not hasattr(self, "_free"):
            self._free = list(range(self.num_pages - 1, 0, -1))
            self.reserved = 0
        else:
            self._free = [p for p in range(self.num_pages - 1, 0, -1) if self.ref[p] == 0]
        self._root = hashlib.blake2b(f"r3jax-pages/{weight_version}/{self.page_size}".encode(), digest_size=16).digest()

    def keys(self, tokens: np.ndarray, n_pages: int) -> list[bytes]:
        """Hash-chain keys of the first ``n_pages`` whole pages of ``tokens``."""
        out, parent, ps = [], self._root, self.page_size
        for j in range(n_pages):
            block = np.ascontiguousarray(tokens[j * ps:(j + 1) * ps], dtype=np.int32)
            parent = hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()
            out.append(parent)
        return out

    def match(self, prompt: np.ndarray) -> list[int]:
        """Pages of the longest indexed chain of whole pages of ``prompt``, leaving at least its last token
        to compute; each gets a reference (the caller releases them with the rest of its pages)."""
        if not self.prefix:
            return []
        hit = []
        for key in self.keys(prompt, (len(prompt) - 1) // self.page_size):
            page = self._page_of.get(key)
            if page is None:
                break
            hit.append(page)
        for page in hit:
            if self.ref[page] == 0:
                del self._lru[page]
            self.ref[page] += 1
        return hit

    def register(self, pages: list[int], fed: np.ndarray, routes: np.ndarray | None) -> list[tuple[int, int, bytes]]:
        """Index the whole pages of ``fed``: ``pages`` hold positions ``[0, len(fed))`` of the tokens ``fed``
        (a finished request's prompt + output[:-1], or a prompt's positions up to its last dispatched
        chunk: their KV is on device, or will be before any later step reads it) and ``routes
        [len(fed), ...]`` their route rows, or None when they are not on the host yet (:meth:`set_routes`
        then fills them). Returns ``(j, page, key)`` of each page newly indexed (a page whose prefix is
        indexed already stays unindexed)."""
        if not self.prefix:
            return []
        ps, added = self.page_size, []
        n = len(fed) // ps
        for j, key in enumerate(self.keys(fed, n)):
            page = pages[j]
            if key in self._page_of or page in self._key_of:
                continue
            self._page_of[key], self._key_of[page] = page, key
            if routes is not None:
                self.routes[page] = routes[j * ps:(j + 1) * ps]
            added.append((j, page, key))
        return added

    def set_routes(self, page: int, key: bytes, rows: np.ndarray) -> bool:
        """The route rows of a page indexed before they reached the host; a no-op (False) if the page no
        longer holds that prefix (evicted and taken again, or the index was cleared meanwhile)."""
        if self._key_of.get(page) != key:
            return False
        self.routes[page] = rows
        return True
