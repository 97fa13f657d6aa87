"""Rollout engine: batched, jitted generation that records the routed experts of every token.

    from r3jax.engine import Engine, GenerateRequest
    engine = Engine(model, max_seq_len=512, max_batch_size=8)
    [out] = engine.generate([GenerateRequest(prompt_ids=[1, 2, 3], return_routed_experts=True)])
"""

from r3jax.engine.engine import Engine
from r3jax.engine.request import GenerateOutput, GenerateRequest

__all__ = ["Engine", "GenerateOutput", "GenerateRequest"]
