"""The concurrent driver: each episode an asyncio task calling ``agenerate`` one turn at a time
(the ``RemoteInferenceClient``), at most ``max_concurrency`` requests in flight; the server batches
them. An episode never waits for another's turn."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

from r3jax.engine import GenerateRequest
from r3jax.rollout.episode import Episode


async def drive_concurrently(episodes: Sequence[Episode],
                             agenerate: Callable[[list[GenerateRequest]], Awaitable[list]],
                             max_concurrency: int) -> None:
    """Run every episode to its end; the first failure cancels the others and is raised."""
    sem = asyncio.Semaphore(max_concurrency)

    async def drive(e: Episode) -> None:
        while not e.finished:
            req = e.request()
            async with sem:
                outs = await agenerate([req])
            if len(outs) != 1:
                raise ValueError(f"generator returned {len(outs)} outputs for 1 request")
            e.consume(outs[0])

    await drive_all(episodes, drive)


async def drive_all(episodes: Sequence, drive: Callable[[Any], Awaitable[None]]) -> None:
    """``drive(e)`` for every episode as its own task; the first failure cancels the others and is raised."""
    tasks = [asyncio.create_task(drive(e)) for e in episodes]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
