"""HTTP connections of the client: one :class:`Pool` per event loop, and a private loop thread
(:class:`Runner`) behind the synchronous API."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx

try:
    import sniffio  # noqa: F401
except ImportError:
    # httpcore imports sniffio on every async request; when it is absent each failing import walks
    # sys.path (~0.4 ms). Caching the miss keeps the same outcome (asyncio) at no cost.
    import sys

    sys.modules.setdefault("sniffio", None)


class Pool:
    """Connections of one event loop: ``ceil(max_concurrency / SHARD)`` ``httpx.AsyncClient``s of at
    most SHARD connections each, and a semaphore of ``max_concurrency``. (httpcore's pool does work
    proportional to its size for every request; small shards keep that cost flat.)"""

    SHARD = 8

    def __init__(self, max_concurrency: int, **kw):
        n = -(-max_concurrency // self.SHARD)
        size = -(-max_concurrency // n)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self.clients = [httpx.AsyncClient(limits=limits, **kw) for _ in range(n)]
        self.active = [0] * n
        self.sem = asyncio.Semaphore(max_concurrency)

    @contextlib.asynccontextmanager
    async def client(self):
        i = min(range(len(self.clients)), key=self.active.__getitem__)  # least busy shard
        self.active[i] += 1
        try:
            yield self.clients[i]
        finally:
            self.active[i] -= 1

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


class Pools:
    """A :class:`Pool` per running event loop (an httpx client is bound to the loop that opened it)."""

    def __init__(self, max_concurrency: int, **kw):
        self.max_concurrency, self.kw = max_concurrency, kw
        self._by_loop: dict[asyncio.AbstractEventLoop, Pool] = {}

    def current(self) -> Pool:
        loop = asyncio.get_running_loop()
        if loop not in self._by_loop:
            for stale in [lp for lp in self._by_loop if lp.is_closed()]:  # e.g. an earlier asyncio.run
                del self._by_loop[stale]
            self._by_loop[loop] = Pool(self.max_concurrency, **self.kw)
        return self._by_loop[loop]

    async def aclose_current(self) -> None:
        """Close the running loop's connections (if it opened any)."""
        pool = self._by_loop.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.aclose()


class Runner:
    """A private event loop in a daemon thread, started on first use: the sync API runs its
    coroutines there, so it works from any thread (including one with its own running loop)."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def run(self, coro):
        """Run ``coro`` on the runner's loop and wait for its result."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="r3jax-client", daemon=True)
                self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def arun(self, coro):
        """Await ``coro`` on the runner's loop from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._loop = self._thread = None
