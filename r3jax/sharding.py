"""Device mesh with named axes (data, fsdp, expert) and the placement of training batches on it.

Axis types are ``AxisType.Auto`` by default: with ``Explicit`` axes the model's embedding gather
(``jnp.take`` of a replicated table by batch-sharded ids) raises a ShardingTypeError in JAX 0.10.2
unless every such op names an ``out_sharding``; ``Auto`` lets XLA propagate shardings from the
placed inputs, under ``jax.jit`` with or without ``jax.set_mesh(mesh)``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from r3jax.checks import is_int

AXES = ("data", "fsdp", "expert")
# The batch dimension is split over every axis: outside the MoE layers ``expert`` acts as one more data
# axis (as in MaxText), so attention and the rest split over all devices; inside them the
# expert-parallel layer (models/expert_parallel.py) exchanges tokens along fsdp x expert.
BATCH_AXES = ("data", "fsdp", "expert")


def make_mesh(data: int = -1, fsdp: int = 1, expert: int = 1, devices: Sequence[Any] | None = None,
              *, axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A ``(data, fsdp, expert)`` mesh over ``devices`` (default: all). One size may be -1: it takes
    the devices left over. The sizes must multiply to the device count."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "expert": expert}
    for name, v in sizes.items():
        if not is_int(v) or (v < 1 and v != -1):
            raise ValueError(f"{name}={v!r}: expected an int >= 1, or -1 for the remaining devices")
    free = [name for name, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"{' and '.join(free)} are both -1: expected at most one axis of size -1")
    known = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"{free[0]}=-1: {len(devices)} devices are not divisible by the other "
                             f"axes' product {known}")
        sizes[free[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh (data={sizes['data']}, fsdp={sizes['fsdp']}, expert={sizes['expert']}) "
                         f"has {math.prod(sizes.values())} slots: expected {len(devices)} "
                         f"(the device count)")
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=(axis_type,) * len(AXES),
                         devices=devices)


def batch_multiple(mesh: Mesh) -> int:
    """How many shards the batch dimension is split into (data x fsdp x expert, the device count):
    B must be a multiple."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``NamedSharding(mesh, P(("data", "fsdp", "expert")))``: dim 0 split over data x fsdp x
    expert, the rest replicated; valid for every :class:`r3jax.batch.Batch` leaf whatever its rank."""
    return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place every leaf of ``batch`` (a Batch or any pytree of ``[B, ...]`` arrays) with
    :func:`batch_sharding`. Dtypes are kept: routes stay uint8/int16 on device."""
    m = batch_multiple(mesh)
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    for path, leaf in leaves:
        name = "batch" + jax.tree_util.keystr(path)
        shape = np.shape(leaf)
        if len(shape) == 0 or shape[0] % m:
            raise ValueError(f"{name} shape={shape}: expected a leading batch dim that is a multiple "
                             f"of data x fsdp x expert = {m} (collate(..., batch_multiple={m}))")
    return jax.device_put(batch, batch_sharding(mesh))
