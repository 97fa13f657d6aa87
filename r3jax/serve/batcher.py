"""Dynamic batching: concurrent requests are gathered (bounded wait) into engine batches that run
on one worker thread, off the event loop.

The event loop only queues requests and awaits futures. A single engine thread runs
``engine.generate(batch)`` and anything else that touches the engine (``set_weights``), in order, so
a weight update lands between two batches: a batch in progress finishes on the weights it started
with. Two apps sharing one engine (tests; an auth and a no-auth front end) are serialised by the
engine's own lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, Callable


class ShuttingDown(RuntimeError):
    """The server is stopping and did not start this request; safe to retry elsewhere (503)."""


class Overloaded(ShuttingDown):
    """More than ``max_queue`` requests are waiting; safe to retry later or elsewhere (503)."""


class Batcher:
    """``await batcher.submit(request) -> GenerateOutput``; requests arriving within ``max_wait_s``
    of each other (or while the engine is busy) share one ``engine.generate`` call of at most
    ``max_batch_size`` requests.

    A ``ValueError`` from the engine for a batch is retried request by request so that one bad
    request fails alone (it gets the ValueError; the others their outputs).
    """

    def __init__(self, engine: Any, *, max_batch_size: int, max_wait_s: float = 0.002, max_queue: int = 4096):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: expected an int >= 1")
        self.engine, self.max_batch_size, self.max_wait_s = engine, max_batch_size, max_wait_s
        self.max_queue = max_queue
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r3jax-engine")
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self._closing = False
        self.stats = {"requests": 0, "batches": 0, "batched_requests": 0, "max_batch": 0,
                      "engine_seconds": 0.0, "in_flight": 0}

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker on the running event loop."""
        self._queue = asyncio.Queue()
        self._closing = False
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="r3jax-batcher")

    async def stop(self) -> None:
        """Refuse new work, fail requests not yet started (:class:`ShuttingDown`), let the running
        batch finish, release the engine thread."""
        self._closing = True
        if self._queue is not None:
            while not self._queue.empty():
                _, fut = self._queue.get_nowait()
                if not fut.done():
                    fut.set_exception(ShuttingDown("server shutting down; request not started"))
        if self._worker is not None:
            self._queue.put_nowait(None)  # wakes the worker; it exits after its current batch
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        self._executor.shutdown(wait=True)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def queued(self) -> int:
        return 0 if self._queue is None else self._queue.qsize()

    # ---- work ------------------------------------------------------------------------------
    async def submit(self, request: Any) -> Any:
        """Queue one ``GenerateRequest``; await its ``GenerateOutput`` (or the engine's ValueError)."""
        if self._closing or self._queue is None:
            raise ShuttingDown("server shutting down; request not started")
        if self._queue.qsize() >= self.max_queue:
            raise Overloaded(f"{self._queue.qsize()} requests queued (max_queue={self.max_queue}); retry later")
        fut = asyncio.get_running_loop().create_future()
        self.stats["requests"] += 1
        self._queue.put_nowait((request, fut))
        return await fut

    async def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between batches (e.g. ``engine.set_weights``)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _gather(self, first) -> list:
        batch, loop = [first], asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), left)
                except TimeoutError:
                    break
            if item is None:  # stop() sentinel: put it back for the outer loop
                self._queue.put_nowait(None)
                break
            batch.append(item)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            if first is None:
                return
            batch = [(r, f) for r, f in await self._gather(first) if not f.done()]  # drop cancelled
            if not batch:
                continue
            self.stats["in_flight"] = len(batch)
            try:
                results = await loop.run_in_executor(self._executor, self._generate, [r for r, _ in batch])
            except asyncio.CancelledError:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(ShuttingDown("server shutting down; request abandoned"))
                raise
            except Exception as e:  # the engine failed (not an input error): fail this batch only
                results = [e] * len(batch)
            finally:
                self.stats["in_flight"] = 0
            for (_, fut), res in zip(batch, results):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)

    def _generate(self, requests: list) -> list:
        """Engine thread: one ``generate`` call; on ValueError, isolate the bad request(s)."""
        t0 = time.perf_counter()
        try:
            outs = list(self.engine.generate(requests))
        except ValueError as e:
            if len(requests) == 1:
                outs = [e]
            else:
                outs = []
                for r in requests:
                    try:
                        outs.append(self.engine.generate([r])[0])
                    except ValueError as err:
                        outs.append(err)
        st = self.stats
        st["batches"] += 1
        st["batched_requests"] += len(requests)
        st["max_batch"] = max(st["max_batch"], len(requests))
        st["engine_seconds"] += time.perf_counter() - t0
        return outs
