"""The retry budget: a time, not a count.

Generation has no server-side effects, so a request is always retried whole: an attempt that failed
in a retryable way (connection refused or reset, a timeout, 408/429/502/503/504, no live replica) is
sent again after a wait, as long as the next attempt can *start* within ``timeout_s`` of the first.
An attempt already running is not cut short (the HTTP ``timeout`` bounds it).

A replica that says it is warming up (``GET /health``: 503 ``{"status": "warming_up"}``: compiling
its programs after a start, 150 s or more without a compilation cache) will serve soon, where a
dead one may never: while one is warming up (out of rotation until it answers 200), the budget is
``warmup_timeout_s`` instead (the larger of the two). A replica that says its engine failed is out
of rotation too; the request goes to the others, or waits out ``timeout_s`` for one to come back.

Waits: capped exponential backoff with full jitter, ``uniform(0, min(max_backoff_s, backoff_s *
2**(n-1)))`` before retry n (spreads many clients that lost the same server), or the server's
``Retry-After`` when it asks for longer. A Retry-After that reaches past the budget ends the request
at once rather than sleeping into a certain failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from typing import Awaitable, Callable, TypeVar

from r3jax.serve.client.errors import RemoteError, Retryable

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """``timeout_s``: seconds from the first attempt within which a retry may start (a restart that
    finds its compilation cache). ``warmup_timeout_s``: the same while a replica reports it is
    warming up (default: a cold start without the cache, ~150 s measured, twice over).
    ``backoff_s`` / ``max_backoff_s``: first and largest backoff cap. ``max_retries``: an optional
    count limit on top of the time (None: time only)."""

    timeout_s: float = 120.0
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    max_retries: int | None = None
    warmup_timeout_s: float = 300.0

    def __post_init__(self):
        for name in ("timeout_s", "backoff_s", "max_backoff_s", "warmup_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r}: expected a finite number >= 0")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s!r}: expected >= backoff_s={self.backoff_s!r}")
        m = self.max_retries
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"max_retries={m!r}: expected None or an int >= 0")

    def budget_s(self, warming: bool) -> float:
        """Seconds from the first attempt within which a retry may start: ``timeout_s``, or at least
        ``warmup_timeout_s`` while a replica is warming up."""
        return max(self.timeout_s, self.warmup_timeout_s) if warming else self.timeout_s

    def cap(self, retry: int) -> float:
        """The backoff cap before retry number ``retry`` (1, 2, ...): doubles, then stays at max_backoff_s."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(retry - 1, 64))

    def delay(self, retry: int, remaining_s: float, retry_after: float | None = None,
              rng: random.Random | None = None) -> float | None:
        """Seconds to wait before retry ``retry`` with ``remaining_s`` of the budget left, or None
        when the budget (time or count) does not allow another attempt."""
        if self.max_retries is not None and retry > self.max_retries:
            return None
        wait = (rng or random).uniform(0.0, self.cap(retry))  # full jitter
        if retry_after is not None:
            wait = max(wait, retry_after)
        return wait if wait < remaining_s else None


async def call_with_retries(attempt: Callable[[], Awaitable[T]], policy: RetryPolicy, *,
                            clock: Callable[[], float] = time.monotonic,
                            sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                            rng: random.Random | None = None,
                            on_retry: Callable[[Retryable, float], None] | None = None,
                            warming: Callable[[], bool] = lambda: False,
                            what: str = "request") -> T:
    """``await attempt()`` until it returns, raises something other than :class:`Retryable`, or
    the policy allows no further attempt (then :class:`RemoteError` naming the attempts, the time
    and the last failure). ``warming()``: whether a replica is warming up now (the budget is then
    ``warmup_timeout_s``). ``clock``/``sleep``/``rng`` are injectable for tests."""
    start, retry = clock(), 0
    while True:
        try:
            return await attempt()
        except Retryable as e:
            retry += 1
            elapsed = clock() - start
            warm = warming()
            wait = policy.delay(retry, policy.budget_s(warm) - elapsed, e.retry_after, rng)
            if wait is None:
                limit = f"retry_timeout_s={policy.timeout_s:g}" + (
                    f", warmup_timeout_s={policy.warmup_timeout_s:g} while a replica warms up" if warm else "") + (
                    f", max_retries={policy.max_retries}" if policy.max_retries is not None else "")
                hint = "" if e.retry_after is None else f" (server asked to retry after {e.retry_after:g} s)"
                raise RemoteError(f"{what} failed after {retry} attempts in {elapsed:.1f} s ({limit}): "
                                  f"{e}{hint}") from e
            if on_retry is not None:
                on_retry(e, wait)
            await sleep(wait)
