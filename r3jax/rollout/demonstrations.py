"""The oracle driver: each turn's action is the environment's ``reference_action()`` (cut at
``max_tokens`` and at the first stop token), for supervised warm-up data in the same token format as
sampled rollouts. Logprobs are 0 and no routes are captured."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from r3jax.engine import GenerateRequest
from r3jax.rollout.episode import Episode


def oracle_generate(episodes: Sequence[Episode], requests: Sequence[GenerateRequest]) -> list:
    """One :class:`OracleOutput` per (episode, request): the episode's env plays its reference action."""
    outs = []
    for e, q in zip(episodes, requests):
        ids = [int(t) for t in e.env.reference_action()][:q.max_tokens]
        stop = next((j for j, t in enumerate(ids) if t in q.stop_token_ids), None)
        ids = ids if stop is None else ids[:stop + 1]
        outs.append(OracleOutput(ids, [0.0] * len(ids), "length" if stop is None else "stop"))
    return outs


@dataclasses.dataclass(frozen=True)
class OracleOutput:
    """What a generator would return, for a turn the environment's oracle played."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: None = None
    cached_tokens: int = 0
    weight_version: int = 0
