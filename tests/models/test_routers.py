"""The router family (models/routers.py) inside the model: replay semantics per router, gate
gradients of replayed experts, grouped selection, the selection bias and its load, dense-first layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer, Replay, routers, stacking
from r3jax import routes as routes_lib

B, T = 2, 8
_BASE = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=3,
             first_dense_layers=1, num_experts=16, top_k=2, moe_intermediate_size=8, dense_intermediate_size=16)
ROUTERS = {  # the two router families; MLA and the plain softmax are covered by tests/models/test_hf.py
    "softmax_renorm": dict(routed_scaling_factor=1.5),  # Qwen3-MoE, Mixtral (+ a scale)
    "sigmoid_grouped_shared": dict(router="sigmoid_bias_grouped", n_group=4, topk_group=2,
                                   routed_scaling_factor=2.5, num_shared_experts=1),  # DeepSeek-V3 / GLM
}


def _model(name, seed=0, **extra):
    cfg = MoeConfig(**{**_BASE, **ROUTERS[name], **extra})
    model = MoeTransformer(cfg, rngs=nnx.Rngs(seed))
    if hasattr(model.moe_layers.mlp, "router_bias"):  # a nonzero selection bias, so using it (or not) shows
        bias = model.moe_layers.mlp.router_bias  # [L, E]: the same draw in every layer
        bias[...] = jnp.broadcast_to(0.02 * jax.random.normal(jax.random.key(seed + 7), (cfg.num_experts,)),
                                     bias.shape)
    return cfg, model


def _fwd(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, tok, pos, rp, tm: nnx.merge(graphdef, s)(tok, pos, rp, token_mask=tm))
    return lambda tok, pos, rp=None, tm=None: fn(state, tok, pos, rp, tm)


def _inputs(cfg, seed=1, b=B, t=T):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size, dtype=jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@pytest.mark.parametrize("name", ["softmax_renorm", "sigmoid_grouped_shared"])
def test_replay_of_own_routes_is_bit_identical_and_load_counts_used_experts(name):
    cfg, model = _model(name)
    fwd = _fwd(model)
    tokens, positions = _inputs(cfg)
    out = fwd(tokens, positions)
    rep = fwd(tokens, positions, Replay(out.routes.astype(jnp.uint8), jnp.ones((B, T), bool)))
    for field in ("logits", "routes", "live_routes", "aux_loss", "expert_load"):
        np.testing.assert_array_equal(getattr(rep, field), getattr(out, field), err_msg=field)
    # load = per-layer bincount of the used ids over the token mask; under replay, captured rows only
    want = np.stack([np.bincount(np.asarray(out.routes)[:, :, m].ravel(), minlength=cfg.num_experts)
                     for m in range(cfg.num_moe_layers)])
    np.testing.assert_array_equal(out.expert_load, want)
    mask = np.zeros((B, T), bool)
    mask[0, :3] = True
    part = fwd(tokens, positions, Replay(out.routes, jnp.asarray(mask)))
    want = np.stack([np.bincount(np.asarray(out.routes)[:, :, m][mask].ravel(), minlength=cfg.num_experts)
                     for m in range(cfg.num_moe_layers)])
    np.testing.assert_array_equal(part.expert_load, want)


@pytest.mark.parametrize("name", ["softmax_renorm", "sigmoid_grouped_shared"])
def test_replayed_experts_outside_the_live_top_k_get_gate_gradients(name):
    cfg, model = _model(name)
    tokens, positions = _inputs(cfg, b=1, t=4)
    live = np.asarray(_fwd(model)(tokens, positions).live_routes)  # [1, 4, L, K]
    k, layers = cfg.top_k, cfg.num_moe_layers
    # Per MoE layer: K experts no token picks live there, forced on every token.
    forced = [sorted(set(range(cfg.num_experts)) - set(live[:, :, m].ravel()))[:k] for m in range(layers)]
    routes = np.broadcast_to(np.array(forced, np.int32), (1, 4, layers, k))
    weights = jax.random.normal(jax.random.key(3), (1, 4, cfg.vocab_size))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def router_grads(replay):
        loss = lambda p, rp: jnp.sum(nnx.merge(graphdef, p, rest)(tokens, positions, rp).logits * weights)
        g = jax.jit(jax.grad(loss))(params, replay)
        return [np.asarray(stacking.layer(g, cfg, i)["mlp"]["router"][...]) for i in cfg.moe_layer_ids]  # [D, E]

    replayed = router_grads(Replay(jnp.asarray(routes), jnp.ones((1, 4), bool)))
    unreplayed = router_grads(None)
    first = cfg.moe_layer_ids[0]
    for m, (g_rep, g_live) in enumerate(zip(replayed, unreplayed)):
        for e in forced[m]:
            assert np.abs(g_rep[:, e]).max() > 1e-4, f"layer {m} expert {e}: no gate gradient under replay"
        if m == 0:  # at the first MoE layer the live choice is the same with and without replay:
            for e in forced[m]:  # renormalised gates depend on the chosen experts' scores only (up to
                # rounding through the full softmax), so without replay these experts get ~nothing
                assert np.abs(g_live[:, e]).max() < 1e-3 * np.abs(g_rep[:, e]).max(), (first, e)
    # the bias is state, not a parameter: gradients and optimizers never see it
    params = nnx.state(model, nnx.Param)
    has_bias = cfg.router == "sigmoid_bias_grouped"
    assert ("router_bias" in stacking.layer(params, cfg, first)["mlp"]) is False
    assert ("router_bias" in stacking.layer(nnx.state(model), cfg, first)["mlp"]) is has_bias


@pytest.mark.parametrize("e,n_group,topk_group,k", [(16, 4, 2, 4), (12, 6, 1, 2), (384, 8, 4, 8), (32, 8, 3, 6)])
def test_grouped_selection_stays_in_the_chosen_groups(e, n_group, topk_group, k):
    cfg = MoeConfig(**{**_BASE, "num_experts": e, "top_k": k, "router": "sigmoid_bias_grouped",
                       "n_group": n_group, "topk_group": topk_group})
    rng = np.random.default_rng(e + k)
    for trial in range(20):
        logits = rng.normal(size=(64, e)).astype(np.float32) * rng.uniform(0.1, 4)
        bias = rng.normal(size=(e,)).astype(np.float32) * rng.uniform(0, 0.5)
        s = np.asarray(routers.scores(jnp.asarray(logits), cfg.router))
        ids = np.asarray(routers.select(jnp.asarray(s), jnp.asarray(bias), cfg))
        choice = (s + bias).reshape(64, n_group, e // n_group)
        group_score = np.sort(choice, axis=-1)[..., -2:].sum(-1)  # sum of the two best per group
        chosen = np.argsort(-group_score, axis=-1)[:, :topk_group]
        group_of = ids // (e // n_group)
        inside = (group_of[:, :, None] == chosen[:, None, :]).any(-1)
        assert inside.all(), f"trial {trial}: ids {ids[~inside.all(1)][0]} outside groups"
        keep = np.zeros((64, n_group), bool)
        keep[np.arange(64)[:, None], chosen] = True
        masked = np.where(np.repeat(keep, e // n_group, axis=1), s + bias, -np.inf)
        np.testing.assert_array_equal(np.sort(ids, -1), np.sort(np.argsort(-masked, -1)[:, :k], -1))
        assert (np.sort(ids, -1)[:, 1:] != np.sort(ids, -1)[:, :-1]).all()


def test_gates_use_scores_not_bias_and_bias_update_balances():
    cfg = MoeConfig(**{**_BASE, **ROUTERS["sigmoid_grouped_shared"]})
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 16)), jnp.float32)
    big = jnp.zeros((16,)).at[3].set(10.0)  # expert 3 always selected, its gate from its score only
    r = routers.route(logits, cfg, big)
    s = jax.nn.sigmoid(logits)
    assert (np.asarray(r.ids) == 3).any(-1).all()
    want = jnp.take_along_axis(s, r.ids, -1)
    np.testing.assert_allclose(r.gates, want / (want.sum(-1, keepdims=True) + 1e-20) * 2.5, rtol=1e-6)
    load = jnp.array([[4.0, 0.0, 2.0, 2.0]])
    np.testing.assert_array_equal(routers.update_bias(jnp.zeros((1, 4)), load, 0.5), [[-0.5, 0.5, 0.0, 0.0]])


def test_dense_first_layer_ids_reach_payloads_and_replay_lands_on_its_layer():
    cfg, model = _model("sigmoid_grouped_shared", num_layers=5, first_dense_layers=2)
    assert cfg.moe_layer_ids == model.moe_layer_ids == (2, 3, 4)
    fwd = _fwd(model)
    tokens, positions = _inputs(cfg)
    out = fwd(tokens, positions)
    rows = np.asarray(out.routes[0]).astype(routes_lib.route_dtype(cfg.num_experts))  # [T, L, K]
    assert routes_lib.decode_payload(routes_lib.encode(rows, 0, cfg.moe_layer_ids))[2] == [2, 3, 4]
    assert routes_lib.decode_binary(routes_lib.encode_binary(rows, 0, cfg.moe_layer_ids))[2] == [2, 3, 4]
    for m in range(cfg.num_moe_layers):  # change MoE layer m's routes only (global layer 2 + m)
        forced = np.asarray(out.routes).copy()
        forced[..., m, :] = (forced[..., m, :] + cfg.top_k) % cfg.num_experts
        rep = fwd(tokens, positions, Replay(jnp.asarray(forced), jnp.ones((B, T), bool)))
        np.testing.assert_array_equal(rep.routes, forced)
        # layers before m see the same inputs: same live choice; layer m's used experts are the forced ones
        np.testing.assert_array_equal(rep.live_routes[..., :m + 1, :], out.live_routes[..., :m + 1, :])
        changed = np.asarray(rep.routes != out.routes).any(axis=(0, 1, 3))
        assert changed.tolist() == [i == m for i in range(cfg.num_moe_layers)]
        np.testing.assert_array_equal(rep.expert_load[:m], out.expert_load[:m])
        assert not np.array_equal(rep.expert_load[m], out.expert_load[m])


def test_bias_update_on_the_model_state_follows_the_load():
    cfg, model = _model("sigmoid_grouped_shared")
    tokens, positions = _inputs(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = nnx.merge(graphdef, params, rest)(tokens, positions)
    load = np.asarray(out.expert_load)  # [L, E]
    assert load.shape == (cfg.num_moe_layers, cfg.num_experts) and (load.sum(-1) == B * T * cfg.top_k).all()
    new = routers.update_state_biases(rest, out.expert_load, cfg.moe_layer_ids, 0.01)
    for m, i in enumerate(cfg.moe_layer_ids):
        old_b = np.asarray(stacking.layer(rest, cfg, i)["mlp"]["router_bias"][...])
        new_b = np.asarray(stacking.layer(new, cfg, i)["mlp"]["router_bias"][...])
        np.testing.assert_allclose(new_b - old_b, 0.01 * np.sign(load[m].mean() - load[m]), atol=1e-7)
    soft_cfg, soft = _model("softmax_renorm")
    _, _, soft_rest = nnx.split(soft, nnx.Param, ...)
    with pytest.raises(ValueError, match="LossConfig.bias_update_rate=0.01: expected 0 for a model without router_bias"):
        routers.update_state_biases(soft_rest, out.expert_load, soft_cfg.moe_layer_ids, 0.01)  # nothing to update
