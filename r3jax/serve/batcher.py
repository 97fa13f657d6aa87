"""The async bridge between the HTTP handlers and the engine's own scheduler.

There is no batching here any more: ``Engine.submit`` queues a request straight into the engine's
continuous-batching scheduler, which admits it into a free decode slot within one decode call. The
bridge only adds what a server needs around it: refusing new work while shutting down or when too
many requests are waiting (503, retry elsewhere or later), awaiting the engine's future on the event
loop, cancelling the request when its caller goes away, and counting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable


class ShuttingDown(RuntimeError):
    """The server is stopping and did not start this request; safe to retry elsewhere (503)."""


class Overloaded(ShuttingDown):
    """More than ``max_queue`` requests are waiting for a slot; safe to retry later or elsewhere (503)."""


class EngineBridge:
    """``await bridge.submit(request) -> GenerateOutput`` over ``engine.submit``.

    Cancelling the awaiting task (client gone) cancels the engine request, which frees its slot.
    """

    def __init__(self, engine: Any, *, max_queue: int = 4096):
        self.engine, self.max_queue = engine, max_queue
        # an engine-like object with only ``generate(list)`` (a test double, an older generator) runs
        # one request per call on ``max_batch_size`` worker threads
        self._submit = getattr(engine, "submit", None) or self._generate_one
        self._workers: concurrent.futures.ThreadPoolExecutor | None = None
        self._closing = False
        self._in_flight = 0
        self.stats = {"requests": 0, "cancelled": 0}

    def start(self) -> None:
        self._closing = False

    async def stop(self) -> None:
        """Refuse new work (requests in flight finish: uvicorn waits for them)."""
        self._closing = True

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests submitted and not yet in a decode slot."""
        return max(0, self._in_flight - int(getattr(self.engine, "max_batch_size", 0)))

    async def submit(self, request: Any, on_token: Callable | None = None) -> Any:
        """The engine's output for ``request``. Raises ShuttingDown / Overloaded (not started), the
        engine's FieldError (bad input) or EngineAborted (weights changed mid-request: retry).
        ``on_token(token, logprob)``: the engine's per-token callback (an engine without one delivers
        no tokens before the output)."""
        if self._closing:
            raise ShuttingDown("server shutting down; request not started")
        if self.queued >= self.max_queue:
            raise Overloaded(f"{self.queued} requests queued (max_queue={self.max_queue}); retry later")
        # validation errors raise here, before anything is queued
        future = self._submit(request) if on_token is None or self._submit == self._generate_one \
            else self._submit(request, on_token=on_token)
        self.stats["requests"] += 1
        self._in_flight += 1
        try:
            return await asyncio.wrap_future(future)  # cancelling this await cancels the engine request
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            future.cancel()
            raise
        finally:
            self._in_flight -= 1

    async def submit_many(self, requests: list, on_tokens: list | None = None) -> list:
        """The engine's outputs for ``requests``, in order, queued together (``engine.submit_many``
        where the engine has it: the scheduler admits them in one step, so samples of one prompt
        prefill it once). The first error raises and cancels the others; so does cancelling this
        await. Refusals as :meth:`submit`."""
        many = getattr(self.engine, "submit_many", None)
        if many is None or self._submit == self._generate_one:
            tasks = [asyncio.ensure_future(self.submit(r, f))
                     for r, f in zip(requests, on_tokens or [None] * len(requests))]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()  # a no-op on those done; gather alone leaves the others running on an error
        if self._closing:
            raise ShuttingDown("server shutting down; request not started")
        if self.queued >= self.max_queue:
            raise Overloaded(f"{self.queued} requests queued (max_queue={self.max_queue}); retry later")
        futures = many(requests, on_tokens if on_tokens and any(f is not None for f in on_tokens) else None)
        self.stats["requests"] += len(futures)
        self._in_flight += len(futures)
        try:
            return list(await asyncio.gather(*map(asyncio.wrap_future, futures)))
        except asyncio.CancelledError:
            self.stats["cancelled"] += sum(not f.done() for f in futures)
            raise
        finally:
            for f in futures:
                f.cancel()  # a no-op on those done; frees the pages of the others
            self._in_flight -= len(futures)

    def _generate_one(self, request: Any) -> concurrent.futures.Future:
        """``engine.generate([request])`` on a worker thread, as a future that stays cancellable until done."""
        if self._workers is None:
            n = max(1, int(getattr(self.engine, "max_batch_size", 1)))
            self._workers = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="r3jax-generate")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if future.cancelled():
                return
            try:
                result = self.engine.generate([request])[0]
            except Exception as e:  # delivered to the awaiting handler, which maps it to a status
                result = e
            try:
                future.set_exception(result) if isinstance(result, Exception) else future.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile: nobody to tell
                self.stats["cancelled_in_engine"] = self.stats.get("cancelled_in_engine", 0) + 1

        self._workers.submit(run)
        return future

    async def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking engine call (``set_weights``, ``warmup``) off the event loop."""
        return await asyncio.to_thread(fn)


Batcher = EngineBridge  # the old name
