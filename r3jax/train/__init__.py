"""The trainer: TrainState, the replaying policy-gradient step, partition specs, orbax checkpoints
and weight sync to the rollout side."""

from r3jax.train.checkpoint import (Checkpointer, CheckpointMismatchError, CheckpointReadError,
                                    CheckpointWriteError)
from r3jax.train.logits import TargetStats, target_stats
from r3jax.train.loss import LossConfig, group_advantages, policy_loss, token_logprobs
from r3jax.train.model_protocol import ReplayableModel, RouteConfig, RoutedOutput, route_config
from r3jax.train.partition import param_shardings, param_spec, single_device_mesh
from r3jax.train.ppo import ppo_update
from r3jax.train.state import TrainState, init_train_state, state_shardings
from r3jax.train.step import (REPLAY_MODES, eval_step, forward_metrics, make_train_step,
                              record_old_logprobs, record_trainer_routes, train_step, validate_batch)
from r3jax.train.weight_sync import export_params, load_params, push_to_engine, push_to_server

__all__ = [
    "CheckpointMismatchError", "CheckpointReadError", "CheckpointWriteError", "Checkpointer", "LossConfig",
    "REPLAY_MODES", "ReplayableModel", "RouteConfig", "RoutedOutput", "TargetStats", "TrainState", "eval_step",
    "export_params",
    "forward_metrics", "group_advantages", "init_train_state", "load_params", "make_train_step",
    "param_shardings", "param_spec", "policy_loss", "ppo_update", "push_to_engine", "push_to_server",
    "record_old_logprobs", "record_trainer_routes", "route_config",
    "single_device_mesh", "state_shardings", "target_stats", "token_logprobs", "train_step", "validate_batch",
]
