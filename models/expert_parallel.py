"""Expert parallelism: the MoE expert kernels under ``jax.shard_map`` on the ambient device mesh.

When a mesh is in context (``jax.set_mesh(mesh)`` outside ``jax.jit``, or
``jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`` inside it, as ``r3jax.train`` does) whose
axes of size > 1 are among the trainer's ``(data, fsdp, expert)`` or the engine's ``(data, tensor,
expert)`` (where ``tensor`` plays fsdp's part: it splits each expert's I), :func:`experts` runs the expert
kernel per device instead of leaving the layer to XLA's partitioner (which, for the dropless
``ragged`` kernel, made every device redo the global token sort and most of the expert work):

- tokens ``[N, D]`` (with their ids and gates) are split over every mesh axis: each device sorts
  and runs only its own ``n = N / devices`` tokens' pairs when experts are not split (``expert``
  and ``fsdp`` of size 1, e.g. a pure data mesh);
- experts ``[E, ...]`` are split over ``expert`` x ``fsdp`` (or, when that does not divide E, over
  ``expert`` with each expert's hidden dim I over ``fsdp``): :func:`expert_weight_spec`, the layout
  ``r3jax.train.partition`` gives them. A device holds ``E_l`` experts (or their I slices);
- exchange: the *tokens* (activations, never weights) are all-gathered over the axes the experts
  are split over, each device runs the kernel on its experts for the (token, slot) pairs routed to
  them (a token's other slots get the out-of-range id ``E_l``, which every kernel in
  :mod:`models.moe` skips: a zero one-hot row, dropped by ``bincount(length=...)``, sorted last,
  outside every ``ragged_dot`` group; a token keeps at most ``min(K, E_l)`` slots, its K ids being
  distinct), and the partial outputs are summed and scattered back to their devices with one
  ``psum_scatter`` over the same axes. Expert weights never move.

Which exchange runs where: this all-gather / ``psum_scatter`` exchange, on every backend.
``jax.lax.ragged_all_to_all`` (sending each pair only to its expert's device) is not used: XLA:CPU
in JAX 0.10.2 does not implement it ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
ThunkEmitter"), so it could not be tested here. Being dropless with static shapes, a device's
buffers hold every token of its exchange group (``n x |exchange|`` tokens,
``x min(K, E_l)`` pairs): that is the worst case a ragged all-to-all must also be sized for.

Routing (router, top-k, replay, gates), the shared experts, the load-balancing loss and the expert
load stay outside, on the global arrays, so they are exactly the one-device values. Without such a
mesh, or when the token count does not divide over the devices (said once, in a ``UserWarning``),
:func:`experts` calls the kernel directly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from models import axes
from models.axes import BATCH_AXES  # tokens are split over all of these (in mesh order)

EXPERT_AXIS, HIDDEN_AXIS = axes.RULES["experts"][0]  # experts [E, ...] split here (and over fsdp too, or I)


def expert_weight_spec(name: str, shape, sizes, role: str = "train") -> tuple:
    """Spec entries of the trailing three dims of an expert weight: gate/up ``[E, D, I]``, down
    ``[E, I, D]`` (leading dims, e.g. a stacked layer dim, are the caller's).

    The trainer's rule of :data:`models.axes.RULES`: E goes on ``expert`` x ``fsdp`` when that divides
    it (fsdp then acts as more expert parallelism: fewer experts, hence fewer routed pairs, per
    device); otherwise E on ``expert`` and I on ``fsdp``, each only where the axis size is > 1 and
    divides the dim. A layout only: whether leaving an axis unused is allowed is decided where the
    weights are placed (:func:`r3jax.train.partition.param_spec`).
    name: "gate_proj" | "up_proj" | "down_proj"; shape: the full shape; sizes: {axis: size}; role:
    "train", or "serve" (the engine's placement: E on ``expert``, I on ``tensor``).
    """
    logical = axes.EXPERT_OUT if name == "down_proj" else axes.EXPERT_IN
    return axes.resolve(logical, tuple(shape[-3:]), dict(sizes), role).spec


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How :func:`experts` splits one layer: tokens over ``batch`` axes, experts over ``expert``
    axes and I over ``hidden`` (empty: not split), tokens exchanged over ``exchange``."""

    mesh: jax.sharding.AbstractMesh
    batch: tuple[str, ...]
    expert: tuple[str, ...]
    hidden: tuple[str, ...]
    role: str = "train"

    @property
    def exchange(self) -> tuple[str, ...]:
        return self.expert + self.hidden


def plan(num_tokens: int, num_experts: int, intermediate: int) -> Plan | None:
    """The :class:`Plan` for the ambient mesh, or None (no mesh, one device, an axis outside
    :data:`BATCH_AXES` (and, on the engine's mesh, ``tensor``) with size > 1, an axis that is not
    ``Auto`` (e.g. already manual inside a caller's shard_map), or ``num_tokens`` not divisible by
    the device count). On the engine's ``(data, tensor, expert)`` mesh the plan follows the engine's
    placement: experts over ``expert``, their I over ``tensor``, tokens over all three."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
        return None
    sizes = dict(mesh.shape)
    # the engine's (data, tensor, expert) mesh: tokens over every axis, I over tensor (as fsdp in training)
    role = "serve" if "tensor" in sizes else "train"
    token_axes = BATCH_AXES + (("tensor",) if role == "serve" else ())
    if math.prod(sizes.values()) == 1 or any(n > 1 for a, n in sizes.items() if a not in token_axes):
        return None
    batch = tuple(a for a in mesh.axis_names if a in token_axes)
    n = math.prod(sizes[a] for a in batch)
    if num_tokens % n:
        from models.attention import warn_fallback

        warn_fallback(("expert_parallel", num_tokens, n),
                      f"expert parallelism off for this call: {num_tokens} tokens do not divide over the {n} devices "
                      f"of {'x'.join(batch)}; XLA partitions the expert kernel instead")
        return None
    spec = expert_weight_spec("gate_proj", (num_experts, 1, intermediate), sizes, role)
    return Plan(mesh, batch, _axes(spec[0]), _axes(spec[2]), role)


def experts(kernel, x, ids, weights, gate, up, down, *, exchange_tokens: int | None = None):
    """``kernel(x, ids, weights, gate, up, down)`` (a :mod:`models.moe` kernel), expert-parallel on
    the ambient mesh when :func:`plan` finds one. x [N, D]; ids/weights [N, K]; gate/up [E, D, I];
    down [E, I, D] -> [N, D]. ``exchange_tokens``: most tokens a device gathers per exchange
    (:func:`exchange_chunks`); None gathers all of them at once."""
    p = plan(x.shape[0], gate.shape[0], gate.shape[2])
    if p is None:
        return kernel(x, ids, weights, gate, up, down)
    tok = P(p.batch, None)
    # each weight's spec from its own shape: down's I is its dim 1, and may divide where D does not
    wspec = lambda name, w: P(*expert_weight_spec(name, w.shape, dict(p.mesh.shape), p.role))
    body = lambda *a: _local(kernel, p, *a, exchange_tokens=exchange_tokens)
    return jax.shard_map(body, mesh=p.mesh, in_specs=(tok, tok, tok, wspec("gate_proj", gate),
                                                      wspec("up_proj", up), wspec("down_proj", down)),
                         out_specs=tok)(x, ids, weights, gate, up, down)


def exchange_chunks(n: int, group: int, exchange_tokens: int | None) -> int:
    """How many chunks a device's ``n`` tokens go through the exchange in: the fewest dividing ``n``
    whose gathered size ``n / chunks * group`` is at most ``exchange_tokens`` (``n`` when none is)."""
    if exchange_tokens is None or n * group <= exchange_tokens:
        return 1
    for c in range(2, n + 1):
        if n % c == 0 and (n // c) * group <= exchange_tokens:
            return c
    return n


def _local(kernel, p: Plan, x, ids, weights, gate, up, down, *, exchange_tokens: int | None = None):
    """One device: x/ids/weights [n, ...] its tokens; gate/up [E_l, D, I_l], down [E_l, I_l, D]
    its expert slices. Returns its tokens' outputs [n, D].

    The exchange holds every token of the group (``n x |exchange|``): at 8192 tokens per device and a
    group of 128 that is a million tokens per layer. So the device's tokens go through it in chunks
    (:func:`exchange_chunks`), each under ``jax.checkpoint`` so the backward pass keeps only the
    chunk's inputs; every token's output is the same as in one exchange."""
    if not p.exchange:
        return kernel(x, ids, weights, gate, up, down)
    group = math.prod(p.mesh.shape[a] for a in p.exchange)
    chunks = exchange_chunks(x.shape[0], group, exchange_tokens)
    if chunks == 1:
        return _exchange(kernel, p, x, ids, weights, gate, up, down)
    split = lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])
    one = jax.checkpoint(lambda c: _exchange(kernel, p, *c, gate, up, down))
    return jax.lax.map(one, (split(x), split(ids), split(weights))).reshape(x.shape)


def _exchange(kernel, p: Plan, x, ids, weights, gate, up, down):
    """All-gather ``x`` [n, D] (ids, weights [n, K]) over the exchange axes, run my experts on them,
    sum and scatter the partial outputs back: [n, D]."""
    gather = lambda a: jax.lax.all_gather(a, p.exchange, axis=0, tiled=True)
    x, ids, weights = gather(x), gather(ids), gather(weights)  # [M, ...], M = n * |exchange|
    if p.expert:
        local = gate.shape[0]
        first = jax.lax.axis_index(p.expert) * local
        mine = (ids >= first) & (ids < first + local)
        ids = jnp.where(mine, ids - first, local)  # `local`: out of range, skipped by the kernel
        if local < ids.shape[1]:  # K distinct ids: at most `local` of a token's slots are mine
            keep = jnp.argsort(~mine, axis=1, stable=True)[:, :local]
            ids, weights = (jnp.take_along_axis(a, keep, axis=1) for a in (ids, weights))
    partial = kernel(x, ids, weights, gate, up, down)  # [M, D]: my experts' (my I slice's) share
    return jax.lax.psum_scatter(partial, p.exchange, scatter_dimension=0, tiled=True)
