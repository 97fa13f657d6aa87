"""Replay inputs for the model and their host-side validation."""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from models.config import MoeConfig
from models.fields import FieldError, check_route_ids


@struct.dataclass
class Replay:
    """Recorded routes to force. routes [B, T, L, K] any integer dtype (uint8/int16 stay compact;
    the model casts per layer); mask [B, T] bool: True replays that row, False routes live."""

    routes: jax.Array
    mask: jax.Array


def validate_replay(replay: Replay, cfg: MoeConfig, tokens_shape: tuple[int, int]) -> None:
    """Host-side check of a :class:`Replay` against a config and a ``[B, T]`` token shape.

    Raises :class:`models.fields.FieldError` (a ValueError) naming the field, the value and the
    expectation. Ids (integer dtype, in ``[0, E)``, distinct per (token, layer)) are checked by
    :func:`models.fields.check_route_ids` on rows where mask is True only (the model ignores the rest).
    """
    routes, mask = np.asarray(replay.routes), np.asarray(replay.mask)
    b, t = tokens_shape
    want = (b, t, cfg.num_moe_layers, cfg.top_k)
    if routes.shape != want:
        raise FieldError("replay.routes", routes.shape, f"[B, T, L, K] = {want}",
                         f"replay.routes shape={routes.shape}: expected [B, T, L, K] = {want}")
    if mask.dtype != np.bool_:
        raise FieldError("replay.mask", str(mask.dtype), "bool", f"replay.mask dtype={mask.dtype}: expected bool")
    if mask.shape != (b, t):
        raise FieldError("replay.mask", mask.shape, f"[B, T] = {(b, t)}",
                         f"replay.mask shape={mask.shape}: expected [B, T] = {(b, t)}")
    ids = routes
    if np.issubdtype(routes.dtype, np.integer):  # bool/float keep their dtype and are refused below
        fill = np.arange(cfg.top_k, dtype=routes.dtype)  # valid, distinct: masked-out rows pass
        ids = np.where(mask[:, :, None, None], routes, fill)
    check_route_ids(ids, cfg.num_experts, "replay.routes")
