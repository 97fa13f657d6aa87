"""Where the engine's arrays live: parameters and the page pool on a ``(data, tensor, expert)`` mesh.

The rules are the serving role of the one logical-axis table (:mod:`models.axes`, the trainer's
:mod:`r3jax.train.partition` uses the same table on its ``(data, fsdp, expert)`` mesh):

- experts ``[E, ...]`` along ``expert``; their hidden dim ``I`` along ``tensor``;
- attention projections by whole heads along ``tensor`` (q/k/v output dim, o input dim); dense MLP
  hidden dim along ``tensor``; embedding and LM head by vocabulary along ``tensor``; norms and the
  router replicated;
- the page pool's kv heads along ``tensor`` (its pages whole: any step may read any page), as the
  cache declares them through its logical axes (:func:`models.cache.cache_layout`), so the engine has
  no per-model case; a mesh axis its rows ask for (data; tensor too for MLA's latent pool) would
  replicate the whole pool (:meth:`Placement.kv`);
- the leading layer axis of stacked (scanned) layers and of the KV cache is never sharded.

An axis the mesh lacks counts as size 1. A mesh axis that cannot split the dim it is meant for (2 kv
heads on tensor = 8) raises :class:`models.axes.ReplicationError` naming the multiplier, unless the
engine was built with ``allow_replication=True`` (then it warns once). Without a mesh everything
lives on one device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from models import axes
from models.cache import cache_layout
from r3jax.sharding import place_copy

AXES = axes.MESH_AXES["serve"]


def make_mesh(data: int = -1, tensor: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A ``(data, tensor, expert)`` serving mesh (Auto axes). One size may be -1 (default: data): it
    takes the devices left over (:func:`models.axes.make_mesh`, the serving role)."""
    return axes.make_mesh("serve", {"data": data, "tensor": tensor, "expert": expert}, devices)


class Placement:
    """Shardings of the engine's arrays on ``mesh`` (or on one device when mesh is None).

    allow_replication: accept (with one warning each) arrays that a mesh axis cannot split and that
    would be replicated over it; by default that raises :class:`models.axes.ReplicationError`."""

    def __init__(self, mesh: Mesh | None, cfg, *, allow_replication: bool = False):
        if mesh is not None:
            if not isinstance(mesh, Mesh):
                raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh")
            if any(t == AxisType.Explicit for t in mesh.axis_types):
                raise ValueError(f"mesh.axis_types={mesh.axis_types}: expected Auto axes (the model relies "
                                 "on compiler-propagated sharding)")
        self.mesh, self.cfg, self.allow_replication = mesh, cfg, bool(allow_replication)
        self._sizes = {} if mesh is None else axes.mesh_sizes(mesh)
        self._units = axes.head_units(cfg)
        self._cache = cache_layout(cfg)
        self._batch = self._cache.batch_axis  # the rows' logical axis: "batch", or "attn_batch" (DP attention)
        self._warned: set[str] = set()  # replication accepted by allow_replication: warned once each
        self.device = jax.devices()[0] if mesh is None else None

    def size(self, axis: str) -> int:
        return int(self._sizes.get(axis, 1))

    def _spec(self, what: str, logical, shape, *, notes: list | None = None) -> tuple:
        """Spec entries of one array (:func:`models.axes.resolve`)."""
        layout = axes.resolve(logical, shape, self._sizes, "serve", self._units)
        mine = [] if notes is None else notes
        out = axes.check_layout(what, logical, shape, self._sizes, layout, units=self._units,
                                allow_replication=self.allow_replication, notes=mine)
        if notes is None:
            self._warn(mine)
        return out

    def _warn(self, notes: list) -> None:
        new = [n for n in notes if n not in self._warned]
        self._warned.update(new)
        axes.warn_replication(new, stacklevel=4)

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
    def param_spec(self, path, leaf, notes: list | None = None) -> tuple:
        """The spec of one parameter, from its logical axes (:func:`models.axes.param_axes`; stacked
        layers keep their leading layer axis unsharded)."""
        return self._spec(axes.leaf_name(path), axes.param_axes(path, leaf), tuple(leaf.shape), notes=notes)

    def param_shardings(self, tree):
        """The sharding of every parameter of ``tree`` (same structure; an ``nnx.State``'s variables
        hold them)."""
        is_var = lambda x: isinstance(x, nnx.Variable)
        notes: list[str] = []

        def one(path, x):
            sh = self.sharding(*self.param_spec(path, x, notes))
            return x.replace(sh) if is_var(x) else sh

        out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_var)
        self._warn(notes)
        return out

    def params(self, tree, like=None):
        """Own copies of the parameter arrays (never views of the caller's, which a donated train step
        may delete), placed by :meth:`param_spec` (or like ``like``'s leaves)."""
        if like is not None:
            shardings = jax.tree.map(lambda old: old.sharding, like)
        else:
            shardings = self.param_shardings(tree)
        return place_copy(tree, shardings)

    def replace(self, old, new, chunk_fraction: float = 0.1):
        """``new`` placed like ``old`` (same structure, each leaf on its old leaf's sharding), the old
        leaves deleted chunk by chunk as the new ones arrive: chunks of at most ``chunk_fraction`` of
        the tree's bytes (or one leaf, if larger), so the two copies coexist for one chunk only and
        peak memory stays near one copy (a whole copy first would double it). ``old`` is unusable
        afterwards; computations already dispatched with it finish (their buffers are held until then)."""
        olds, treedef = jax.tree.flatten(old)
        news = jax.tree.leaves(new)
        limit = chunk_fraction * sum(x.nbytes for x in olds)
        chunks, size = [[]], 0
        for i, x in enumerate(olds):
            if chunks[-1] and size + x.nbytes > limit:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += x.nbytes
        out = list(olds)
        for chunk in chunks:
            placed = place_copy([news[i] for i in chunk], [olds[i].sharding for i in chunk])
            for i, y in zip(chunk, placed):
                if not olds[i].is_deleted():  # (a swap that failed midway deleted some already)
                    olds[i].delete()
                out[i] = y
        return jax.tree.unflatten(treedef, out)

    # ---- page pool -----------------------------------------------------------------------------
    def kv(self) -> jax.sharding.Sharding:
        """The page pool's buffers [n, P, ps, Hc, Dc] (n layers of a run; :func:`models.paged.pool_shapes`),
        by their logical axes (:func:`models.cache.cache_layout`): kv heads along ``tensor``; the layer
        axis never split. A combined GQA pool holds 2 * Hkv heads interleaved (k, v of head h side by
        side), so a split of Hkv whole heads keeps each pair on one device; MLA's two latent pools
        differ only in Dc.

        The pages dim has the rows' logical axis (``batch``: data; MLA's ``attn_batch``: data and
        tensor), but one engine never splits it: any step may read any page. So a mesh axis the rows
        ask for (data > 1; tensor > 1 for a latent pool, which has no head axis to split) would leave
        the whole pool on every device along it: :class:`models.axes.ReplicationError` naming the
        axis and the multiplier, or one warning with ``allow_replication``. Data parallelism is
        :class:`r3jax.engine.group.EngineGroup`'s: one engine, and one pool, per data shard."""
        table = axes.rules("serve")
        logical = tuple(None if a == self._batch else a for a in self._cache.axes)
        shape = (1, 1, 1) + self._cache.k  # n, P, ps never split
        spec = self._spec("KV cache", logical, shape)
        used = {m for entry in spec if entry for m in ((entry,) if isinstance(entry, str) else entry)}
        rows = [m for m in table[self._batch] if self.size(m) > 1 and m not in used]
        if rows:
            mult = math.prod(self.size(m) for m in rows)
            what = "MLA latent page pool" if self._batch == "attn_batch" else "page pool"
            sizes = ", ".join(f"{m}={self.size(m)}" for m in rows)
            msg = (f"KV cache: the {what} (logical axes {self._cache.axes}) is whole on every device of one "
                   f"engine (any step may read any page), so {sizes} would replicate it {mult}x")
            if not self.allow_replication:
                raise axes.ReplicationError(
                    "KV cache", dict(self._sizes), f"{' and '.join(rows)} of size 1 in one engine",
                    f"{msg}: expected {' and '.join(m + '=1' for m in rows)} (data parallelism: "
                    "EngineGroup(data=D), the server's --data-parallel-size, one pool per engine core), "
                    "or allow_replication=True to accept the replication")
            self._warn([msg])
        return self.sharding(*spec)

    def describe(self) -> dict[str, Any]:
        if self.mesh is None:
            return {"devices": 1}
        return {"devices": math.prod(self._sizes.values()), **self._sizes}
