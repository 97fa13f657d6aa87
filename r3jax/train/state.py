"""TrainState: the trainer's whole state as one pytree (model graphdef static), placed on a mesh."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from r3jax.sharding import place_copy
from r3jax.train import partition


@struct.dataclass
class TrainState:
    """graphdef and tx are static (part of the tree structure); the rest are leaves.

    params: ``nnx.State`` of the model's ``nnx.Param`` variables (what ``Engine.set_weights`` takes);
    rest: every other model variable (empty for ``MoeTransformer``); opt_state: optax state;
    step: int32 scalar, optimizer steps taken; rng: uint32 [2] PRNG key data, split once per step.
    """

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    params: nnx.State
    rest: nnx.State
    opt_state: Any
    step: jax.Array
    rng: jax.Array

    def model(self) -> nnx.Module:
        """A live module view of the current parameters (for evaluation outside the hot loop)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    @property
    def mesh(self) -> Mesh:
        return partition.mesh_of(self.params)


def state_shardings(state: TrainState, mesh: Mesh, *, allow_replication: bool = False) -> TrainState:
    """A TrainState-shaped pytree of NamedShardings: params per :func:`partition.param_spec`, the
    optimizer's param-shaped slots like their params, every other leaf replicated. allow_replication:
    see :func:`partition.param_spec`."""
    p_sh = partition.param_shardings(state.params, mesh, allow_replication=allow_replication)
    rep = partition.replicated(mesh)
    is_sh = lambda x: isinstance(x, jax.sharding.Sharding)
    opt_sh = optax.tree_map_params(state.tx, lambda _, s: s, state.opt_state, p_sh,
                                   transform_non_params=lambda _: rep, is_leaf=is_sh)
    return state.replace(params=p_sh, rest=jax.tree.map(lambda _: rep, state.rest), opt_state=opt_sh,
                         step=rep, rng=rep)


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, *, mesh: Mesh | None = None,
                     seed: int = 0, allow_replication: bool = False) -> TrainState:
    """Split ``model`` once and build its TrainState placed on ``mesh`` (default: a 1-device mesh).

    Parameters are copied with :func:`partition.param_spec` shardings (the model keeps its own
    buffers); ``tx.init`` runs jitted with matching output shardings. A mesh axis that would leave a
    parameter replicated raises :class:`models.axes.ReplicationError` unless ``allow_replication``.
    """
    mesh = partition.single_device_mesh() if mesh is None else partition.check_mesh(mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    abstract = TrainState(graphdef=graphdef, tx=tx, params=params, rest=rest,
                          opt_state=jax.eval_shape(tx.init, params),
                          step=jax.ShapeDtypeStruct((), jnp.int32),
                          rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    sh = state_shardings(abstract, mesh, allow_replication=allow_replication)
    # Copies, never aliases: train_step donates the state, and the model (maybe shared with an
    # engine) must keep valid buffers.
    params, rest = place_copy(params, sh.params), place_copy(rest, sh.rest)
    opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), sh.step)
    rng = jax.device_put(jax.random.PRNGKey(seed), sh.rng)
    return TrainState(graphdef=graphdef, tx=tx, params=params, rest=rest, opt_state=opt_state,
                      step=step, rng=rng)
