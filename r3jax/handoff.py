"""Hand-off of replay routes to MaxText/Tunix trainers: r3jax's ``(routes, route_mask)`` and
MaxText's ``forced_routed_experts`` layout, both ways.

MaxText (``RoutedMoE.get_topk`` with ``forced_routed_experts``, AI-Hypercomputer/maxtext commit
8c3ce92b "Support inserting and replaying router expert decisions in trainer"; Tunix carries the
same array from its vLLM sampler, ``UNSET_ROUTED_EXPERT = -1``) takes int32 ``[B, S, L, K]`` where L
counts MoE layers in model order (the decoder slices ``[:, :, moe_layer_index, :]``), and a row
whose first id is -1 marks a token without a recorded route. Note what MaxText does with such a
row: it zeroes that token's top-k weights (the MoE block adds nothing for it) and routes it to dummy
experts for load balance; it does not route it live. That is right for padding and for rows after
the last loss-active target (docs/design.md §4: no loss-active target sees them); see docs/peers.md.

r3jax (docs/design.md §3): ``routes [B, S, L, K]`` in ``route_dtype(E)`` and ``route_mask [B, S]`` bool,
False rows ignored (filled with ``0..K-1``). Here a False row becomes all -1 (every id, not only
the first: a partly -1 row would index expert E - 1 in MaxText's gather) and back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3jax.checks import FieldError, check_int, check_route_ids
from r3jax.routes import route_dtype, uncaptured_rows

UNSET = -1  # MaxText/Tunix sentinel: no recorded route for this token


def _xp(*arrays: Any):
    """numpy for host arrays; jax.numpy when any input is a jax.Array (stays on device)."""
    if any(type(a).__module__.startswith(("jax", "jaxlib")) for a in arrays):
        import jax.numpy as jnp
        return jnp
    return np


def to_maxtext(routes: Any, route_mask: Any) -> Any:
    """``routes [B, S, L, K]`` (any integer dtype) and ``route_mask [B, S]`` bool → MaxText's
    ``forced_routed_experts``: int32 ``[B, S, L, K]``, -1 in every slot of a False row.

    Works on numpy and on jax arrays (jit-friendly: shapes and dtypes are checked, ids are not,
    as they were checked where they entered r3jax)."""
    xp = _xp(routes, route_mask)
    if routes.ndim != 4:
        raise FieldError("routes.shape", tuple(routes.shape), "4 dims [B, S, L, K]")
    if tuple(route_mask.shape) != tuple(routes.shape[:2]):
        raise FieldError("route_mask.shape", tuple(route_mask.shape), f"[B, S] = {tuple(routes.shape[:2])}")
    if routes.dtype == np.bool_ or not np.issubdtype(routes.dtype, np.integer):
        raise FieldError("routes.dtype", str(routes.dtype), "an integer dtype (not bool or float)")
    if route_mask.dtype != np.bool_:
        raise FieldError("route_mask.dtype", str(route_mask.dtype), "bool")
    return xp.where(route_mask[:, :, None, None], routes.astype(xp.int32), xp.int32(UNSET))


def batch_to_maxtext(batch: Any) -> Any:
    """:func:`to_maxtext` of a :class:`r3jax.batch.Batch` (its ``routes`` and ``route_mask``)."""
    return to_maxtext(batch.routes, batch.route_mask)


def from_maxtext(forced: Any, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """MaxText's ``forced_routed_experts [B, S, L, K]`` → ``(routes in route_dtype(E), route_mask)``.

    A row is replayed (mask True) when none of its ids is -1; a row of all -1 is unset (mask False,
    filled with ``0..K-1``). A row mixing -1 with ids, another negative id, an id >= E or a repeated
    id within one (token, layer) is refused, naming where it is. Host-side (routes enter r3jax here)."""
    check_int("num_experts", num_experts, 1)
    forced = np.asarray(forced)
    if forced.ndim != 4:
        raise FieldError("forced_routed_experts.shape", forced.shape, "4 dims [B, S, L, K]")
    if forced.dtype == np.bool_ or not np.issubdtype(forced.dtype, np.integer):
        raise FieldError("forced_routed_experts.dtype", str(forced.dtype), "an integer dtype (not bool or float)")
    unset = forced == UNSET
    mask = ~unset.any(axis=(2, 3))
    partial = unset.any(axis=(2, 3)) & ~unset.all(axis=(2, 3))
    if partial.any():
        b, s = (int(i) for i in np.argwhere(partial)[0])
        raise FieldError("forced_routed_experts", forced[b, s].tolist(),
                         "each [L, K] row either all -1 (unset) or all expert ids",
                         f"forced_routed_experts (trajectory {b}, token {s}) mixes -1 with expert ids: "
                         f"expected each [L, K] row all -1 (unset) or all expert ids")
    check_route_ids(_replayed(forced, mask), num_experts, "forced_routed_experts")
    b, s, num_layers, top_k = forced.shape
    dtype = route_dtype(num_experts)
    fill = uncaptured_rows(b * s, num_layers, top_k, dtype).reshape(forced.shape)
    routes = np.where(mask[:, :, None, None], forced, fill).astype(dtype)
    return routes, mask


def _replayed(forced: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The rows to validate, keeping the [B, S, L, K] layout (unset rows replaced by 0..K-1) so a
    refusal names trajectory and token."""
    fill = np.broadcast_to(np.arange(forced.shape[-1], dtype=np.int64), forced.shape)
    return np.where(mask[:, :, None, None], forced.astype(np.int64), fill)
