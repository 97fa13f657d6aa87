"""The router family: scores, selection and gate weights, for live routing and for replay.

One function, :func:`route`, serves every MoE layer:

- ``softmax_topk`` (Qwen3-MoE, OLMoE, Mixtral): scores = softmax over all E router logits; select
  the top-k scores; gates = the scores at the selected ids, renormalised to sum 1 when
  ``norm_topk_prob`` (Qwen3-MoE, Mixtral; OLMoE-1B-7B does not). Mixtral's original "softmax over
  the top-k logits" is exactly this renormalised form (exp(l_i) / sum_{j in top-k} exp(l_j)), which
  is also how transformers computes it.
- ``sigmoid_bias_grouped`` (DeepSeek-V3, Kimi-K2, GLM-4.5): scores = sigmoid(logits); selection
  uses ``scores + e_score_correction_bias``, limited to the ``topk_group`` best of ``n_group``
  expert groups (a group's score is the sum of its two best biased scores); gates = the
  *unbiased* scores at the selected ids, divided by their sum (+1e-20) when ``norm_topk_prob``.

Both then multiply the gates by ``routed_scaling_factor``.

``MoeConfig.router_noise`` = sigma > 0 simulates a rollout kernel that picks different experts: the
selection sees ``logits + sigma * z`` while the gates stay computed from the clean logits. z
(:func:`selection_noise`) is a pure function of the token's position and its MoE layer index
(``fold_in`` of a fixed key), not of an rng threaded through the model: the same token gets the same
noise whether it runs in a prefill chunk or a decode step, cached prefix pages stay consistent, and
rollouts stay reproducible. Tokens at equal positions of different sequences share z (their logits
differ, so their flips do not). Noise applies only when no replay ids are given. Replay replaces the selection only: the
gates are always recomputed from the live scores at the used ids (never from the bias), so the
router keeps its gradient and replaying the live ids reproduces the live forward bit for bit.

The bias is not trained by gradient: :class:`RouterBias` is an NNX variable that is not an
``nnx.Param`` (optimizers and ``nnx.split(model, nnx.Param, ...)`` leave it in the rest), updated
between steps by :func:`update_bias` from the per-expert load the model reports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models.config import MoeConfig
from models.fields import FieldError


class RouterBias(nnx.Variable):
    """Non-trainable per-expert selection bias (DeepSeek's ``e_score_correction_bias``) [E] f32."""


@struct.dataclass
class Routing:
    """ids [N, K] int32 (used: replayed where replay applies); gates [N, K] f32; live_ids [N, K]
    int32 (the router's own choice); probs [N, E] f32 (per-token distribution for the aux loss:
    softmax scores, or sigmoid scores normalised to sum 1)."""

    ids: jax.Array
    gates: jax.Array
    live_ids: jax.Array
    probs: jax.Array


NOISE_SEED = 0x5E1EC7  # the fixed key of the selection noise


def selection_noise(positions: jax.Array, layer, num_experts: int) -> jax.Array:
    """Standard normal [N, E] f32 for tokens at positions [N] int in MoE layer ``layer`` (int or
    int32 scalar, the L index of the route arrays): row n depends only on (positions[n], layer)."""
    base = jax.random.fold_in(jax.random.key(NOISE_SEED), layer)
    draw = lambda p: jax.random.normal(jax.random.fold_in(base, p), (num_experts,), jnp.float32)
    return jax.vmap(draw)(positions.astype(jnp.int32))


def scores(logits: jax.Array, router: str) -> jax.Array:
    """Router scores [N, E] f32 from logits [N, E]: softmax or sigmoid (computed in float32)."""
    logits = logits.astype(jnp.float32)
    if router == "softmax_topk":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def group_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """[N, E] bool: True on the experts of each token's ``topk_group`` best groups.

    choice [N, E] f32 (biased scores). A group's score is the sum of its two best experts, as in
    transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter.
    """
    n, e = choice.shape
    grouped = choice.reshape(n, n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
    _, best = jax.lax.top_k(group_scores, topk_group)  # [N, topk_group]
    keep = jnp.any(jax.nn.one_hot(best, n_group, dtype=jnp.bool_), axis=1)  # [N, G]
    return jnp.repeat(keep, e // n_group, axis=1)


def select(s: jax.Array, bias: jax.Array | None, cfg: MoeConfig) -> jax.Array:
    """The router's own top-k ids [N, K] int32 from scores s [N, E] (and the bias [E] for sigmoid)."""
    if cfg.router == "softmax_topk":
        return jax.lax.top_k(s, cfg.top_k)[1].astype(jnp.int32)
    choice = s if bias is None else s + bias.astype(jnp.float32)
    if 1 < cfg.n_group and cfg.topk_group < cfg.n_group:
        choice = jnp.where(group_mask(choice, cfg.n_group, cfg.topk_group), choice, -jnp.inf)
    return jax.lax.top_k(choice, cfg.top_k)[1].astype(jnp.int32)


def gates(s: jax.Array, ids: jax.Array, cfg: MoeConfig) -> jax.Array:
    """Gate weights [N, K] f32: live scores s [N, E] at ids [N, K], normalised and scaled."""
    w = jnp.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob:
        denom = jnp.sum(w, axis=-1, keepdims=True)
        w = w / (denom + 1e-20 if cfg.router == "sigmoid_bias_grouped" else denom)
    if cfg.routed_scaling_factor != 1.0:
        w = w * cfg.routed_scaling_factor
    return w


def route(logits: jax.Array, cfg: MoeConfig, bias: jax.Array | None = None, replay_ids=None,
          replay_mask=None, noise: jax.Array | None = None) -> Routing:
    """Route N tokens. logits [N, E]; bias [E] or None; replay_ids [N, K] any integer dtype or None;
    replay_mask [N] bool (True: use replay_ids); noise [N, E] f32 or None, added to the logits of the
    live selection only (gates and probs use the clean scores). Returns :class:`Routing`."""
    s = scores(logits, cfg.router)
    choose = s if noise is None else scores(logits.astype(jnp.float32) + noise, cfg.router)
    live = select(jax.lax.stop_gradient(choose), bias, cfg)
    ids = live
    if replay_ids is not None:
        ids = jnp.where(replay_mask[:, None], replay_ids.astype(jnp.int32), live)
    probs = s if cfg.router == "softmax_topk" else s / jnp.sum(s, axis=-1, keepdims=True)
    return Routing(ids=ids, gates=gates(s, ids, cfg), live_ids=live, probs=probs)


def expert_load(ids: jax.Array, token_mask: jax.Array, num_experts: int) -> jax.Array:
    """Per-expert count [E] f32 of the (token, slot) assignments in ids [N, K] where token_mask [N]."""
    onehot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # [N, K, E]
    return jnp.sum(onehot * token_mask.astype(jnp.float32)[:, None, None], axis=(0, 1))


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balance update: ``bias + rate * sign(mean(load) - load)``.

    bias [..., E] f32; load [..., E] (e.g. ``out.expert_load [L, E]`` summed over a step's
    micro-batches). Under-loaded experts gain, over-loaded ones lose; a balanced layer is unchanged.
    """
    load = load.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def update_state_biases(state: nnx.State, load: jax.Array, moe_layer_ids, rate: float) -> nnx.State:
    """Apply :func:`update_bias` to every MoE layer's ``router_bias`` in a model state (e.g. the
    trainer's ``TrainState.rest``, where ``nnx.split(model, nnx.Param, ...)`` puts it), in either
    layer layout (models/stacking.py): the stacked ``moe_layers`` bias [L, E] or ``layers/{i}``'s [E].

    load [L, E] (``out.expert_load``, summed over a step); moe_layer_ids: the model's. Returns a new
    state; the input is not modified. A state without any ``router_bias`` (a softmax router, or a
    model of another layout) raises :class:`models.fields.FieldError`: a requested update that
    could not happen must not pass in silence.
    """
    pure = nnx.to_pure_dict(state)
    found = False
    stacked = pure.get("moe_layers", {}).get("mlp", {})
    if "router_bias" in stacked:  # [L, E]: update_bias works along the last axis
        stacked["router_bias"] = update_bias(stacked["router_bias"], load, rate)
        found = True
    for m, i in enumerate(moe_layer_ids):
        mlp = pure.get("layers", {}).get(i, {}).get("mlp", {})
        if "router_bias" in mlp:
            mlp["router_bias"] = update_bias(mlp["router_bias"], load[m], rate)
            found = True
    if not found:
        raise FieldError("LossConfig.bias_update_rate", rate,
                         "0 for a model without router_bias parameters (stacked moe_layers/mlp/router_bias "
                         "or layers/{i}/mlp/router_bias, as the sigmoid_bias_grouped router has)")
    new = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(new, pure)
    return new
