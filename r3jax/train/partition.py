"""Partition specs for the trainer: expert weights along ``expert`` x ``fsdp`` (the layout the
expert-parallel MoE layer runs on, models/expert_parallel.py), everything else along ``fsdp``,
batches along ``data`` x ``fsdp`` x ``expert`` (r3jax.sharding); and the mesh helpers the train
state uses."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.expert_parallel import expert_weight_spec
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


def _names(path) -> list[str]:
    return [n for n in (_name(p) for p in path) if n != "value"]


def _expert_parents(params) -> set[tuple[str, ...]]:
    """Paths of the modules holding expert weights: those with a ``router`` beside their
    gate/up/down projections (the MoE block; a dense or shared-expert MLP has no router)."""
    paths = [tuple(_names(p)) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    return {p[:-1] for p in paths if p and p[-1] == "router"}


def _is_expert_weight(path, leaf, expert_parents=None) -> bool:
    """An MoE block's gate/up/down projection: ``[..., E, D, I]`` / ``[..., E, I, D]`` (leading dims,
    such as a stacked layer dim, are allowed). Without ``expert_parents`` (the modules that hold a
    router, from :func:`_expert_parents`) any 3-d gate/up/down projection counts."""
    names = _names(path)
    if not names or names[-1] not in _EXPERT_PARAMS or leaf.ndim < 3:
        return False
    return leaf.ndim == 3 if expert_parents is None else tuple(names[:-1]) in expert_parents


def param_spec(path, leaf, mesh: Mesh, *, expert_parents=None) -> P:
    """PartitionSpec of one parameter. Expert tensors (gate/up ``[E, D, I]``, down ``[E, I, D]``,
    any leading dims replicated) follow :func:`models.expert_parallel.expert_weight_spec`: E on
    ``expert`` x ``fsdp`` (else E on ``expert``, I on ``fsdp``), the layout the expert-parallel MoE
    layer runs on without moving weights; every other tensor puts its largest dim on ``fsdp``. A
    dim is only sharded when the axis size divides it (otherwise it stays replicated, still
    correct). ``expert_parents``: the module paths holding a router (:func:`param_shardings`
    passes them, so that stacked dense MLPs ``[L, D, I]`` are not taken for experts)."""
    shape = tuple(leaf.shape)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if _is_expert_weight(path, leaf, expert_parents):
        tail = expert_weight_spec(_names(path)[-1], shape, sizes)
        return P(*([None] * (len(shape) - 3)), *tail)
    spec: list = [None] * len(shape)
    if sizes["fsdp"] > 1:
        for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
            if shape[d] % sizes["fsdp"] == 0:
                spec[d] = "fsdp"
                break
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """NamedSharding for every leaf of a params pytree (an ``nnx.State`` keeps its structure)."""
    parents = _expert_parents(params)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, param_spec(p, x, mesh, expert_parents=parents)), params)


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
