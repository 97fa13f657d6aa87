"""Decoder layers and how a run of them is executed: one ``jax.lax.scan`` over stacked variables
(``scan_layers=True``) or a Python loop (unrolled), each layer optionally rematerialised.

Both paths call the same pure per-layer function, so they compute the same thing; the scan traces
and compiles one layer body per run instead of one per layer (compile time flat in depth).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import MoeConfig
from models.layers import Attention, DenseMLP, RMSNorm
from models.mla import MLAttention
from models.moe import MoeBlock

_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
             "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: MoeConfig, layer_id: int, *, rngs: nnx.Rngs):
        self.is_moe = layer_id >= cfg.first_dense_layers
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = MLAttention(cfg, rngs=rngs) if cfg.attention == "mla" else Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MoeBlock(cfg, rngs=rngs) if self.is_moe else DenseMLP(cfg, rngs=rngs)


def stack_modules(modules: list[nnx.Module]) -> nnx.Module:
    """One module of the same structure as each of ``modules`` whose variables are theirs stacked
    along a new leading axis (the modules must share one graphdef)."""
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.split(m)[1] for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def apply_layer(graphdef, state, x, positions, segment_ids, kv, replay_ids, replay_mask, token_mask, index=0):
    """One decoder layer as a pure function of its variables ``state``.

    x [B, T, D]; kv: this layer's ``(k, v)`` [B, S, Hc, Dc] or None; replay_ids [B, T, K] or None;
    index: the layer's index within its run (for an MoE run, the MoE layer index: router noise's seed).
    Returns ``(x, kv, moe)`` with ``moe = (ids [B, T, K], live_ids [B, T, K], aux scalar, load [E])``
    for an MoE layer and None for a dense one.
    """
    layer = nnx.merge(graphdef, state)
    # a paged step's padding tokens (written to the trash page) need no expert work: nothing reads them
    real = None if kv is None or isinstance(kv, tuple) else kv.meta.real[None]
    h, kv = layer.attn(layer.input_norm(x), positions, segment_ids, kv)
    x = x + h
    h = layer.post_attn_norm(x)
    if layer.is_moe:
        h, ids, live, aux, load = layer.mlp(h, replay_ids, replay_mask, token_mask, positions, index, real=real)
        return x + h, kv, (ids, live, aux, load)
    return x + layer.mlp(h), kv, None


def _layer_fn(graphdef, remat: str, scanned: bool):
    fn = functools.partial(apply_layer, graphdef)
    if remat == "none":
        return fn
    # inside a scan the loop boundary already stops XLA from merging recomputation with the forward
    return jax.checkpoint(fn, policy=_POLICIES[remat], prevent_cse=not scanned)


def run_layers(graphdef, states, x, *, positions, segment_ids, token_mask, cache_k, cache_v, replay_ids,
               replay_mask, remat: str, scanned: bool, min_loop: int = 1, cache_meta=None):
    """Run a group of n identical layers.

    states: the group's stacked variables (leaves ``[n, ...]``) when ``scanned``, else a list of n
    per-layer ``(graphdef, state)`` pairs (graphdef is then unused). A scanned group of fewer than
    ``min_loop`` layers is lowered unrolled (``MoeConfig.scan_min_layers``). cache_k / cache_v: the group's
    cache ``[n, B, S, Hc, Dc]`` or None; replay_ids: ``[n, B, T, K]`` (layer axis first) or None.
    Returns ``(x, (cache_k, cache_v), moe)`` with moe the per-layer MoE outputs stacked along a leading
    layer axis (None for a dense group). cache_meta: a :class:`models.paged.PagedMeta` when the cache
    is a page pool ``[n, P, ps, Hc, Dc]`` (each layer then sees a :class:`models.paged.PagedLayer`).
    """
    def step(carry, j, fn, state, rid):
        h, ck, cv = carry
        if ck is None:
            kv = None
        elif cache_meta is None:
            kv = (ck[j], cv[j])
        else:
            from models.paged import PagedLayer

            kv = PagedLayer(ck, cv, cache_meta, jnp.asarray(j, jnp.int32))  # the whole stacks: see PagedLayer
        h, kv, moe = fn(state, h, positions, segment_ids, kv, rid, replay_mask, token_mask, j)
        if cache_meta is not None:  # the layer wrote into the stacks themselves
            ck, cv = kv
        elif ck is not None:  # write this layer's slice back into the carried stack (in place)
            ck = jax.lax.dynamic_update_index_in_dim(ck, kv[0], j, 0)
            cv = jax.lax.dynamic_update_index_in_dim(cv, kv[1], j, 0)
        return (h, ck, cv), moe

    carry = (x, cache_k, cache_v)
    if scanned:
        fn = _layer_fn(graphdef, remat, scanned=True)
        n = jax.tree.leaves(states)[0].shape[0]
        body = lambda c, xs: step(c, xs[0], fn, xs[1], xs[2])
        carry, moe = jax.lax.scan(body, carry, (jnp.arange(n), states, replay_ids), unroll=n if n < min_loop else 1)
    else:
        outs = []
        for j, (gd, state) in enumerate(states):
            rid = None if replay_ids is None else replay_ids[j]
            carry, moe = step(carry, j, _layer_fn(gd, remat, scanned=False), state, rid)
            outs.append(moe)
        moe = None if outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    x, ck, cv = carry
    return x, (ck, cv), moe
