"""The batched driver: every live episode's next turn in one ``generate`` call per round (the
in-process ``Engine``), cut into chunks of the generator's ``max_batch_size``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from r3jax.engine import GenerateRequest
from r3jax.rollout.episode import Episode


def generate_in_chunks(generator: Any, requests: Sequence[GenerateRequest]) -> list:
    """``generator.generate`` over ``requests`` in chunks of its ``max_batch_size`` (all at once if it has none)."""
    size = getattr(generator, "max_batch_size", None) or len(requests)
    outs = []
    for i in range(0, len(requests), size):
        chunk = list(requests[i:i + size])
        got = list(generator.generate(chunk))
        if len(got) != len(chunk):
            raise ValueError(f"generator returned {len(got)} outputs for {len(chunk)} requests")
        outs += got
    return outs


def drive_batched(episodes: Sequence[Episode],
                  generate: Callable[[list[Episode], list[GenerateRequest]], list]) -> None:
    """Advance all ``episodes`` round by round until each is finished; ``generate(live, requests)``
    answers one output per request, in order."""
    live = [e for e in episodes if not e.finished]
    while live:
        requests = [e.request() for e in live]
        for e, out in zip(live, generate(live, requests)):
            e.consume(out)
        live = [e for e in live if not e.finished]
