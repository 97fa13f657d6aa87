"""Device mesh with named axes (data, fsdp, expert) and the placement of training batches on it.

Axis types are ``AxisType.Auto`` by default: with ``Explicit`` axes the model's embedding gather
(``jnp.take`` of a replicated table by batch-sharded ids) raises a ShardingTypeError in JAX 0.10.2
unless every such op names an ``out_sharding``; ``Auto`` lets XLA propagate shardings from the
placed inputs, under ``jax.jit`` with or without ``jax.set_mesh(mesh)``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from models import axes
from r3jax.checks import is_int

AXES = axes.MESH_AXES["train"]
# The batch dimension is split over every axis (models.axes.BATCH_AXES): outside the MoE layers
# ``expert`` acts as one more data axis (as in MaxText), so attention and the rest split over all
# devices; inside them the expert-parallel layer (models/expert_parallel.py) exchanges tokens along
# fsdp x expert.
BATCH_AXES = axes.BATCH_AXES


def make_mesh(data: int = -1, fsdp: int = 1, expert: int = 1, devices: Sequence[Any] | None = None,
              *, axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A ``(data, fsdp, expert)`` mesh over ``devices`` (default: all). One size may be -1: it takes
    the devices left over. The sizes must multiply to the device count (:func:`models.axes.make_mesh`,
    the trainer's role)."""
    return axes.make_mesh("train", {"data": data, "fsdp": fsdp, "expert": expert}, devices, axis_type=axis_type)


@functools.lru_cache(maxsize=256)
def _copier(shardings: tuple) -> Any:
    """A jitted copy of a list of arrays onto exactly ``shardings`` (one program per list of shapes)."""
    return jax.jit(lambda leaves: [jnp.copy(x) for x in leaves], out_shardings=list(shardings))


def place_copy(tree: Any, shardings: Any) -> Any:
    """``tree`` placed as ``shardings`` in buffers of its own, device to device where its arrays already
    live on devices (:func:`move`). ``jax.device_put(..., may_alias=False)`` alone still aliases the
    source's buffer on its own device when the target is replicated over several devices (JAX 0.10.2);
    a donated train step would then delete the other side's array (the engine's weights after an
    in-process sync, or the model's). So the copy of a device array is a jitted one, with the requested
    shardings exactly (not just equivalent ones) on its outputs; an array already on the target's devices
    goes straight into it (XLA reshards it there), the others are moved onto them first. A host value
    (numpy) is ``device_put`` once: that buffer is already its own."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = tuple(jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    if len(targets) != len(leaves):
        raise ValueError(f"shardings: {len(targets)} shardings for {len(leaves)} arrays: expected one per array")
    if not leaves:
        return jax.tree.unflatten(treedef, leaves)
    out = list(leaves)
    # host values (numpy, scalars): device_put already makes buffers of their own, with exactly ``s``
    on_device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, (x, s) in enumerate(zip(leaves, targets)):
        if not isinstance(x, jax.Array):
            out[i] = jax.device_put(x, s)
    if on_device:
        moved = [leaves[i] if _on_devices_of(leaves[i], targets[i]) else move(leaves[i], targets[i]) for i in on_device]
        for i, y in zip(on_device, _copier(tuple(targets[i] for i in on_device))(moved)):
            out[i] = y
    return jax.tree.unflatten(treedef, out)


def _on_devices_of(x: Any, s: jax.sharding.Sharding) -> bool:
    """``x`` is a committed array on exactly ``s``'s devices, in ``s``'s order (what a jitted program
    with output sharding ``s`` accepts as an input)."""
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and getattr(x, "_committed", False)
            and tuple(x.sharding._device_assignment) == tuple(s._device_assignment))


def move(x: Any, s: jax.sharding.Sharding) -> Any:
    """``x`` on sharding ``s``, device to device when ``x`` is an array on devices.

    ``jax.device_put`` of a multi-device array onto a sharding whose shards it does not hold as shards
    (another partition spec, a subset of its devices, one device) copies the whole array through the
    host (JAX 0.10.2, ``shard_sharded_device_array_slow_path``). Here such an array is first resharded
    on its own devices by XLA (:func:`_bridge`: every shard of ``s`` on its own device, or on a stand-in
    device when that one is not among ``x``'s), so the final ``device_put`` only picks (or copies) whole
    shards between devices. A host value, an array on one device, one already laid out as ``s``, one on
    the same devices in another order and one not fully addressable take plain ``jax.device_put``."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.is_fully_addressable:
        return jax.device_put(x, s)  # a host value, a tracer (under eval_shape / jit), another process's
    src = x.sharding
    if len(src.device_set) == 1 or src.is_equivalent_to(s, x.ndim) or not isinstance(src, NamedSharding):
        return jax.device_put(x, s)
    if src.device_set == s.device_set:
        return _reshard(x, s)
    bridge = _bridge(src, s)
    if bridge is None:  # cannot lay s's shards out over x's devices: device_put's own path
        return jax.device_put(x, s)
    return jax.device_put(_reshard(x, bridge), s)


def _reshard(x: jax.Array, s: jax.sharding.Sharding) -> jax.Array:
    """``x`` resharded onto ``s`` (same device set) by XLA: a jitted copy when the device order is the
    same (``device_put`` would go through the host), ``device_put``'s own reorder-then-jit otherwise."""
    if _on_devices_of(x, s):
        return _copier((s,))([x])[0]
    return jax.device_put(x, s)


def _bridge(src: jax.sharding.Sharding, dst: jax.sharding.Sharding) -> NamedSharding | None:
    """A sharding over ``src``'s devices that holds each shard of ``dst`` as a whole shard on ``dst``'s
    device for it (a stand-in device of ``src`` when that one is not in ``src``), replicated over the
    devices left: ``dst``'s mesh with one more axis of ``len(src) / len(dst)``. None when ``dst`` is
    neither a NamedSharding nor on one device, or its device count does not divide ``src``'s."""
    if isinstance(dst, NamedSharding):
        grid, names, types, spec = dst.mesh.devices, dst.mesh.axis_names, dst.mesh.axis_types, dst.spec
    elif len(dst.device_set) == 1:
        grid, names, types, spec = np.array(list(dst.device_set)), ("one",), (AxisType.Auto,), P()
    else:
        return None
    have = sorted(src.device_set, key=lambda d: d.id)
    if len(have) % grid.size:
        return None
    wanted = list(grid.flat)
    spare = [d for d in have if d not in set(wanted)]
    first = [d if d in set(have) else spare.pop(0) for d in wanted]
    cells = np.array(first + spare, dtype=object).reshape((len(have) // grid.size,) + grid.shape)
    mesh = Mesh(np.moveaxis(cells, 0, -1), tuple(names) + ("bridge",), axis_types=tuple(types) + (AxisType.Auto,))
    return NamedSharding(mesh, spec)


def batch_multiple(mesh: Mesh) -> int:
    """How many shards the batch dimension is split into (data x fsdp x expert, the device count):
    B must be a multiple."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``NamedSharding(mesh, P(("data", "fsdp", "expert")))``: dim 0 split over data x fsdp x
    expert, the rest replicated; valid for every :class:`r3jax.batch.Batch` leaf whatever its rank."""
    return NamedSharding(mesh, P(BATCH_AXES))


def process_batch_multiple(mesh: Mesh) -> int:
    """How many of the :func:`batch_multiple` batch shards this process's devices hold (all of them
    in a single process): a process's own rows must be a multiple of this."""
    m = batch_multiple(mesh)
    me = jax.process_index()
    starts = {idx[0].indices(m)[0] for d, idx in batch_sharding(mesh).devices_indices_map((m,)).items()
              if d.process_index == me}
    return len(starts)


def process_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows ``[start, stop)`` of a global batch of ``batch_size`` rows that this process feeds
    (its devices' shards under :func:`batch_sharding`): ``slice(0, B)`` in a single process.

    Raises ValueError when B is not a multiple of :func:`batch_multiple` or when this process's
    shards are not one contiguous block of rows (a mesh whose batch axes interleave processes).
    """
    m = batch_multiple(mesh)
    if not is_int(batch_size) or batch_size < 1 or batch_size % m:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive multiple of the batch shard "
                         f"count {m}")
    me = jax.process_index()
    spans = sorted({idx[0].indices(batch_size)[:2]
                    for d, idx in batch_sharding(mesh).devices_indices_map((batch_size,)).items()
                    if d.process_index == me})
    if not spans:
        raise ValueError(f"process {me} has no device in the mesh: expected every process to hold "
                         "at least one of its devices")
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        if start != stop:
            raise ValueError(f"process {me} feeds rows {spans}: expected one contiguous block (build "
                             "the mesh over jax.devices() in their default, process-major order)")
    return slice(spans[0][0], spans[-1][1])


def shard_batch(batch: Any, mesh: Mesh, *, process_local: bool = True) -> Any:
    """Place every leaf of ``batch`` (a Batch or any pytree of ``[B, ...]`` arrays) with
    :func:`batch_sharding`. Dtypes are kept: routes stay uint8/int16 on device.

    ``process_local=True`` (default): ``batch`` holds this process's own rows, the global batch
    being every process's rows in process order (:func:`process_rows` says which; with one process
    that is the whole batch). Each process then passes a multiple of
    :func:`process_batch_multiple` rows, and every process the same number.
    ``process_local=False``: every process passes the same, whole global batch.
    """
    local = process_local and jax.process_count() > 1
    m = process_batch_multiple(mesh) if local else batch_multiple(mesh)
    what = (f"this process's share of the data x fsdp x expert shards = {m} (shard_batch takes each "
            "process's own rows)") if local else f"data x fsdp x expert = {m} (collate(..., batch_multiple={m}))"
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        name = "batch" + jax.tree_util.keystr(path)
        shape = np.shape(leaf)
        if len(shape) == 0 or shape[0] % m:
            raise ValueError(f"{name} shape={shape}: expected a leading batch dim that is a multiple "
                             f"of {what}")
    sharding = batch_sharding(mesh)
    if local:
        # rows of this process -> its devices' shards; the global B is inferred (uniform shares)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                            batch)
    if jax.process_count() > 1:  # the same global batch everywhere: each process takes its shards
        return jax.tree.map(lambda x: jax.make_array_from_callback(
            np.shape(x), sharding, lambda idx, x=np.asarray(x): x[idx]), batch)
    return jax.device_put(batch, sharding)
