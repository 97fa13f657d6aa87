"""The decoder-only MoE transformer (Qwen3-MoE, OLMoE, Mixtral, GLM-4.5, DeepSeek-V3 families) that
exposes and replays its routes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models.cache import KVCache
from models.config import MoeConfig
from models.layers import Attention, DenseMLP, RMSNorm
from models.mla import MLAttention
from models.moe import MoeBlock
from models.replay import Replay

_init = nnx.initializers.normal(stddev=0.02)


@struct.dataclass
class ModelOutput:
    """logits [B, T, V] f32; routes / live_routes [B, T, L, K] int32; aux_loss scalar f32
    (load-balancing loss averaged over MoE layers); cache: the updated KVCache or None;
    expert_load [L, E] f32: per MoE layer, how many (token, slot) assignments each expert got over
    tokens where token_mask (and, under replay, replay.mask) is True; the input of
    :func:`models.routers.update_bias`."""

    logits: jax.Array
    routes: jax.Array
    live_routes: jax.Array
    aux_loss: jax.Array
    cache: KVCache | None = None
    expert_load: jax.Array | None = None


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: MoeConfig, layer_id: int, *, rngs: nnx.Rngs):
        self.is_moe = layer_id >= cfg.first_dense_layers
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = MLAttention(cfg, rngs=rngs) if cfg.attention == "mla" else Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MoeBlock(cfg, rngs=rngs) if self.is_moe else DenseMLP(cfg, rngs=rngs)


class MoeTransformer(nnx.Module):
    """``model(tokens, positions, replay=None, cache=None) -> ModelOutput``.

    tokens, positions: [B, T] int32. replay: :class:`Replay` or None. cache: :class:`KVCache` or
    None (full-sequence mode). segment_ids [B, T] (full-sequence mode only) keeps packed sequences
    from attending to each other; token_mask [B, T] bool excludes padding from the aux loss.

    Full-sequence causality follows the index within the row (and segment ids), never position
    values, so right padding needs nothing: the real tokens get the unpadded row's logits and
    routes. Left padding needs segment_ids that give the padding its own id (e.g. 0 on padding, 1
    on the tokens); without them the real tokens would attend to the padding before them.
    """

    def __init__(self, config: MoeConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed = nnx.Param(_init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(_init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype))

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.config.moe_layer_ids

    def __call__(self, tokens, positions, replay: Replay | None = None, cache: KVCache | None = None,
                 *, segment_ids=None, token_mask=None) -> ModelOutput:
        cfg, dt = self.config, self.config.dtype
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        routes, live_routes, aux, load = [], [], [], []
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            h, kv = layer.attn(layer.input_norm(x), positions, segment_ids, kv)
            x = x + h
            h = layer.post_attn_norm(x)
            if layer.is_moe:
                m = len(routes)
                r_ids = None if replay is None else replay.routes[:, :, m]
                r_mask = None if replay is None else replay.mask
                h, ids, live, a, n = layer.mlp(h, r_ids, r_mask, token_mask)
                routes.append(ids), live_routes.append(live), aux.append(a), load.append(n)
            else:
                h = layer.mlp(h)
            x = x + h
            if kv is not None:
                new_k.append(kv[0]), new_v.append(kv[1])
        x = self.final_norm(x)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = (x @ head.astype(dt)).astype(jnp.float32)
        b, t = tokens.shape
        stack = lambda xs: jnp.stack(xs, axis=2) if xs else jnp.zeros((b, t, 0, cfg.top_k), jnp.int32)
        aux_loss = jnp.mean(jnp.stack(aux)) if aux else jnp.zeros((), jnp.float32)
        new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
        expert_load = jnp.stack(load) if load else jnp.zeros((0, cfg.num_experts), jnp.float32)
        return ModelOutput(logits, stack(routes), stack(live_routes), aux_loss, new_cache, expert_load)
