"""Route arrays: compact dtypes (more in issue 4)."""

from __future__ import annotations

import numpy as np


def route_dtype(num_experts: int) -> np.dtype:
    """Smallest dtype holding ids in [0, E): uint8 if E <= 256, int16 if E <= 32768, else int32."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    return np.dtype(np.int32)
