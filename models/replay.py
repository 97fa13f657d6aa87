"""Replay inputs for the model and their host-side validation."""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from models.config import MoeConfig


@struct.dataclass
class Replay:
    """Recorded routes to force. routes [B, T, L, K] any integer dtype (uint8/int16 stay compact;
    the model casts per layer); mask [B, T] bool: True replays that row, False routes live."""

    routes: jax.Array
    mask: jax.Array


def validate_replay(replay: Replay, cfg: MoeConfig, tokens_shape: tuple[int, int]) -> None:
    """Host-side check of a :class:`Replay` against a config and a ``[B, T]`` token shape.

    Raises ValueError naming the field, the value and the expectation. Only rows where mask is True
    are checked for ids in ``[0, E)`` and distinctness (masked-out rows are ignored by the model).
    """
    routes, mask = np.asarray(replay.routes), np.asarray(replay.mask)
    b, t = tokens_shape
    want = (b, t, cfg.num_moe_layers, cfg.top_k)
    if routes.dtype == np.bool_ or not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(f"replay.routes dtype={routes.dtype}: expected an integer dtype")
    if routes.shape != want:
        raise ValueError(f"replay.routes shape={routes.shape}: expected [B, T, L, K] = {want}")
    if mask.dtype != np.bool_:
        raise ValueError(f"replay.mask dtype={mask.dtype}: expected bool")
    if mask.shape != (b, t):
        raise ValueError(f"replay.mask shape={mask.shape}: expected [B, T] = {(b, t)}")
    active = routes[mask].astype(np.int64)  # [R, L, K]
    if active.size == 0:
        return
    bad = (active < 0) | (active >= cfg.num_experts)
    if bad.any():
        value = active[bad][0]
        raise ValueError(f"replay.routes contains expert id {value}: expected ids in "
                         f"[0, num_experts={cfg.num_experts})")
    srt = np.sort(active, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1)  # [R, L]
    if dup.any():
        r, layer = np.argwhere(dup)[0]
        pos = np.argwhere(mask)[r]
        raise ValueError(f"replay.routes has duplicate expert ids {active[r, layer].tolist()} at "
                         f"(batch {pos[0]}, token {pos[1]}, moe layer {layer}): expected K distinct ids")
