"""Pytrees <-> nested string-keyed dicts, the form orbax stores most plainly (params files, checkpoints).

``nnx.State`` (Param nodes, int layer keys) and optax states (named tuples) flatten to paths; each
path becomes a chain of string keys. Restoring walks a *template* tree of the same structure, so
the on-disk form is independent of Python container types and readable by any orbax user.
"""

from __future__ import annotations

from typing import Any

import jax


def _part(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_keys(path) -> tuple[str, ...]:
    """String keys of one pytree path (``.value`` of an nnx Variable is dropped)."""
    keys = tuple(_part(p) for p in path)
    return keys[:-1] if keys and keys[-1] == "value" and len(keys) > 1 else keys


def to_nested(tree: Any) -> dict:
    """Nested dict of the leaves of ``tree`` keyed by their path's string keys."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = path_keys(path)
        if not keys:
            raise ValueError("to_nested: a bare leaf has no path; wrap it in a dict")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if keys[-1] in node:
            raise ValueError(f"to_nested: two leaves map to the key path {'/'.join(keys)}")
        node[keys[-1]] = leaf
    return out


def from_nested(nested: dict, template: Any) -> Any:
    """Inverse of :func:`to_nested`: ``template``'s structure filled with the leaves of ``nested``.

    Raises KeyError naming the missing key path if ``nested`` lacks a leaf of the template.
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, _ in paths:
        node = nested
        keys = path_keys(path)
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                raise KeyError(f"checkpoint has no entry {'/'.join(keys)}")
            node = node[k]
        leaves.append(node)
    return jax.tree.unflatten(treedef, leaves)


def flatten_nested(tree: Any) -> dict[tuple[str, ...], Any]:
    """``{key path: leaf}`` of a nested dict (or any pytree, e.g. orbax's tree metadata); empty
    subtrees have no leaves and so no entry."""
    return {path_keys(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
