"""Partition specs for the trainer: expert weights along ``expert`` x ``fsdp`` (the layout the
expert-parallel MoE layer runs on, models/expert_parallel.py), everything else along ``fsdp``,
batches along ``data`` x ``fsdp`` x ``expert`` (r3jax.sharding); and the mesh helpers the train
state uses."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.expert_parallel import expert_weight_spec
from models.stacking import is_stacked
from r3jax.sharding import AXES as MESH_AXES
from r3jax.sharding import batch_multiple as batch_divisor  # noqa: F401 (re-exported)
from r3jax.sharding import batch_sharding  # noqa: F401 (re-exported)

_EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")


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


def _name(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


def _is_expert_weight(path, ndim: int) -> bool:
    """ndim: of one layer's tensor (without a stacked layer axis)."""
    names = [_name(p) for p in path]
    names = [n for n in names if n != "value"]
    return ndim == 3 and bool(names) and names[-1] in _EXPERT_PARAMS


def param_spec(path, leaf, mesh: Mesh) -> P:
    """PartitionSpec of one parameter. Expert tensors (gate/up ``[E, D, I]``, down ``[E, I, D]``)
    follow :func:`models.expert_parallel.expert_weight_spec`: E on ``expert`` x ``fsdp`` (else E on
    ``expert``, I on ``fsdp``), the layout the expert-parallel MoE layer runs on without moving
    weights; every other tensor puts its largest dim on ``fsdp``. A dim is only sharded when the
    axis size divides it (otherwise it stays replicated, still correct). Stacked layers
    (models/stacking.py) keep their leading layer axis unsharded (the scan slices it per layer) and
    shard the rest as one layer's tensor."""
    shape = tuple(leaf.shape)
    lead = 1 if is_stacked(path) else 0
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if _is_expert_weight(path, len(shape) - lead):
        names = [n for n in (_name(p) for p in path) if n != "value"]
        return P(*([None] * lead), *expert_weight_spec(names[-1], shape, sizes))
    spec: list = [None] * len(shape)
    if sizes["fsdp"] > 1:
        for d in sorted(range(lead, len(shape)), key=lambda i: -shape[i]):
            if shape[d] % sizes["fsdp"] == 0:
                spec[d] = "fsdp"
                break
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """NamedSharding for every leaf of a params pytree (an ``nnx.State`` keeps its structure)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, param_spec(p, x, mesh)),
                                            params)


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
