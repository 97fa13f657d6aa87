"""A deterministic stand-in generator for tests and examples: no model, exact routes.

The route row of absolute position i is a pure function of i and of token i, so a correct
incremental rollout and a full re-gather must produce the same per-token array, row for row, and
any misalignment shows up as a different row. It honours ``routed_experts_prompt_start`` exactly
like the engine: rows for positions ``[s, P + G - 1)``.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import numpy as np

from r3jax.engine import GenerateOutput, GenerateRequest
from r3jax.routes import route_dtype


def positional_routes(tokens: Sequence[int], start: int, stop: int, *, num_layers: int,
                      top_k: int, num_experts: int) -> np.ndarray:
    """``[stop - start, L, K]``: row i = ``(7 i + 3 tokens[i] + 5 l + 0..K-1) mod E`` for layer l
    (K distinct ids per row since K <= E)."""
    i = np.arange(start, stop)[:, None, None]
    tok = np.asarray(tokens[start:stop], np.int64)[:, None, None]
    layer = np.arange(num_layers)[None, :, None]
    ids = (7 * i + 3 * tok + 5 * layer + np.arange(top_k)[None, None, :]) % num_experts
    return ids.astype(route_dtype(num_experts))


def _default_policy(prompt: Sequence[int], request: GenerateRequest) -> list[int]:
    """A digit that depends on the prompt length and the seed, then the first stop token."""
    digit = ord("0") + (len(prompt) + (request.seed or 0)) % 10
    return [digit] + list(request.stop_token_ids[:1])


class FakeGenerator:
    """Same interface as the engine and the HTTP client: ``generate``, ``agenerate``, ``model_info``.

    ``policy(prompt_ids, request) -> tokens`` is the intended reply (cut at ``max_tokens``; a stop
    token inside ends it). ``drop_routes=True`` returns no routes (to test the loop's error).
    ``weight_version`` may be changed between calls. ``calls`` records every request served.
    """

    def __init__(self, *, num_experts: int = 8, top_k: int = 2, moe_layer_ids: Sequence[int] = (1, 2),
                 vocab_size: int = 272, max_seq_len: int = 256,
                 policy: Callable[[Sequence[int], GenerateRequest], list[int]] | None = None,
                 drop_routes: bool = False, max_batch_size: int = 64):
        self.num_experts, self.top_k = num_experts, top_k
        self.moe_layer_ids = tuple(moe_layer_ids)
        self.vocab_size, self.max_seq_len, self.max_batch_size = vocab_size, max_seq_len, max_batch_size
        self.policy = _default_policy if policy is None else policy
        self.drop_routes = drop_routes
        self.weight_version = 0
        self.calls: list[GenerateRequest] = []
        self.batch_sizes: list[int] = []

    def model_info(self) -> dict:
        return {"num_experts": self.num_experts, "top_k": self.top_k,
                "num_moe_layers": len(self.moe_layer_ids), "moe_layer_ids": list(self.moe_layer_ids),
                "vocab_size": self.vocab_size, "max_seq_len": self.max_seq_len,
                "weight_version": self.weight_version}

    def routes_for(self, tokens: Sequence[int], start: int, stop: int) -> np.ndarray:
        return positional_routes(tokens, start, stop, num_layers=len(self.moe_layer_ids),
                                 top_k=self.top_k, num_experts=self.num_experts)

    def _one(self, req: GenerateRequest) -> GenerateOutput:
        prompt = req.validate(vocab_size=self.vocab_size, max_seq_len=self.max_seq_len).tolist()
        self.calls.append(req)
        out, finish = [], "length"
        for t in self.policy(prompt, req)[:req.max_tokens]:
            out.append(int(t))
            if t in req.stop_token_ids:
                finish = "stop"
                break
        if not out:
            raise ValueError("FakeGenerator policy returned no tokens")
        s, full = req.routed_experts_prompt_start, prompt + out
        routes = None
        if req.return_routed_experts and not self.drop_routes:
            routes = self.routes_for(full, s, len(full) - 1)
        logprobs = [-0.25 * (j + 1) for j in range(len(out))] if req.return_logprobs else None
        return GenerateOutput(output_ids=out, logprobs=logprobs, finish_reason=finish,
                              routed_experts=routes, prompt_tokens=len(prompt), cached_tokens=0,
                              weight_version=self.weight_version, routed_experts_start=s)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        if len(requests) > self.max_batch_size:
            raise ValueError(f"len(requests)={len(requests)}: expected <= max_batch_size="
                             f"{self.max_batch_size}")
        self.batch_sizes.append(len(requests))
        return [self._one(r) for r in requests]

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        await asyncio.sleep(0)  # yield, so concurrent trajectories really interleave
        return self.generate(requests)
