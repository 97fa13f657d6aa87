"""The decoder-only MoE transformer (Qwen3-MoE, OLMoE, Mixtral, GLM-4.5, DeepSeek-V3 families) that
exposes and replays its routes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models import stacking
from models.cache import KVCache
from models.config import MoeConfig
from models.decoder import DecoderLayer, run_layers, stack_modules
from models.layers import RMSNorm
from models.replay import Replay

_init = nnx.initializers.normal(stddev=0.02)


@struct.dataclass
class ModelOutput:
    """logits [B, T, V] f32 (None under ``return_hidden=True``); routes / live_routes [B, T, L, K] int32; aux_loss scalar f32
    (load-balancing loss averaged over MoE layers); cache: the updated KVCache or None;
    expert_load [L, E] f32: per MoE layer, how many (token, slot) assignments each expert got over
    tokens where token_mask (and, under replay, replay.mask) is True; the input of
    :func:`models.routers.update_bias`; hidden [B, T, D] (compute dtype): the final-norm hidden states,
    set only under ``return_hidden=True`` (``model.logits(hidden)`` gives the logits)."""

    logits: jax.Array
    routes: jax.Array
    live_routes: jax.Array
    aux_loss: jax.Array
    cache: KVCache | None = None
    expert_load: jax.Array | None = None
    hidden: jax.Array | None = None


class MoeTransformer(nnx.Module):
    """``model(tokens, positions, replay=None, cache=None) -> ModelOutput``.

    ``return_hidden=True`` skips the LM head: the output carries the final-norm hidden states
    [B, T, D] (``hidden``) and no logits, and ``model.logits(hidden)`` applies the (possibly tied)
    head, so a caller can take the [.., V] logits only where and in pieces as it needs them (the
    train step's chunked loss, r3jax/train/logits.py; the engine's prefill, which needs one position
    per row).

    tokens, positions: [B, T] int32. replay: :class:`Replay` or None. cache: :class:`KVCache` or
    None (full-sequence mode). segment_ids [B, T] (full-sequence mode only) keeps packed sequences
    from attending to each other; token_mask [B, T] bool excludes padding from the aux loss.

    Full-sequence causality follows the index within the row (and segment ids), never position
    values, so right padding needs nothing: the real tokens get the unpadded row's logits and
    routes. Left padding needs segment_ids that give the padding its own id (e.g. 0 on padding, 1
    on the tokens); without them the real tokens would attend to the padding before them.

    Layers: ``config.scan_layers`` (default) stacks the dense-first run as ``dense_layers`` and the MoE
    run as ``moe_layers`` (leading layer axis) and runs each with one ``jax.lax.scan``; otherwise
    ``layers[i]`` per layer and a Python loop (models/stacking.py, models/decoder.py).
    """

    def __init__(self, config: MoeConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed = nnx.Param(_init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype),
                               logical_axes=("vocab", "embed"))
        layers = [DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]  # one draw order for both layouts
        if cfg.scan_layers:
            for name, ids in stacking.layer_groups(cfg):
                setattr(self, name, stack_modules([layers[i] for i in ids]))
        else:
            self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(_init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype),
                                     logical_axes=("embed", "vocab"))

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.config.moe_layer_ids

    def _group(self, name: str, ids: tuple[int, ...]):
        """(graphdef, states) of one run of layers, as :func:`models.decoder.run_layers` takes them."""
        if self.config.scan_layers:
            return nnx.split(getattr(self, name))
        return None, [nnx.split(self.layers[i]) for i in ids]

    def __call__(self, tokens, positions, replay: Replay | None = None, cache: KVCache | None = None,
                 *, segment_ids=None, token_mask=None, return_hidden: bool = False) -> ModelOutput:
        cfg, dt = self.config, self.config.dtype
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        b, t = tokens.shape
        routes = live_routes = jnp.zeros((b, t, 0, cfg.top_k), jnp.int32)
        aux_loss = jnp.zeros((), jnp.float32)
        expert_load = jnp.zeros((0, cfg.num_experts), jnp.float32)
        new_k, new_v = [], []
        for g, (name, ids) in enumerate(stacking.layer_groups(cfg)):
            is_moe = name == "moe_layers"
            # the scan runs over the layer axis: replay [B, T, L, K] -> [L, B, T, K]
            r_ids = jnp.moveaxis(replay.routes, 2, 0) if is_moe and replay is not None else None
            graphdef, states = self._group(name, ids)
            x, (ck, cv), moe = run_layers(
                graphdef, states, x, positions=positions, segment_ids=segment_ids, token_mask=token_mask,
                cache_k=None if cache is None else cache.k[g],
                cache_v=cache.v[g] if cache is not None and cache.v else None,  # () for a combined pool
                replay_ids=r_ids, replay_mask=None if replay is None else replay.mask, remat=cfg.remat,
                scanned=cfg.scan_layers, min_loop=cfg.scan_min_layers, cache_meta=getattr(cache, "meta", None))
            new_k.append(ck), new_v.append(cv)
            if is_moe:  # moe: ids, live [L, B, T, K], aux [L], load [L, E]
                ids_, live, aux, expert_load = moe
                routes, live_routes = jnp.moveaxis(ids_, 0, 2), jnp.moveaxis(live, 0, 2)
                aux_loss = jnp.mean(aux)
        x = self.final_norm(x)
        new_cache = None if cache is None else cache.replace(k=tuple(new_k), v=tuple(new_v) if cache.v else ())
        if return_hidden:
            return ModelOutput(None, routes, live_routes, aux_loss, new_cache, expert_load, hidden=x)
        return ModelOutput(self.logits(x), routes, live_routes, aux_loss, new_cache, expert_load)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The LM head (the embedding's transpose when ``tie_embeddings``): hidden [..., D] -> [..., V] f32,
        computed in ``dtype`` or, with ``logits_dot_in_fp32``, in fp32."""
        cfg = self.config
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        dt = jnp.float32 if cfg.logits_dot_in_fp32 else cfg.dtype
        return (hidden.astype(dt) @ head.astype(dt)).astype(jnp.float32)
