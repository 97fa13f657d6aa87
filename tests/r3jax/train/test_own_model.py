"""Bring your own model: a tiny NNX MoE written here (not models.MoeTransformer) trains through
``train_step`` with replay, and rolls out through ``Engine``, fed by the model-free pieces (wire
codec, trace, collate, MaxText hand-off, shard_batch). docs/own-model.md describes the protocol.

The replayed experts are the complement of the router's own top-2, so every replayed row routes
differently from live routing: the logprobs and the gradient under replay must equal the ones this
model computes itself with those experts forced, and differ from live routing's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from models import paged
from models.axes import EXPERT_IN, EXPERT_OUT
from r3jax import handoff, routes as wire, train
from r3jax.batch import collate
from r3jax.checks import FieldError
from r3jax.engine import Engine, GenerateRequest
from r3jax.sharding import make_mesh, shard_batch
from r3jax.trace import RoutedExpertTrace

MAX_POS = 64  # rows of the learned position table
_init = nnx.initializers.normal(stddev=0.5)


@dataclasses.dataclass(frozen=True)
class OwnConfig:
    """The user's own config. r3jax reads num_moe_layers and top_k (the route row [L, K]) and, if
    present, router_aux_loss_coef; the model reads the rest. Frozen: it is part of the graphdef."""

    vocab_size: int = 32
    hidden_size: int = 16
    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 16
    num_moe_layers: int = 1
    router_aux_loss_coef: float = 0.01


class OwnMoe(nnx.Module):
    """Embedding + position table, one causal single-head attention, one MoE layer (softmax router,
    top-k, renormalised gates), LM head. ``config``: an :class:`OwnConfig`, or a ``models.MoeConfig``
    (num_layers=1, first_dense_layers=0, num_kv_heads=1, head_dim=hidden_size) when it should roll
    out through ``Engine``, which reads the KV-cache shape from it."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        c = self.config = config
        d, e, i, v = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.vocab_size
        # each parameter names its logical axes (models/axes.py): the one table then places it on a mesh
        p = lambda axes, *shape: nnx.Param(_init(rngs.params(), shape, jnp.float32), logical_axes=axes)
        self.embed, self.pos_embed = p(("vocab", "embed"), v, d), p((None, "embed"), MAX_POS, d)
        self.wq, self.wk, self.wv = (p(("embed", "heads"), d, d) for _ in range(3))
        self.wo = p(("heads", "embed"), d, d)
        self.router = p(("embed", "expert_logits"), d, e)
        self.gate_proj, self.up_proj = p(EXPERT_IN, e, d, i), p(EXPERT_IN, e, d, i)
        self.down_proj = p(EXPERT_OUT, e, i, d)
        self.lm_head = p(("embed", "vocab"), d, v)

    @property
    def moe_layer_ids(self):
        return (0,)  # global layer ids of the MoE layers (here one block: attention + MoE)

    def __call__(self, tokens, positions, replay=None, cache=None, *, segment_ids=None, token_mask=None):
        c = self.config
        b, t = tokens.shape
        x = self.embed[...][tokens] + self.pos_embed[...][positions]
        q, k, v = x @ self.wq[...], x @ self.wk[...], x @ self.wv[...]
        if cache is None:  # full sequence: causal by index in the row, within a segment
            idx = jnp.arange(t)
            allowed = jnp.broadcast_to(idx[None, :, None] >= idx[None, None, :], (b, t, t))
            if segment_ids is not None:
                allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
            scores = jnp.where(allowed, q @ jnp.swapaxes(k, 1, 2) / np.sqrt(c.hidden_size), -1e30)
            h, new_cache = x + jax.nn.softmax(scores, -1) @ v @ self.wo[...], None
        else:  # the engine's page pool (models.paged), one group of one layer: k[0] [1, P, ps, 2, D]
            assert cache.v == ()  # one kv head: keys and values interleaved in one combined pool
            pk = paged.write_kv(cache.k[0][0], k[:, :, None], v[:, :, None], cache.meta, jnp.float32)
            new_cache = paged.PagedCache(k=(pk[None],), v=(), meta=cache.meta)
            att = paged.ragged_attention(q[:, :, None], (pk,), None, positions, cache.meta,
                                         scale=c.hidden_size ** -0.5, dtype=jnp.float32)  # [1, N, 1, D]
            h = x + att[:, :, 0] @ self.wo[...]

        router_logits = h @ self.router[...]  # [B, T, E]
        probs = jax.nn.softmax(router_logits, -1)
        live = jax.lax.top_k(router_logits, c.top_k)[1].astype(jnp.int32)  # [B, T, K]
        ids = live
        if replay is not None:  # Replay(routes [B, T, L=1, K] compact int, mask [B, T] bool)
            ids = jnp.where(replay.mask[:, :, None], replay.routes[:, :, 0].astype(jnp.int32), live)
        h = h + self.experts(h, probs, ids)
        logits = (h @ self.lm_head[...]).astype(jnp.float32)

        used = token_mask if token_mask is not None else jnp.ones((b, t), bool)
        picks = jax.nn.one_hot(ids, c.num_experts).sum(2) * used[:, :, None]  # [B, T, E]
        n = jnp.maximum(used.sum(), 1)
        aux = c.num_experts * jnp.sum(picks.sum((0, 1)) / (n * c.top_k)
                                      * (probs * used[:, :, None]).sum((0, 1)) / n)
        return models.ModelOutput(logits=logits, routes=ids[:, :, None], live_routes=live[:, :, None],
                                  aux_loss=aux, cache=new_cache, expert_load=picks.sum((0, 1))[None])

    def experts(self, h, probs, ids):
        """Every expert on every token (tiny sizes), then each token's K picked ones, weighted by the
        router's probabilities at those ids renormalised (the gradient reaches the router)."""
        a = jax.nn.silu(jnp.einsum("btd,edi->btei", h, self.gate_proj[...]))
        a = a * jnp.einsum("btd,edi->btei", h, self.up_proj[...])
        y = jnp.einsum("btei,eid->bted", a, self.down_proj[...])  # [B, T, E, D]
        gates = jnp.take_along_axis(probs, ids, -1)
        gates = gates / gates.sum(-1, keepdims=True)
        picked = jnp.take_along_axis(y, ids[:, :, :, None], 2)  # [B, T, K, D]
        return jnp.sum(gates[..., None] * picked, 2)


N, P, G = 8, 5, 6  # trajectories, prompt tokens, generated tokens (two turns: 2 + 4 after 1 observation)


def _complement(live, num_experts):
    """[..., K] ids -> the K experts not among them (E = 2K here): disjoint from the router's choice."""
    out = np.empty_like(live)
    for idx in np.ndindex(live.shape[:-1]):
        out[idx] = [e for e in range(num_experts) if e not in set(live[idx].tolist())]
    return out


def _trajectories(model, cfg, seed=0):
    """N two-turn trajectories whose route rows go over the wire codec per turn, are accumulated by
    the trace and finalized. Rows are the complement of ``model``'s live top-k on the whole
    sequence (computed once up front, as a stand-in for a rollout engine that routed differently)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (N, P + G + 1)).astype(np.int32)  # + 1 observation token
    forced = _complement(_live_routes(model, tokens), cfg.num_experts).astype(wire.route_dtype(cfg.num_experts))
    trajs = []
    for r in range(N):
        # turn 1: prompt P, 2 generated; then 1 observation token; turn 2: prompt P + 3, 4 generated
        p1, g1, p2, g2 = P, 2, P + 3, 4
        n = p2 + g2
        trace = RoutedExpertTrace()
        for p, g in ((p1, g1), (p2, g2)):
            s = trace.prompt_start
            payload = wire.encode(forced[r, s:p + g - 1], start=s, layers=model.moe_layer_ids)
            rows, start, layers = wire.decode_payload(payload, num_experts=cfg.num_experts)
            trace = trace.record(prompt_len=p, generated_len=g, routes=rows, layers=layers)
        loss_mask = np.zeros(n, np.float32)
        loss_mask[p1:p1 + g1] = loss_mask[p2:p2 + g2] = 1.0
        routes, captured = trace.finalize(token_count=n, loss_mask=loss_mask)
        trajs.append(dict(tokens=tokens[r, :n], loss_mask=loss_mask, rollout_logprobs=np.zeros(n, np.float32),
                          advantage=float(rng.normal()), routes=routes, captured=captured))
    return trajs


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, rest, tokens, positions, segment_ids, replay):
    return nnx.merge(graphdef, params, rest)(tokens, positions, replay=replay, segment_ids=segment_ids)


def _live_routes(model, tokens):
    """The model's own live top-k ``[B, T, 1, K]`` on unpadded rows ``tokens [B, T]``."""
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(_forward(*nnx.split(model, nnx.Param, ...), tokens, positions, None, None).live_routes)


@functools.partial(jax.jit, static_argnums=0)
def _reference_fn(graphdef, params, rest, batch, replay):
    def loss(params):
        out = nnx.merge(graphdef, params, rest)(batch.tokens, batch.positions, replay=replay,
                                                segment_ids=batch.segment_ids)
        lp = train.token_logprobs(out.logits, batch.tokens)
        return -jnp.sum(batch.advantages * lp * batch.loss_mask) / jnp.sum(batch.loss_mask), lp
    (_, lp), grad = jax.value_and_grad(loss, has_aux=True)(params)
    return lp, grad


def _reference(model, batch, replay):
    """The model's own ``(token logprobs [B, S], policy gradient)`` on a host batch, replaying
    ``replay`` (or live): the gradient of the first on-policy step, -mean over targets of
    A * grad log pi, from the model alone (no r3jax loss code)."""
    lp, grad = _reference_fn(*nnx.split(model, nnx.Param, ...), batch, replay)
    return np.asarray(lp), nnx.to_pure_dict(jax.device_get(grad))


def test_own_model_trains_with_replay_forcing_its_experts():
    cfg = OwnConfig()
    model = OwnMoe(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    batch = collate(_trajectories(model, cfg), seq_len=16, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    num_layers=cfg.num_moe_layers, batch_multiple=8)
    # the MaxText hand-off is model-free too: the batch's routes round-trip through its layout
    back = handoff.from_maxtext(np.asarray(handoff.batch_to_maxtext(batch)), cfg.num_experts)
    np.testing.assert_array_equal(back[1], batch.route_mask)
    np.testing.assert_array_equal(back[0][batch.route_mask], batch.routes[batch.route_mask])

    forced = models.Replay(batch.routes, batch.route_mask)
    lp_forced, grad_forced = _reference(model, batch, forced)
    lp_live, grad_live = _reference(model, batch, None)
    targets = batch.loss_mask > 0
    assert np.abs(lp_forced - lp_live)[targets].min() > 1e-3  # every target sees other experts
    # rollout logprobs = the model's own under the forced experts: replay must reproduce them
    batch = batch.replace(rollout_logprobs=np.where(targets, lp_forced, 0.0).astype(np.float32))
    placed = shard_batch(batch, mesh)

    # aux off: the update is the policy gradient alone; chunked logits over the full logits of a model
    # without a logits method
    lr, config = 1.0, train.LossConfig(aux_coef=0.0, logits_chunk=12)
    state = train.init_train_state(model, optax.sgd(lr), mesh=mesh)
    # without replay the same trainer scores the live experts: the mismatch replay removes
    off = train.eval_step(state, placed, replay="none", config=config)
    np.testing.assert_allclose(float(off["mean_abs_delta"]), np.abs(lp_forced - lp_live)[targets].mean(), rtol=1e-4)
    assert float(off["live_routing_disagreement"]) == 1.0
    before = nnx.to_pure_dict(jax.device_get(state.params))
    state, m = train.train_step(state, placed, replay="rollout", config=config)
    m = {k: np.asarray(v) for k, v in m.items()}
    assert m["num_targets"] == N * 6
    assert m["mean_abs_delta"] < 1e-5  # the trainer's logprobs are the forced-expert ones
    assert m["fallback_fraction"] == 0.0
    assert m["live_routing_disagreement"] == 1.0  # the router would never have picked the forced experts
    # the update (sgd: -lr * grad) is the forced-expert gradient, not the live-routing one
    got = jax.tree.map(lambda a, b: (a - b) / -lr, nnx.to_pure_dict(jax.device_get(state.params)), before)
    rel = lambda a, b: float(np.linalg.norm(np.ravel(a - b)) / np.linalg.norm(np.ravel(b)))
    for name in grad_forced:
        assert rel(got[name], grad_forced[name]) < 1e-4, name
    for name in ("router", "gate_proj", "wq", "embed"):  # before, at and after the MoE layer
        assert rel(grad_live[name], grad_forced[name]) > 0.05, name


ENGINE_CONFIG = models.MoeConfig.tiny(  # describes OwnMoe's shapes to the engine (KV cache, routes)
    vocab_size=32, hidden_size=16, num_layers=1, first_dense_layers=0, num_heads=1, num_kv_heads=1,
    head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=16)


def test_own_model_rolls_out_through_engine():
    cfg = ENGINE_CONFIG
    model = OwnMoe(cfg, rngs=nnx.Rngs(1))
    engine = Engine(model, max_seq_len=32, max_batch_size=4, block_size=4, prefix_cache_bytes=1 << 16,
                    prefill_chunk=16)
    rng = np.random.default_rng(0)
    convs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 4, 5, 6)]
    traces = [RoutedExpertTrace() for _ in convs]
    masks = [[0.0] * len(c) for c in convs]
    lps = [[0.0] * len(c) for c in convs]
    for turn in range(2):  # turn 2 re-sends the conversation: its KV comes from the prefix cache and
        # only the rows after trace.prompt_start come back
        outs = engine.generate([GenerateRequest(prompt_ids=c, max_tokens=5, temperature=0.0,
                                                return_routed_experts=True, return_logprobs=True,
                                                routed_experts_prompt_start=t.prompt_start)
                                for c, t in zip(convs, traces)])
        for i, out in enumerate(outs):
            traces[i] = traces[i].record(prompt_len=len(convs[i]), generated_len=len(out.output_ids),
                                         routes=out.routed_experts)
            obs = [7] if turn == 0 else []  # an observation token between the turns
            convs[i] += out.output_ids + obs
            masks[i] += [1.0] * len(out.output_ids) + [0.0] * len(obs)
            lps[i] += out.logprobs + [0.0] * len(obs)
    assert engine.stats["cached_tokens"] > 0
    trajs = []
    for conv, trace, mask, lp in zip(convs, traces, masks, lps):
        routes, captured = trace.finalize(token_count=len(conv), loss_mask=np.asarray(mask, np.float32))
        trajs.append(dict(tokens=np.asarray(conv, np.int32), loss_mask=np.asarray(mask, np.float32),
                          rollout_logprobs=np.asarray(lp, np.float32), advantage=1.0, routes=routes,
                          captured=captured))
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    batch = collate(trajs, seq_len=32, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    num_layers=cfg.num_moe_layers, batch_multiple=8)

    # the engine's tokens, logprobs and routes are the model's own full-sequence ones
    out = _forward(*nnx.split(model, nnx.Param, ...), batch.tokens, batch.positions, batch.segment_ids, None)
    rows = batch.route_mask
    np.testing.assert_array_equal(batch.routes[rows], np.asarray(out.live_routes)[rows])
    targets = batch.loss_mask > 0
    greedy = np.argmax(np.asarray(out.logits), -1)[:, :-1]  # position i - 1 predicts token i
    np.testing.assert_array_equal(batch.tokens[:, 1:][targets[:, 1:]], greedy[targets[:, 1:]])
    lp = np.asarray(train.token_logprobs(out.logits, batch.tokens))
    np.testing.assert_allclose(batch.rollout_logprobs[targets], lp[targets], atol=1e-4)

    # and the trainer replays them on the same model: no mismatch left
    state = train.init_train_state(model, optax.sgd(0.1), mesh=mesh)
    m = train.eval_step(state, shard_batch(batch, mesh), replay="rollout")
    assert float(m["num_targets"]) == 4 * 10
    assert float(m["fallback_fraction"]) == 0.0
    assert float(m["live_routing_disagreement"]) == 0.0
    assert float(m["mean_abs_delta"]) < 1e-5  # fp32 engine and trainer: rounding only


def test_engine_refuses_what_it_cannot_follow():
    with pytest.raises(FieldError, match="model.config: OwnMoe has a OwnConfig: expected a models.MoeConfig"):
        Engine(OwnMoe(OwnConfig(), rngs=nnx.Rngs(0)), max_seq_len=32, max_batch_size=1)
    with pytest.raises(FieldError, match="dtype=.*bfloat16.*only a MoeTransformer is rebuilt"):
        Engine(OwnMoe(ENGINE_CONFIG, rngs=nnx.Rngs(0)), max_seq_len=32, max_batch_size=1, dtype=jnp.bfloat16)


def test_trainer_refuses_a_model_without_a_route_config():
    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((2, 2)))

    with pytest.raises(FieldError, match="model.config: Bare has none"):
        train.route_config(Bare())
    bad = OwnMoe(dataclasses.replace(OwnConfig(), top_k=True), rngs=nnx.Rngs(0))
    with pytest.raises(FieldError, match="model.config.top_k=True: expected an int >= 1"):
        train.route_config(bad)
