"""Partition specs for the trainer, from the one logical-axis table (:mod:`models.axes`, role
``"train"``): expert weights along ``expert`` x ``fsdp`` (the layout the expert-parallel MoE layer runs
on, models/expert_parallel.py), every other parameter's largest dim that ``fsdp`` divides along
``fsdp``, batches along ``data`` x ``fsdp`` x ``expert`` (r3jax.sharding); and the mesh helpers the
train state uses."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import axes
from r3jax.sharding import AXES as MESH_AXES
from r3jax.sharding import batch_multiple as batch_divisor  # noqa: F401 (re-exported)
from r3jax.sharding import batch_sharding  # noqa: F401 (re-exported)


def single_device_mesh(device=None) -> Mesh:
    """A (1, 1, 1) mesh over one device with the trainer's axis names (the 1-device default)."""
    device = jax.devices()[0] if device is None else device
    return jax.make_mesh((1, 1, 1), MESH_AXES, devices=[device], axis_types=(AxisType.Auto,) * 3)


def check_mesh(mesh: Mesh) -> Mesh:
    """Host-side check that ``mesh`` has the axes data, fsdp, expert with Auto axis types.

    The model is written for compiler-propagated (Auto) sharding; Explicit axes would require
    sharding annotations inside the model (gathers and einsums raise ShardingTypeError).
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh.axis_names={tuple(mesh.axis_names)}: expected {MESH_AXES}")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ValueError(f"mesh.axis_types={mesh.axis_types}: expected all AxisType.Auto "
                         "(build it with jax.make_mesh(..., axis_types=(AxisType.Auto,) * 3))")
    return mesh


def param_spec(path, leaf, mesh: Mesh, *, allow_replication: bool = False, notes: list | None = None) -> P:
    """PartitionSpec of one parameter, from its logical axes (:func:`models.axes.param_axes`: the
    ``logical_axes`` it was built with, a leading ``layers`` axis for stacked layers) and the
    trainer's rules of :data:`models.axes.RULES`. Expert tensors (gate/up ``[E, D, I]``, down
    ``[E, I, D]``) get E on ``expert`` x ``fsdp`` (else E on ``expert``, I on ``fsdp``), as
    :func:`models.expert_parallel.expert_weight_spec`; every other tensor puts its largest dim that
    ``fsdp`` divides on ``fsdp``; the stacked layer axis stays unsharded (the scan slices it).

    Raises :class:`models.axes.ReplicationError` when a mesh axis the tensor asks for divides none of
    its dims (the tensor would be replicated over it), unless ``allow_replication`` (then it warns,
    naming the multiplier, or adds the message to ``notes``); norm scales may stay whole.
    """
    logical = axes.param_axes(path, leaf)
    return P(*axes.spec(logical, tuple(leaf.shape), axes.mesh_sizes(mesh), "train", what=axes.leaf_name(path),
                        allow_replication=allow_replication, notes=notes))


def param_shardings(params, mesh: Mesh, *, allow_replication: bool = False):
    """NamedSharding for every leaf of a params pytree (an ``nnx.State`` keeps its structure, its
    variables holding the shardings). With ``allow_replication``: one warning for all the tensors
    replicated (:func:`param_spec`)."""
    is_var = lambda x: isinstance(x, nnx.Variable)
    notes: list[str] = []

    def one(path, x):
        sh = NamedSharding(mesh, param_spec(path, x, mesh, allow_replication=allow_replication, notes=notes))
        return x.replace(sh) if is_var(x) else sh

    out = jax.tree_util.tree_map_with_path(one, params, is_leaf=is_var)
    axes.warn_replication(notes)
    return out


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def mesh_of(tree) -> Mesh:
    """The Mesh that the first NamedSharding-placed leaf of ``tree`` lives on."""
    for leaf in jax.tree.leaves(tree):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding) and isinstance(sh.mesh, Mesh):
            return sh.mesh
    raise ValueError("state has no leaf placed with a NamedSharding on a concrete Mesh: expected a "
                     "TrainState built by init_train_state or restored by Checkpointer")
