"""The retry budget is a time: capped exponential backoff with full jitter, Retry-After honoured
within the budget, and the total never past ``retry_timeout_s`` (fake clock and sleep: no waiting)."""

from __future__ import annotations

import asyncio
import email.utils

import pytest

from r3jax.serve.client import RemoteError, RetryPolicy
from r3jax.serve.client.errors import Retryable, parse_retry_after
from r3jax.serve.client.retry import call_with_retries


class FakeTime:
    """A clock that only moves when the code under test sleeps (or an attempt 'takes' time)."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class EdgeRng:
    """``uniform(a, b)`` at the top (or bottom) of its range: shows the cap itself."""

    def __init__(self, top: bool):
        self.top = top

    def uniform(self, a, b):
        return b if self.top else a


def run_failing(policy, t: FakeTime, *, attempt_s=0.0, retry_after=None, rng=None):
    """Attempts that always fail retryably (each taking ``attempt_s``); returns (attempts, error)."""
    calls = []

    async def attempt():
        calls.append(t.now)
        t.now += attempt_s
        raise Retryable("HTTP 503", retry_after)

    with pytest.raises(RemoteError) as err:
        asyncio.run(call_with_retries(attempt, policy, clock=t.clock, sleep=t.sleep, rng=rng))
    return calls, err.value


def test_backoff_doubles_up_to_its_cap():
    p = RetryPolicy(timeout_s=30.0, backoff_s=0.5, max_backoff_s=4.0)
    assert [p.cap(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert p.cap(10_000) == 4.0  # no overflow far out


def test_budget_is_time_not_count_and_caps_hold():
    t = FakeTime()
    p = RetryPolicy(timeout_s=30.0, backoff_s=0.5, max_backoff_s=4.0)
    calls, err = run_failing(p, t, rng=EdgeRng(top=True))  # every wait at its cap: the slowest schedule
    assert t.sleeps[:6] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert max(t.sleeps) == 4.0
    assert sum(t.sleeps) < 30.0 and all(c < 30.0 for c in calls)  # no attempt starts past the budget
    assert len(calls) == 10  # starts at 0, .5, 1.5, 3.5, then every 4 s to 27.5; 31.5 would be past 30 s
    assert "10 attempts in 27.5 s (retry_timeout_s=30)" in str(err) and "HTTP 503" in str(err)


def test_full_jitter_spreads_waits_down_to_zero():
    t = FakeTime()
    p = RetryPolicy(timeout_s=1.0, backoff_s=0.5, max_backoff_s=4.0, max_retries=3)
    calls, _ = run_failing(p, t, rng=EdgeRng(top=False))
    assert t.sleeps == [0.0, 0.0, 0.0] and len(calls) == 4  # full jitter: [0, cap], not [cap/2, cap]


def test_slow_attempts_count_against_the_budget():
    t = FakeTime()
    p = RetryPolicy(timeout_s=12.0, backoff_s=0.5, max_backoff_s=0.5)
    calls, err = run_failing(p, t, attempt_s=3.0, rng=EdgeRng(top=True))
    assert calls == [0.0, 3.5, 7.0, 10.5]  # the 4th starts at 10.5 s < 12 s; a 5th would start at 14
    assert "4 attempts in 13.5 s" in str(err)


def test_seeded_jitter_stays_within_caps_and_budget():
    import random

    t = FakeTime()
    p = RetryPolicy(timeout_s=120.0)  # the defaults: 0.05 s doubling to 2 s
    calls, _ = run_failing(p, t, rng=random.Random(0))
    assert all(0.0 <= w <= p.cap(n) for n, w in enumerate(t.sleeps, 1))
    assert calls[-1] < 120.0 and len(calls) > 60  # ~1 s a retry on average once capped: far more than 5


def test_retry_after_is_honoured_within_the_budget():
    t = FakeTime()
    p = RetryPolicy(timeout_s=10.0, backoff_s=0.01, max_backoff_s=0.01)
    calls, err = run_failing(p, t, retry_after=3.0, rng=EdgeRng(top=True))
    assert t.sleeps == [3.0, 3.0, 3.0] and calls == [0.0, 3.0, 6.0, 9.0]
    assert "server asked to retry after 3 s" in str(err)


def test_retry_after_past_the_budget_gives_up_at_once():
    t = FakeTime()
    calls, err = run_failing(RetryPolicy(timeout_s=5.0), t, retry_after=60.0)
    assert calls == [0.0] and t.sleeps == []  # no sleeping into a certain failure
    assert "1 attempts in 0.0 s (retry_timeout_s=5)" in str(err)


def test_success_after_retries_returns_the_value_and_reports_each_retry():
    t, seen = FakeTime(), []
    outcomes = [Retryable("refused"), Retryable("HTTP 503", 0.5), "ok"]

    async def attempt():
        o = outcomes.pop(0)
        if isinstance(o, Exception):
            raise o
        return o

    got = asyncio.run(call_with_retries(attempt, RetryPolicy(backoff_s=0.1, max_backoff_s=0.1), clock=t.clock,
                                        sleep=t.sleep, rng=EdgeRng(top=True),
                                        on_retry=lambda e, w: seen.append((str(e), w))))
    assert got == "ok" and seen == [("refused", 0.1), ("HTTP 503", 0.5)]


def test_other_errors_are_not_retried():
    t, calls = FakeTime(), []

    async def attempt():
        calls.append(1)
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(call_with_retries(attempt, RetryPolicy(), clock=t.clock, sleep=t.sleep))
    assert calls == [1] and t.sleeps == []


@pytest.mark.parametrize("kw,match", [({"timeout_s": -1}, "timeout_s"), ({"timeout_s": float("inf")}, "timeout_s"),
                                      ({"backoff_s": True}, "backoff_s"), ({"max_retries": -1}, "max_retries"),
                                      ({"backoff_s": 3.0, "max_backoff_s": 2.0}, "max_backoff_s"),
                                      ({"warmup_timeout_s": float("nan")}, "warmup_timeout_s")])
def test_policy_refuses_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kw)


def test_parse_retry_after():
    assert parse_retry_after("2") == 2.0 and parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("-3") == 0.0 and parse_retry_after("nan") is None
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert parse_retry_after(date, now=1_000_000.0) == 30.0


def test_while_a_replica_warms_up_the_budget_is_the_cold_start_one():
    """Same failing attempts: 30 s of retries while nobody is warming up, 100 s while one is (and
    the larger budget wins: a warm-up budget below timeout_s never shortens it)."""
    p = RetryPolicy(timeout_s=30.0, backoff_s=1.0, max_backoff_s=1.0, warmup_timeout_s=100.0)
    assert (p.budget_s(False), p.budget_s(True)) == (30.0, 100.0)
    assert RetryPolicy(timeout_s=30.0, warmup_timeout_s=10.0).budget_s(True) == 30.0
    for warming, last in ((False, 29.0), (True, 99.0)):
        t, calls = FakeTime(), []

        async def attempt():
            calls.append(t.now)
            raise Retryable("no live replica (http://a: warming_up)")

        with pytest.raises(RemoteError) as err:
            asyncio.run(call_with_retries(attempt, p, clock=t.clock, sleep=t.sleep, rng=EdgeRng(top=True),
                                          warming=lambda: warming))
        assert calls[-1] == last  # one attempt a second, the last one starting inside the budget
        assert ("warmup_timeout_s=100 while a replica warms up" in str(err.value)) == warming
