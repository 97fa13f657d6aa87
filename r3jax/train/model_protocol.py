"""What the trainer needs from a model: the protocol a Flax NNX MoE of your own implements to train
with routed-expert replay through :func:`r3jax.train.train_step` (``models.MoeTransformer`` is one
such model). docs/own-model.md walks through it with a small example.

Only the attributes below are read; everything else about the model is yours.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from r3jax.checks import FieldError, is_int


class RouteConfig(Protocol):
    """``model.config``: a frozen (hashable) object; the trainer reads the route row's shape from it.

    num_moe_layers: L of every route array (MoE layers only, in model order); top_k: K;
    num_experts: E. Optional: ``router_aux_loss_coef`` (float), the aux-loss weight when
    ``LossConfig.aux_coef`` is None (absent: 0).
    """

    num_moe_layers: int
    top_k: int
    num_experts: int


class RoutedOutput(Protocol):
    """What ``model(...)`` returns (``models.ModelOutput`` is one; any object with these works).

    logits [B, T, V] f32; routes [B, T, L, K] int: the experts used (the replayed ones where
    ``replay.mask``); live_routes [B, T, L, K] int: the router's own top-k, also under replay;
    aux_loss: scalar f32 (0 if the model has none); expert_load [L, E] f32: (token, slot)
    assignments per expert over tokens where ``token_mask``.
    """

    logits: jax.Array
    routes: jax.Array
    live_routes: jax.Array
    aux_loss: jax.Array
    expert_load: jax.Array


@runtime_checkable
class ReplayableModel(Protocol):
    """An ``nnx.Module`` that the replaying train step can run.

    ``model(tokens, positions, replay=None, *, segment_ids=None, token_mask=None) -> RoutedOutput``:
    tokens, positions [B, T] int32; replay: ``models.Replay(routes [B, T, L, K] compact int,
    mask [B, T] bool)`` or None: where mask is True the MoE layer l must use ``routes[b, t, l]`` as
    its K experts (gates recomputed from the live router logits at those ids, so the router keeps
    its gradient), elsewhere its own top-k. segment_ids [B, T] int32 (0 = padding): tokens attend
    only within their segment (packed batches); token_mask [B, T] bool: the tokens the aux loss and
    expert_load count. Causality follows the index within the row, never position values.

    Optional, so that neither the loss nor the engine's prefill holds [B, T, V] f32 logits
    (r3jax/train/logits.py): a method ``logits(hidden [..., D]) -> [..., V] f32`` (the LM head),
    together with ``model(..., return_hidden=True)`` returning an output whose ``hidden`` [B, T, D]
    are the states the head takes (its ``logits`` may then be None). A model without a ``logits``
    method is called without ``return_hidden`` and its ``out.logits`` are used (same results, more
    memory).
    """

    config: Any

    def __call__(self, tokens, positions, replay=None, *, segment_ids=None, token_mask=None) -> RoutedOutput:
        ...


def route_config(model: Any) -> RouteConfig:
    """``model.config`` after a host-side check of the fields the trainer reads (:class:`RouteConfig`).

    Raises :class:`r3jax.checks.FieldError` naming the missing or bad field."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise FieldError("model.config", None, "an object with num_moe_layers, top_k and num_experts",
                         f"model.config: {type(model).__name__} has none: expected a frozen object with "
                         "num_moe_layers, top_k and num_experts (the route row [L, K]; see "
                         "r3jax.train.model_protocol.RouteConfig)")
    for name, lo in (("num_moe_layers", 0), ("top_k", 1), ("num_experts", 1)):
        value = getattr(cfg, name, None)
        if not is_int(value) or value < lo:
            raise FieldError(f"model.config.{name}", value, f"an int >= {lo}",
                             f"model.config.{name}={value!r}: expected an int >= {lo} "
                             f"({type(cfg).__name__}; see r3jax.train.model_protocol.RouteConfig)")
    if cfg.top_k > cfg.num_experts:
        raise FieldError("model.config.top_k", cfg.top_k, f"<= num_experts={cfg.num_experts}")
    return cfg
