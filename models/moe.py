"""The MoE feed-forward block: a router (models/routers.py), top-k (live or replayed), the expert
kernels, and optional always-on shared experts.

Replay forces the *choice* of experts only; the gate weights are always the live router
scores gathered at the chosen experts, so gradients still reach the router.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import axes, expert_parallel, routers
from models.config import MoeConfig
from models.layers import DenseMLP

_init = nnx.initializers.normal(stddev=0.02)


def load_balancing_loss(probs, ids, token_mask):
    """Switch-style auxiliary loss ``E * sum_e f_e * P_e`` over tokens where token_mask is True.

    probs [N, E] f32, ids [N, K] int32, token_mask [N] bool. f_e is the fraction of (token, slot)
    assignments to expert e, P_e the mean router probability of e.
    """
    num_experts = probs.shape[-1]
    m = token_mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(m), 1.0)
    assign = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=1)  # [N, E]
    f = jnp.sum(assign * m[:, None], axis=0) / (count * ids.shape[-1])
    p = jnp.sum(probs * m[:, None], axis=0) / count
    return num_experts * jnp.sum(f * p)


def experts_dense(x, ids, weights, gate, up, down):
    """Reference kernel: every expert on every token, combined with one-hot gate weights.

    x [N, D], ids/weights [N, K], gate/up [E, D, I], down [E, I, D] -> [N, D]. E times the work.
    """
    h = jax.nn.silu(jnp.einsum("nd,edi->nei", x, gate)) * jnp.einsum("nd,edi->nei", x, up)
    out = jnp.einsum("nei,eid->ned", h, down)
    combine = jnp.sum(jax.nn.one_hot(ids, gate.shape[0], dtype=weights.dtype) * weights[..., None], 1)
    return jnp.einsum("ne,ned->nd", combine.astype(x.dtype), out)


def experts_loop(x, ids, weights, gate, up, down):
    """Decode kernel: loop over the experts, skipping (``lax.cond``) every expert no token chose.

    Same contract as :func:`experts_dense`. A chosen expert runs over all N tokens, scaled by its
    combine weight (0 for tokens that did not choose it), so only chosen experts' weights are read:
    the cheap kernel for small N (decode), where most experts go unchosen. When every expert is
    chosen it does the dense kernel's work, as plain per-expert matmuls.
    """
    num_experts = gate.shape[0]
    onehot = jax.nn.one_hot(ids, num_experts, dtype=weights.dtype)  # [N, K, E]
    combine = jnp.sum(onehot * weights[..., None], axis=1).astype(x.dtype)  # [N, E]
    chosen = jnp.any(onehot > 0, axis=(0, 1))  # [E]

    def expert(e, acc):
        def run(acc):
            h = jax.nn.silu(x @ gate[e]) * (x @ up[e])
            return acc + (h @ down[e]) * combine[:, e, None]

        return jax.lax.cond(chosen[e], run, lambda a: a, acc)

    return jax.lax.fori_loop(0, num_experts, expert, jnp.zeros_like(x))


def experts_gather(x, ids, weights, gate, up, down):
    """Decode kernel: each chosen expert runs on only the tokens that chose it.

    Same contract as :func:`experts_dense`. The (token, slot) pairs are sorted by expert; expert e's
    c_e tokens are gathered into a buffer of the smallest capacity >= c_e among N/8, N/4, N/2, N
    (powers of two; one ``lax.switch`` branch each, so shapes stay static), run, scaled by their gate
    weight and added back; experts no token chose are skipped. Work is at most about
    sum_e max(N/8, 2 c_e) token rows, against N per chosen expert for :func:`experts_loop`.
    """
    n, k = ids.shape
    num_experts = gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok_sorted = order // k  # [N*K] token of each expert-sorted pair
    w_sorted = weights.reshape(-1)[order].astype(x.dtype)
    counts = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    top = 1 << max(n - 1, 0).bit_length()  # capacities top/8, top/4, top/2, top >= N: 4 branches at most
    caps = sorted({max(top >> i, 1) for i in range(4)})

    def run(cap, e, acc):
        j = jnp.arange(cap)
        valid = j < counts[e]
        pair = jnp.minimum(starts[e] + j, n * k - 1)
        toks = tok_sorted[pair]
        xe = x[toks]
        h = jax.nn.silu(xe @ gate[e]) * (xe @ up[e])
        return acc.at[toks].add((h @ down[e]) * jnp.where(valid, w_sorted[pair], 0)[:, None])

    branches = [lambda e, acc: acc] + [lambda e, acc, c=c: run(c, e, acc) for c in caps]

    def expert(e, acc):
        c = counts[e]
        branch = jnp.where(c > 0, 1 + jnp.sum(jnp.asarray(caps) < c), 0)
        return jax.lax.switch(branch, branches, e, acc)

    return jax.lax.fori_loop(0, num_experts, expert, jnp.zeros_like(x))


def experts_ragged(x, ids, weights, gate, up, down):
    """Dropless kernel: sort (token, slot) pairs by expert and run grouped matmuls.

    Same contract as :func:`experts_dense`. Uses ``jax.lax.ragged_dot`` with ``bincount`` group sizes.
    """
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]  # [N*K, D]
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    out = jax.lax.ragged_dot(h, down, sizes)  # [N*K, D], expert-sorted
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    return jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)


class MoeBlock(nnx.Module):
    """Router + experts (+ shared experts). Parameters: router [D, E], gate/up [E, D, I],
    down [E, I, D]; ``shared`` (a SwiGLU MLP of ``num_shared_experts * I``) when
    ``num_shared_experts > 0``; ``router_bias`` [E] (:class:`models.routers.RouterBias`, not a
    Param) for the ``sigmoid_bias_grouped`` router."""

    def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
        d, e, i, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.param_dtype
        self.cfg = cfg
        self.router = nnx.Param(_init(rngs.params(), (d, e), pd), logical_axes=("embed", "expert_logits"))
        self.gate_proj = nnx.Param(_init(rngs.params(), (e, d, i), pd), logical_axes=axes.EXPERT_IN)
        self.up_proj = nnx.Param(_init(rngs.params(), (e, d, i), pd), logical_axes=axes.EXPERT_IN)
        self.down_proj = nnx.Param(_init(rngs.params(), (e, i, d), pd), logical_axes=axes.EXPERT_OUT)
        if cfg.router == "sigmoid_bias_grouped":
            self.router_bias = routers.RouterBias(jnp.zeros((e,), jnp.float32))
        if cfg.num_shared_experts:
            self.shared = DenseMLP(cfg, intermediate_size=cfg.num_shared_experts * i, rngs=rngs)

    def __call__(self, x, replay_ids=None, replay_mask=None, token_mask=None, positions=None, layer=0, *, real=None):
        """x [B, T, D]; replay_ids [B, T, K] int or None; replay_mask, token_mask [B, T] bool;
        positions [B, T] int (default: 0 .. T-1 per row) and layer (this block's MoE layer index) seed
        the selection noise of ``cfg.router_noise > 0`` (models/routers.py), unused otherwise. real
        [B, T] bool or None: False marks padding whose output nobody reads (the engine's paged steps,
        :attr:`models.paged.PagedMeta.real`); the expert kernels skip it (its routed experts' output is
        0; its ids, routes and the router are unchanged). Not token_mask: a trainer's masked tokens
        (e.g. uncaptured ones) are still real.

        Returns ``(y [B, T, D], ids [B, T, K] int32, live_ids [B, T, K] int32, aux_loss scalar,
        load [E] f32)``: load counts the used experts over tokens where token_mask (and, under
        replay, replay_mask) is True, for :func:`models.routers.update_bias`.
        """
        cfg, dt = self.cfg, self.cfg.dtype
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        logits = xf @ self.router[...].astype(dt)
        flat = lambda a: None if a is None else a.reshape(b * t, *a.shape[2:])
        bias = self.router_bias[...] if cfg.router == "sigmoid_bias_grouped" else None
        noise = None
        if cfg.router_noise > 0 and replay_ids is None:  # static: a noiseless config traces as before
            pos = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
            noise = cfg.router_noise * routers.selection_noise(pos.reshape(b * t), layer, cfg.num_experts)
        r = routers.route(logits, cfg, bias, flat(replay_ids), flat(replay_mask), noise)
        ids, weights, live = r.ids, r.gates, r.live_ids
        kernel = {"ragged": experts_ragged, "dense": experts_dense, "loop": experts_loop,
                  "gather": experts_gather}[cfg.moe_impl]
        # the out-of-range id E: every kernel skips it (models/expert_parallel.py relies on the same)
        run_ids = ids if real is None else jnp.where(real.reshape(b * t, 1), ids, cfg.num_experts)
        # expert-parallel under a trainer mesh in context (models/expert_parallel.py), else direct
        y = expert_parallel.experts(kernel, xf, run_ids, weights.astype(dt), self.gate_proj[...].astype(dt),
                                    self.up_proj[...].astype(dt), self.down_proj[...].astype(dt),
                                    exchange_tokens=cfg.moe_exchange_tokens)
        if cfg.num_shared_experts:
            y = y + self.shared(xf)
        mask = jnp.ones((b * t,), bool) if token_mask is None else token_mask.reshape(b * t)
        aux = load_balancing_loss(r.probs, ids, mask)
        load_mask = mask if replay_mask is None else mask & flat(replay_mask)
        load = routers.expert_load(ids, load_mask, cfg.num_experts)
        k = cfg.top_k
        return y.reshape(b, t, d), ids.reshape(b, t, k), live.reshape(b, t, k), aux, load
