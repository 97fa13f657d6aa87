"""Where the engine's arrays live: parameters and slot state on a device mesh.

The trainer's partition rules (:mod:`r3jax.train.partition`) use axes ``(data, fsdp, expert)`` and
have no tensor axis, so serving has its own rules over a ``(data, tensor, expert)`` mesh:

- experts ``[E, ...]`` along ``expert``; their hidden dim ``I`` along ``tensor``;
- attention projections by heads along ``tensor`` (q/k/v output dim, o input dim); dense MLP hidden
  dim along ``tensor``; embedding and LM head by vocabulary along ``tensor``; norms and the router
  replicated;
- slot state by slot along ``data`` and the KV cache's kv heads along ``tensor``;
- the leading layer axis of stacked (scanned) layers and of the KV cache is never sharded.

An axis the mesh lacks counts as size 1, and a dim is sharded only when the axis size divides it
(otherwise it stays replicated: still correct). Without a mesh everything lives on one device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from models.stacking import is_stacked

AXES = ("data", "tensor", "expert")
_EXPERT = ("gate_proj", "up_proj", "down_proj")


def make_mesh(data: int = -1, tensor: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A ``(data, tensor, expert)`` serving mesh (Auto axes). ``data=-1`` takes the devices left over."""
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (("data", data), ("tensor", tensor), ("expert", expert)):
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and not (name == "data" and v == -1)):
            raise ValueError(f"{name}={v!r}: expected an int >= 1" + (" or -1" if name == "data" else ""))
    if data == -1:
        if len(devices) % (tensor * expert):
            raise ValueError(f"{len(devices)} devices are not divisible by tensor * expert = {tensor * expert}")
        data = len(devices) // (tensor * expert)
    if data * tensor * expert != len(devices):
        raise ValueError(f"mesh (data={data}, tensor={tensor}, expert={expert}) has {data * tensor * expert} "
                         f"slots: expected {len(devices)} (the device count)")
    return jax.make_mesh((data, tensor, expert), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _name(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


class Placement:
    """Shardings of the engine's arrays on ``mesh`` (or on one device when mesh is None)."""

    def __init__(self, mesh: Mesh | None, cfg):
        if mesh is not None:
            if not isinstance(mesh, Mesh):
                raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
            if any(t == AxisType.Explicit for t in mesh.axis_types):
                raise ValueError(f"mesh.axis_types={mesh.axis_types}: expected Auto axes (the model relies "
                                 "on compiler-propagated sharding)")
        self.mesh, self.cfg = mesh, cfg
        self._sizes = {} if mesh is None else dict(zip(mesh.axis_names, mesh.devices.shape))
        self.device = jax.devices()[0] if mesh is None else None

    def size(self, axis: str) -> int:
        return int(self._sizes.get(axis, 1))

    def _axis(self, axis: str, dim: int):
        n = self.size(axis)
        return axis if n > 1 and dim % n == 0 else None

    def sharding(self, *spec) -> jax.sharding.Sharding:
        if self.mesh is None:
            return SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> jax.sharding.Sharding:
        return self.sharding()

    def put(self, x, sharding=None):
        """A host value on ``sharding`` (default: replicated)."""
        return jax.device_put(x, self.replicated if sharding is None else sharding)

    # ---- parameters ----------------------------------------------------------------------------
    def param_spec(self, path, leaf) -> tuple:
        """The spec of one parameter; stacked layers (models/stacking.py) keep their leading layer
        axis unsharded and get the spec of one layer's matrix after it."""
        if is_stacked(path):
            return (None,) + self._matrix_spec(path, tuple(leaf.shape)[1:])
        return self._matrix_spec(path, tuple(leaf.shape))

    def _matrix_spec(self, path, shape: tuple) -> tuple:
        cfg = self.cfg
        names = [n for n in (_name(p) for p in path) if n != "value"]
        last = names[-1] if names else ""
        t = lambda d, heads=None: self._axis("tensor", d if heads is None else heads) and "tensor"
        if len(shape) == 3 and last in _EXPERT:  # [E, D, I] or [E, I, D]
            e = self._axis("expert", shape[0])
            return (e, None, t(shape[2])) if last != "down_proj" else (e, t(shape[1]), None)
        if last in ("q_proj", "k_proj", "v_proj"):
            heads = cfg.num_heads if last == "q_proj" else cfg.num_kv_heads
            return (None, t(shape[1], heads))
        if last == "o_proj":
            return (t(shape[0], cfg.num_heads), None)
        if len(shape) == 2 and last in ("gate_proj", "up_proj"):
            return (None, t(shape[1]))
        if len(shape) == 2 and last == "down_proj":
            return (t(shape[0]), None)
        if last == "embed":
            return (t(shape[0]), None)
        if last == "lm_head":
            return (None, t(shape[1]))
        return (None,) * len(shape)

    def params(self, tree, like=None):
        """Own copies of the parameter arrays, placed by :meth:`param_spec` (or like ``like``'s leaves)."""
        if like is not None:
            return jax.tree.map(lambda x, old: jax.device_put(x, old.sharding, may_alias=False), tree, like)
        return jax.tree_util.tree_map_with_path(
            lambda p, x: jax.device_put(x, self.sharding(*self.param_spec(p, x)), may_alias=False), tree)

    # ---- slot state ----------------------------------------------------------------------------
    def kv(self, rows: int, *, by_row: bool) -> jax.sharding.Sharding:
        """KV buffers [n, N, S, Hkv, Dh] (n layers of a run): rows along data (slot state only), kv
        heads along tensor, the layer axis unsharded."""
        return self.sharding(None, self._axis("data", rows) if by_row else None, None,
                             self._axis("tensor", self.cfg.num_kv_heads), None)

    def rows(self, rows: int) -> jax.sharding.Sharding:
        """Any per-slot array [B, ...]: slots along data."""
        return self.sharding(self._axis("data", rows))

    def state(self, state):
        """Shardings of a :class:`r3jax.engine.slots.SlotState` (same tree)."""
        b = state.tokens.shape[0]
        tree = jax.tree.map(lambda _: self.rows(b), state)
        kv = self.kv(b, by_row=True)
        return tree.replace(cache=jax.tree.map(lambda _: kv, state.cache))

    def pool(self, pool):
        """Shardings of a prefix-cache ``BlockPool``: KV blocks by kv heads, routes replicated."""
        kv = self.kv(1, by_row=False)
        return pool.replace(k=tuple(kv for _ in pool.k), v=tuple(kv for _ in pool.v), routes=self.replicated)

    def describe(self) -> dict[str, Any]:
        if self.mesh is None:
            return {"devices": 1}
        return {"devices": math.prod(self._sizes.values()), **self._sizes}
