"""Which replica gets a request: rendezvous hashing for sessions, least-loaded otherwise, dead ones skipped.

- A request with a ``session_id`` goes to the live replica with the highest ``blake2b(session, url)``
  (rendezvous hashing): every turn of a conversation lands where its prefix cache is, and only the
  sessions of a replica that dies move.
- Without a session: the live replica with the fewest requests in flight (ties rotate).
- A replica that failed a connection (or answered 503) is out of rotation until ``GET /health``
  answers 200 again; such replicas are re-probed in the background every ``health_interval_s`` (not
  before their ``Retry-After``). Each keeps the last thing it said (:class:`Health`): ``"down"`` (no
  answer), ``"warming_up"`` (compiling; it will serve soon: the retry budget stretches to the
  cold-start budget while one is), ``"failed"`` (its engine cannot continue, with the server's
  reason) or another status. When none is live the pick waits for the current probes, then raises
  :class:`Retryable` naming each replica's state (the retry budget decides how long to keep trying).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from typing import Awaitable, Callable, Sequence

from r3jax.serve.client.errors import Retryable
from r3jax.serve.protocol import ServedModel


@dataclasses.dataclass(frozen=True)
class Health:
    """What a replica last said. ``status``: ``"ok"`` (``GET /health`` answered 200), ``"down"`` (no
    answer), the server's own status (``"warming_up"``, ``"failed"``, ``"shutting_down"``, ...) or
    ``"unavailable"`` (it refused a request: 503 and the like). ``reason``: the server's reason or the
    error, if any."""

    status: str
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __str__(self) -> str:
        return self.status + (f" ({self.reason})" if self.reason else "")


OK = Health("ok")


class Replica:
    """One server: its URL, liveness (and the last :class:`Health` it reported), load and (once
    fetched) what it serves."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.alive, self.in_flight, self.next_probe = True, 0, 0.0
        self.health = OK  # assumed until it says otherwise
        self.info: ServedModel | None = None
        self.probe: asyncio.Future | None = None
        self.probes = 0  # probes started; only the latest one's answer counts
        self.sent = 0  # attempts sent here, for tests and load reports


def rendezvous(session_id: str, replicas: Sequence[Replica]) -> Replica:
    """The replica a session belongs to among ``replicas`` (highest hash of session and URL)."""
    key = lambda r: hashlib.blake2b(f"{session_id}\0{r.url}".encode(), digest_size=8).digest()
    return max(replicas, key=key)


class Replicas:
    """The replica set. ``check(url) -> Health`` asks ``url``'s ``GET /health``."""

    def __init__(self, urls: Sequence[str], check: Callable[[str], Awaitable[Health]], *,
                 health_interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.all = [Replica(u) for u in urls]
        self.check, self.health_interval_s, self.clock = check, health_interval_s, clock
        self._rr = 0

    def __iter__(self):
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def mark_dead(self, replica: Replica, for_s: float | None = None, health: Health = Health("down")) -> None:
        """Out of rotation; re-probed after ``health_interval_s`` (or ``for_s``, its Retry-After, if longer)."""
        replica.alive, replica.health = False, health
        replica.next_probe = self.clock() + max(self.health_interval_s, for_s or 0.0)

    def any_alive(self) -> bool:
        return any(r.alive for r in self.all)

    def warming(self) -> bool:
        """Whether a replica out of rotation last said it is warming up (it will serve once compiled)."""
        return any(not r.alive and r.health.status == "warming_up" for r in self.all)

    def describe(self) -> str:
        return ", ".join(f"{r.url}: {'ok' if r.alive else r.health}" for r in self.all)

    async def probe(self, replica: Replica) -> bool:
        """Ask ``/health``; the answer sets liveness unless a newer probe started meanwhile (a
        probe that hung until its timeout must not undo a later one that saw the replica back)."""
        replica.probes += 1
        mine = replica.probes
        health = await self.check(replica.url)
        if mine == replica.probes:
            replica.alive, replica.health = health.ok, health
            if not health.ok:
                replica.next_probe = self.clock() + self.health_interval_s
        return health.ok

    def _start_probes(self, loop: asyncio.AbstractEventLoop) -> None:
        now = self.clock()
        for r in self.all:
            if not r.alive and r.next_probe <= now and (r.probe is None or r.probe.done()
                                                         or r.probe.get_loop() is not loop):
                r.probe = loop.create_task(self.probe(r))

    async def pick(self, session_id: str | None) -> Replica:
        loop = asyncio.get_running_loop()
        self._start_probes(loop)
        alive = [r for r in self.all if r.alive]
        if not alive:  # wait for this round of probes rather than fail at once
            probes = [r.probe for r in self.all if r.probe is not None and r.probe.get_loop() is loop]
            await asyncio.gather(*probes, return_exceptions=True)
            alive = [r for r in self.all if r.alive]
            if not alive:
                raise Retryable(f"no live replica ({self.describe()})")
        if session_id is not None:
            return rendezvous(session_id, alive)
        self._rr += 1
        n = len(self.all)
        return min(alive, key=lambda r: (r.in_flight, (self.all.index(r) - self._rr) % n))
