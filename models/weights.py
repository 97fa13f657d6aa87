"""What a model's *weights* are: every ``nnx.Param`` plus the non-trainable router biases
(:class:`models.routers.RouterBias`, DeepSeek's ``e_score_correction_bias``). The biases sit outside
the optimizer's params but change which experts are selected, so whatever moves a policy (weight
sync, export, load) moves both."""

from __future__ import annotations

import jax
from flax import nnx

from models.routers import RouterBias

WEIGHTS = nnx.Any(nnx.Param, RouterBias)


def split_weights(weights: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(params, router biases)`` of a weights state (the biases part is empty for models without
    them); ValueError naming the variables that are neither."""
    params, biases, other = nnx.split_state(weights, nnx.Param, RouterBias, ...)
    if jax.tree.leaves(other):
        names = sorted({jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(other)[0]})
        raise ValueError(f"weights: {names[:3]} are neither nnx.Param nor RouterBias variables")
    return params, biases
