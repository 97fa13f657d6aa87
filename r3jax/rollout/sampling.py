"""Per-turn sampling settings of an agent loop, and the seeds that fix a run's random draws whatever
the batching (env seeds and per-request sampling seeds derived from the loop's seed)."""

from __future__ import annotations

import dataclasses

import numpy as np

from r3jax.checks import DEFAULT_LOGPROBS_MODE, check_logprobs_mode


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-turn sampling. ``stop_token_ids=None`` takes the environment's ``stop_token_ids``.
    ``logprobs_mode``: the engine's (vLLM's names): "raw_logprobs" (default) records log_softmax of
    the model's logits; "processed_logprobs" records the sampled distribution's (after temperature,
    top-k, top-p), to train with ``LossConfig(temperature=, top_k=, top_p=)`` set to these values."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    def __post_init__(self):
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ValueError(f"sampling.max_tokens={mt!r}: expected an int >= 1")
        check_logprobs_mode(self.logprobs_mode, "sampling.logprobs_mode")


def request_seed(*parts: int) -> int:
    """A request/env seed in [0, 2**31) from a tuple of ints (stable across runs and batchings)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)
