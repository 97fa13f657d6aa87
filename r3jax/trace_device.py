"""Fixed-capacity routes trace for device-side loops: a ``[C, L, K]`` buffer plus a length.

Same semantics as :class:`r3jax.trace.RoutedExpertTrace`, with shapes fixed so it can be a
``lax.while_loop`` carry or a jitted step's donated argument. Python cannot raise inside jit, so a
refused ``record`` leaves buffer and length unchanged (as the host trace stays unchanged when it
raises) and sets a bit in ``errors``; :func:`check` and :func:`to_host` turn the bits into
ValueErrors with the host messages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from r3jax.routes import route_dtype
from r3jax.trace import _MISSING

PROMPT_BEFORE_START = 1  # prompt_len < prompt_start
NO_GENERATED = 2  # generated_len < 1
CHUNK_TOO_SHORT = 4  # the chunk buffer holds fewer than P - s + G - 1 rows
OVERFLOW = 8  # prompt_start + rows > capacity
_MESSAGES = {
    PROMPT_BEFORE_START: "prompt_len < prompt_start in a record",
    NO_GENERATED: "generated_len < 1 in a record",
    CHUNK_TOO_SHORT: "a record's routes had fewer rows than prompt_len - prompt_start + generated_len - 1",
    OVERFLOW: "a record would pass the trace capacity",
}


@struct.dataclass
class DeviceRouteTrace:
    """routes [C, L, K] in ``route_dtype(E)``; length [] int32 (= prompt_start, rows captured);
    errors [] int32 bitmask of refused records (0 when all were accepted)."""

    routes: jax.Array
    length: jax.Array
    errors: jax.Array
    moe_layer_ids: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def init(cls, capacity: int, num_layers: int, top_k: int, num_experts: int,
             moe_layer_ids=None) -> "DeviceRouteTrace":
        dims = {"capacity": capacity, "num_layers": num_layers, "top_k": top_k, "num_experts": num_experts}
        for name, v in dims.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an int >= 1")
        ids = None if moe_layer_ids is None else tuple(int(v) for v in moe_layer_ids)
        if ids is not None and len(ids) != num_layers:
            raise ValueError(f"moe_layer_ids={list(ids)}: expected L = num_layers = {num_layers} ids")
        routes = jnp.zeros((capacity, num_layers, top_k), route_dtype(num_experts))
        zero = jnp.zeros((), jnp.int32)
        return cls(routes=routes, length=zero, errors=zero, moe_layer_ids=ids)

    @property
    def capacity(self) -> int:
        return self.routes.shape[0]

    @property
    def prompt_start(self) -> jax.Array:
        return self.length


def record(trace: DeviceRouteTrace, prompt_len, generated_len, routes: jax.Array) -> DeviceRouteTrace:
    """Append one engine call: the first ``P - s + G - 1`` rows of ``routes [T, L, K]`` (the rest of
    the chunk buffer is ignored). P and G may be traced scalars; T is static.

    Written with a dropping scatter rather than ``dynamic_update_slice``: the latter clamps its start
    so that a chunk running past capacity would overwrite earlier rows instead of failing.
    """
    cap, t = trace.routes.shape[0], routes.shape[0]
    s = trace.length
    p = jnp.asarray(prompt_len, jnp.int32)
    g = jnp.asarray(generated_len, jnp.int32)
    want = p - s + g - 1
    err = (jnp.where(p < s, PROMPT_BEFORE_START, 0) | jnp.where(g < 1, NO_GENERATED, 0)
           | jnp.where(want > t, CHUNK_TOO_SHORT, 0) | jnp.where(s + want > cap, OVERFLOW, 0))
    n = jnp.where(err == 0, want, 0)  # a refused record writes nothing
    j = jnp.arange(t, dtype=jnp.int32)
    idx = jnp.where(j < n, s + j, cap)  # index cap is out of bounds: dropped
    buf = trace.routes.at[idx].set(routes.astype(trace.routes.dtype), mode="drop")
    return trace.replace(routes=buf, length=s + n, errors=trace.errors | err)


def finalize(trace: DeviceRouteTrace, token_count, loss_mask: jax.Array):
    """Jit-friendly finalize over the whole capacity.

    loss_mask [C] (entries at i >= token_count ignored). Returns ``(routes [C, L, K], captured [C]
    bool, bad [] int32)``: rows >= prompt_start are ``0..K-1`` and not captured; ``bad`` is the first
    loss-active target ``prompt_start < i < token_count`` (the §4 violation), or -1.
    """
    cap, _, k = trace.routes.shape
    i = jnp.arange(cap, dtype=jnp.int32)
    n = jnp.asarray(token_count, jnp.int32)
    captured = i < jnp.minimum(trace.length, n)
    fill = jnp.broadcast_to(jnp.arange(k, dtype=trace.routes.dtype), trace.routes.shape)
    routes = jnp.where(captured[:, None, None], trace.routes, fill)
    late = (loss_mask != 0) & (i > trace.length) & (i < n)
    bad = jnp.where(jnp.any(late), jnp.argmax(late), -1).astype(jnp.int32)
    return routes, captured, bad


_finalize = jax.jit(finalize)


def check(trace: DeviceRouteTrace) -> None:
    """Host-side: raise ValueError naming every refused-record condition in ``trace.errors``."""
    bits = int(trace.errors)
    if bits:
        names = [msg for bit, msg in _MESSAGES.items() if bits & bit]
        raise ValueError(f"DeviceRouteTrace.errors={bits}: refused record(s): {'; '.join(names)} "
                         f"(capacity={trace.capacity}, prompt_start={int(trace.length)})")


def to_host(trace: DeviceRouteTrace, *, token_count: int, loss_mask) -> tuple[np.ndarray, np.ndarray]:
    """Host-side finalize with the host trace's checks: ``(routes [N, L, K], captured [N] bool)``."""
    check(trace)
    s = int(trace.length)
    if isinstance(token_count, bool) or not isinstance(token_count, (int, np.integer)) or token_count < s:
        raise ValueError(f"token_count={token_count!r}: expected an int >= prompt_start={s}")
    if token_count > trace.capacity:
        raise ValueError(f"token_count={token_count}: expected <= capacity={trace.capacity}")
    mask = np.asarray(loss_mask)
    if mask.shape != (token_count,):
        raise ValueError(f"loss_mask shape={mask.shape}: expected [N] = ({token_count},)")
    padded = np.zeros((trace.capacity,), np.float32)
    padded[:token_count] = mask
    routes, captured, bad = _finalize(trace, token_count, jnp.asarray(padded))
    if int(bad) >= 0:
        raise ValueError(f"{_MISSING} {int(bad)}: rows exist for tokens [0, {s}) (prompt_start={s}); "
                         f"a loss-active target must be at index <= prompt_start")
    return np.asarray(routes)[:token_count], np.asarray(captured)[:token_count]
