"""Rollout engine: continuous batching over a paged KV + route pool (mixed prefill + decode steps,
decode loops on device, pages on demand), programs compiled ahead of time, and the routed experts of
every token recorded.

    from r3jax.engine import Engine, GenerateRequest
    engine = Engine(model, max_seq_len=512, max_batch_size=8)
    engine.warmup()                                     # compile every program once
    fut = engine.submit(GenerateRequest(prompt_ids=[1, 2, 3], return_routed_experts=True))
    out = fut.result()                                  # or: [out] = engine.generate([...])

Over several devices, engine cores split the requests (data parallelism):
``r3jax.engine.group.EngineGroup(model, data=D, max_seq_len=512, max_batch_size=8)`` has the same methods.
"""

from r3jax.engine.engine import Engine
from r3jax.engine.errors import Aborted, EngineAborted, EngineClosed, EngineFailedError
from r3jax.engine.request import GenerateOutput, GenerateRequest

__all__ = ["Aborted", "Engine", "EngineAborted", "EngineClosed", "EngineFailedError", "GenerateOutput",
           "GenerateRequest"]
