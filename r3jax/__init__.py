"""r3jax: routed-expert replay (R3) for RL of Mixture-of-Experts models in JAX.

The small public surface: routes on the wire, the trajectory trace and training batches here;
``r3jax.engine`` (Engine, GenerateRequest), ``r3jax.serve`` (create_app, RemoteInferenceClient),
``r3jax.rollout`` (AgentLoop, environments), ``r3jax.train`` (TrainState, train_step, Checkpointer)
and ``r3jax.metrics`` are imported on demand.
"""

from r3jax.batch import Batch, collate
from r3jax.routes import decode, encode, route_dtype
from r3jax.trace import RoutedExpertTrace, TokenMetadataTrace

__all__ = ["Batch", "RoutedExpertTrace", "TokenMetadataTrace", "collate", "decode", "encode", "route_dtype"]
