"""Replica choice without HTTP: rendezvous hashing moves only a dead replica's sessions, the least
loaded replica takes session-less requests, and a stale health probe cannot undo a newer one."""

from __future__ import annotations

import asyncio

import pytest

from r3jax.serve.client.errors import Retryable
from r3jax.serve.client.replicas import OK, Health, Replicas, rendezvous

URLS = ["http://a:1", "http://b:1", "http://c:1"]


async def healthy(url):
    return OK


def test_rendezvous_moves_only_the_dead_replicas_sessions():
    reps = Replicas(URLS, healthy)
    sessions = [f"s{i}" for i in range(200)]
    before = {s: rendezvous(s, reps.all).url for s in sessions}
    assert len(set(before.values())) == 3  # spread over all three
    survivors = [r for r in reps.all if r.url != "http://b:1"]
    after = {s: rendezvous(s, survivors).url for s in sessions}
    assert all(after[s] == before[s] for s in sessions if before[s] != "http://b:1")
    assert all(after[s] != "http://b:1" for s in sessions)


def test_pick_least_loaded_and_no_live_replica_is_retryable():
    async def main():
        async def down(url):
            return Health("down")
        reps = Replicas(URLS, down, health_interval_s=0.0)
        reps.all[0].in_flight, reps.all[1].in_flight, reps.all[2].in_flight = 3, 1, 2
        assert (await reps.pick(None)).url == "http://b:1"
        for r in reps.all:
            reps.mark_dead(r)
        with pytest.raises(Retryable, match="no live replica"):
            await reps.pick(None)
    asyncio.run(main())


def test_a_stale_probe_does_not_undo_a_newer_one():
    async def main():
        release = asyncio.Event()
        answers = iter([Health("down"), OK])  # the first probe hangs, then says "down"; the second says "up"

        async def check(url):
            answer = next(answers)
            if not answer.ok:
                await release.wait()
            return answer

        reps = Replicas(URLS[:1], check, health_interval_s=0.0)
        r = reps.all[0]
        reps.mark_dead(r)
        stale = asyncio.create_task(reps.probe(r))
        await asyncio.sleep(0)
        assert await reps.probe(r) is True and r.alive
        release.set()
        assert await stale is False
        assert r.alive  # the late "down" answer is ignored
    asyncio.run(main())


def test_retry_after_keeps_a_replica_out_of_rotation_that_long():
    t = [100.0]
    reps = Replicas(URLS[:1], healthy, health_interval_s=0.5, clock=lambda: t[0])
    r = reps.all[0]
    reps.mark_dead(r, 30.0)
    assert r.next_probe == 130.0
    reps.mark_dead(r)
    assert r.next_probe == 100.5
