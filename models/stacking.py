"""The two layouts of the decoder layers' variables, and the maps between them.

- **Scanned** (``MoeConfig.scan_layers=True``, the default): each run of identical layers is one module
  whose variables carry a leading layer axis, ``dense_layers`` (global layers ``0 .. first_dense_layers - 1``,
  ``[n_dense, ...]``) and ``moe_layers`` (the MoE layers, in ``moe_layer_ids`` order, ``[L, ...]``). A run
  with no layers is absent. The KV cache follows the same groups (models/cache.py).
- **Unrolled** (``scan_layers=False``): ``layers/{i}`` per global layer i (for debugging).

Both layouts of one seed hold the same numbers (the model draws its layers in the same order), and
:func:`stack_layers` / :func:`unstack_layers` convert a nested dict (``nnx.to_pure_dict`` of a state,
gradients, a Hugging Face tensor map) from one to the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from models.config import MoeConfig

GROUPS = ("dense_layers", "moe_layers")  # the stacked modules' attribute names, in model order


def layer_groups(cfg: MoeConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The non-empty runs of identical layers: ``((name, global layer ids), ...)`` in model order."""
    runs = (("dense_layers", tuple(range(cfg.first_dense_layers))), ("moe_layers", cfg.moe_layer_ids))
    return tuple((name, ids) for name, ids in runs if ids)


def path_names(path) -> tuple[str, ...]:
    """The names along a pytree path (``jax.tree_util`` keys, or plain strings and ints), without the
    ``value`` entry NNX variables add: ``("moe_layers", "mlp", "gate_proj")``. The one path-name
    helper of partition rules and per-matrix transforms."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                entry = getattr(entry, attr)
                break
        names.append(str(entry))
    return tuple(n for n in names if n != "value")


def is_stacked(path) -> bool:
    """Whether the pytree path (``jax.tree_util`` keys, or plain strings) lies in a stacked group, so its
    leaf has a leading layer axis that partition rules and per-matrix transforms must leave alone."""
    return any(n in GROUPS for n in path_names(path))


def _layer_entry(layers: Mapping, i: int):
    if i in layers:
        return layers[i]
    if str(i) in layers:  # string-keyed nested dicts (r3jax.tree_io)
        return layers[str(i)]
    raise KeyError(f"layers has no entry for layer {i}: expected the unrolled layout (layers/{{i}})")


def stack_layers(tree: Mapping, cfg: MoeConfig, *, stack=jnp.stack) -> dict:
    """Unrolled nested dict (``layers/{i}/...``) -> scanned (``dense_layers``/``moe_layers`` with a
    leading layer axis). Other top-level entries are kept as they are. ``stack``: ``np.stack`` keeps
    host arrays on the host (a checkpoint read for a weight push)."""
    if "layers" not in tree:
        raise KeyError("tree has no 'layers' entry: expected the unrolled layout (layers/{i})")
    out = {k: v for k, v in tree.items() if k != "layers"}
    for name, ids in layer_groups(cfg):
        out[name] = jax.tree.map(lambda *xs: stack(xs), *[_layer_entry(tree["layers"], i) for i in ids])
    return out


def unstack_layers(tree: Mapping, cfg: MoeConfig) -> dict:
    """Scanned nested dict -> unrolled (``layers/{i}``, int keys); inverse of :func:`stack_layers`."""
    missing = [name for name, _ in layer_groups(cfg) if name not in tree]
    if missing:
        raise KeyError(f"tree has no {missing} entries: expected the scanned layout {GROUPS}")
    out = {k: v for k, v in tree.items() if k not in GROUPS}
    out["layers"] = {}
    for name, ids in layer_groups(cfg):
        for j, i in enumerate(ids):
            out["layers"][i] = jax.tree.map(lambda x, j=j: x[j], tree[name])
    out["layers"] = dict(sorted(out["layers"].items()))
    return out


def layer(tree: Mapping, cfg: MoeConfig, i: int) -> Any:
    """The subtree of global layer ``i`` in either layout (an ``nnx.State`` or a nested dict; in the
    scanned layout each leaf is sliced at the layer's index in its group)."""
    if "layers" in tree:
        return _layer_entry(tree["layers"], i)
    for name, ids in layer_groups(cfg):
        if i in ids:
            return jax.tree.map(lambda x: x[ids.index(i)], tree[name])
    raise ValueError(f"layer={i}: expected a layer id in [0, num_layers={cfg.num_layers})")


def to_layout(tree: Mapping, cfg: MoeConfig, scan_layers: bool) -> dict:
    """``tree`` in the scanned (``scan_layers=True``) or unrolled layout, converting when it is in the other."""
    if scan_layers:
        return stack_layers(tree, cfg) if "layers" in tree else dict(tree)
    return dict(tree) if "layers" in tree else unstack_layers(tree, cfg)
