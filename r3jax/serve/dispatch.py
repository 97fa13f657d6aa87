"""One path from an HTTP request to the engine and back, shared by every protocol the server speaks
(r3jax's ``/v1/generate`` and the SkyRL / vLLM / SGLang adapters in :mod:`r3jax.serve.peer_app`).

:class:`ServeContext` submits a ``GenerateRequest`` to the engine bridge, cancels it when the client
goes away, counts sessions and protocols, and runs large route encodings off the event loop. What
can go wrong is typed, so each protocol renders it in its own error shape:

- :class:`r3jax.checks.FieldError`: the engine refused the request (bad input, a 4xx);
- :class:`Unavailable`: not served for a reason a retry fixes (shutting down, too many queued, a
  weight update aborted it): 503 with ``Retry-After``;
- :class:`Disconnected`: the client left; the request was cancelled (its slot freed), answer 499.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any, Callable

from fastapi import Request

from r3jax.engine.errors import EngineAborted, EngineFailedError
from r3jax.serve.batcher import EngineBridge, ShuttingDown

MAX_SESSIONS = 1024
OFFLOAD_BYTES = 256 << 10  # responses with more route bytes are encoded in a worker thread


class Unavailable(Exception):
    """Not served; a retry (later or elsewhere) may succeed. ``kind``: ``"unavailable"``, ``"aborted"``
    or ``"engine_failed"`` (the replica's scheduler stopped; ``/health`` says why)."""

    def __init__(self, detail: str, kind: str = "unavailable"):
        super().__init__(detail)
        self.detail, self.kind = detail, kind


class Disconnected(Exception):
    """The client went away before the answer; the engine request was cancelled."""


@dataclasses.dataclass
class ServeContext:
    """What every generate endpoint shares: the engine bridge and the server's counters.

    ``route_stats``: ``encode_s, rows, bytes, responses`` of route payloads sent (all protocols);
    ``protocols``: requests answered per protocol; ``sessions``: requests of the last
    ``MAX_SESSIONS`` session ids (for load reports and stickiness tests)."""

    engine: Any
    bridge: EngineBridge
    route_stats: dict = dataclasses.field(
        default_factory=lambda: {"encode_s": 0.0, "rows": 0, "bytes": 0, "responses": 0})
    protocols: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sessions: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    def count_session(self, session_id: str | None) -> None:
        if session_id is None:
            return
        self.sessions[session_id] = self.sessions.pop(session_id, 0) + 1
        if len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    async def generate(self, request: Request, req) -> Any:
        """The engine's ``GenerateOutput`` for ``req`` (raises FieldError, Unavailable, Disconnected)."""
        return (await self.generate_all(request, [req]))[0]

    async def generate_all(self, request: Request, reqs: list, on_tokens: list | None = None) -> list:
        """Outputs of ``reqs`` (one prompt's samples), submitted together so the engine prefills the
        prompt once. All or nothing: when one fails or the client leaves, the others are cancelled,
        and samples that finished under different weights are :class:`Unavailable` (``aborted``).
        ``on_tokens``: each request's per-token callback (stop strings), or None."""
        self.count_session(reqs[0].session_id)
        every = asyncio.ensure_future(self.bridge.submit_many(reqs, on_tokens))  # one error cancels the rest
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({every, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            every.cancel()
            raise
        finally:
            gone.cancel()
        if not every.done():  # the client went away: cancel, which frees the requests' pages
            every.cancel()
            raise Disconnected()
        try:
            outs = every.result()
        except (ShuttingDown, EngineFailedError, EngineAborted) as e:
            raise unavailable(e) from None
        if len({o.weight_version for o in outs}) > 1:
            raise Unavailable("the weights changed while the samples ran; retry the request", "aborted")
        return outs

    async def render(self, protocol: str, outs: list, encode: Callable[[], tuple[Any, int]]) -> Any:
        """``encode()`` -> ``(response, route wire bytes)`` for the outputs ``outs`` (one per sample),
        timed into ``route_stats``; run in a worker thread when the routes are large (base64 + JSON
        of MBs would stall the loop)."""
        routes = [o.routed_experts for o in outs if o.routed_experts is not None]

        def timed():
            t0 = time.perf_counter()
            response, wire = encode()
            if routes:
                self.route_stats["encode_s"] += time.perf_counter() - t0
                self.route_stats["rows"] += sum(int(r.shape[0]) for r in routes)
                self.route_stats["bytes"] += int(wire)
                self.route_stats["responses"] += 1
            return response

        self.protocols[protocol] += 1
        if sum(r.nbytes for r in routes) > OFFLOAD_BYTES:
            return await asyncio.to_thread(timed)
        return timed()


def unavailable(e: BaseException) -> Unavailable:
    """The :class:`Unavailable` a retry fixes, for the bridge's and engine's refusals."""
    if isinstance(e, EngineFailedError):  # this replica cannot serve any more: retry on another
        return Unavailable(str(e), "engine_failed")
    if isinstance(e, EngineAborted):  # stopped by a weight update: nothing was returned, retry it
        return Unavailable(str(e), "aborted")
    return Unavailable(str(e))  # ShuttingDown, Overloaded: not started, so safe to retry


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
