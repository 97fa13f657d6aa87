"""Per-turn sampling settings of an agent loop, and the seeds that make a run reproducible whatever
the batching (env seeds and per-request sampling seeds derived from the loop's seed)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-turn sampling. ``stop_token_ids=None`` takes the environment's ``stop_token_ids``."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ValueError(f"sampling.max_tokens={mt!r}: expected an int >= 1")


def request_seed(*parts: int) -> int:
    """A request/env seed in [0, 2**31) from a tuple of ints (stable across runs and batchings)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)
