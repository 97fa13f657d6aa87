"""Scanned layers (models/stacking.py, models/decoder.py) against the unrolled reference: the same
logits, routes, live routes, expert loads, aux loss and gradients (1e-5), live and under replay, with
a real loop over every run (``scan_min_layers=1``); the KV cache through the loop; the layout maps and
the router-bias update in both layouts. Remat rides along at no extra compile: the dense-first pair
compares scanned ``remat="dots"`` with unrolled ``remat="full"`` (both must equal no remat)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import KVCache, MoeConfig, MoeTransformer, Replay, routers, stacking

B, T = 2, 8
_SMALL = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=16, top_k=2,
              moe_intermediate_size=8, dense_intermediate_size=16)
CONFIGS = {
    # the CPU default (1 dense + 2 MoE layers) with a loop over each run
    "tiny": MoeConfig.tiny(scan_min_layers=1),
    # 2 dense-first layers + 2 MoE layers, DeepSeek-style router with a per-layer bias, shared expert
    "dense_first": MoeConfig(**_SMALL, num_layers=4, first_dense_layers=2, router="sigmoid_bias_grouped", n_group=4,
                             topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1, moe_impl="dense",
                             scan_min_layers=1),
}
REMAT = {"tiny": ("none", "none"), "dense_first": ("dots", "full")}  # (scanned, unrolled)


def _pair(cfg, remat=("none", "none")):
    """(scanned, unrolled) models holding the same numbers; the unrolled one gets a distinct nonzero
    selection bias per MoE layer, copied into the scanned one through the layout map."""
    unrolled = MoeTransformer(cfg.replace(scan_layers=False, remat=remat[1]), rngs=nnx.Rngs(0))
    scanned = MoeTransformer(cfg.replace(remat=remat[0]), rngs=nnx.Rngs(0))
    for m, layer in enumerate(unrolled.layers):
        if hasattr(layer.mlp, "router_bias"):
            layer.mlp.router_bias[...] = 0.05 * jax.random.normal(jax.random.key(m), (cfg.num_experts,))
    pure = nnx.to_pure_dict(nnx.state(unrolled))
    state = nnx.state(scanned)
    nnx.replace_by_pure_dict(state, stacking.stack_layers(pure, cfg))
    nnx.update(scanned, state)
    return scanned, unrolled


def _program(model):
    """One compiled function: live forward, replayed forward and the gradient of a loss under replay."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    weights = jax.random.normal(jax.random.key(5), (B, T, model.config.vocab_size))

    @jax.jit
    def run(params, tokens, positions, replay):
        live = nnx.merge(graphdef, params, rest)(tokens, positions)

        def loss(p):
            out = nnx.merge(graphdef, p, rest)(tokens, positions, replay)
            return jnp.sum(out.logits * weights) + out.aux_loss, out

        (_, rep), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return live, rep, grads

    return lambda *a: run(params, *a)


def _inputs(cfg):
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return tokens, positions


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def outputs(request):
    cfg = CONFIGS[request.param]
    scanned, unrolled = _pair(cfg, REMAT[request.param])
    tokens, positions = _inputs(cfg)
    rng = np.random.default_rng(2)  # distinct random ids per (token, layer)
    forced = np.argsort(rng.random((B, T, cfg.num_moe_layers, cfg.num_experts)), -1)[..., :cfg.top_k]
    mask = np.zeros((B, T), bool)
    mask[:, ::2] = True
    replay = Replay(jnp.asarray(forced, jnp.uint8), jnp.asarray(mask))
    return (cfg, scanned, forced, mask, _program(scanned)(tokens, positions, replay),
            _program(unrolled)(tokens, positions, replay))


def _same(a, b, what):
    """Within 1e-5 of the reference, relative to its largest entry when that exceeds 1 (fp32 sums of
    O(10) gradients differ in the last bits between the two programs)."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max(initial=0))), rtol=0, err_msg=what)


def test_scanned_equals_unrolled_live_and_under_replay(outputs):
    cfg, _, forced, mask, (s_live, s_rep, _), (u_live, u_rep, _) = outputs
    for name, s, u in (("live", s_live, u_live), ("replay", s_rep, u_rep)):
        _same(s.logits, u.logits, f"{name} logits")
        np.testing.assert_array_equal(s.routes, u.routes, err_msg=f"{name} routes")
        np.testing.assert_array_equal(s.live_routes, u.live_routes, err_msg=f"{name} live_routes")
        np.testing.assert_array_equal(s.expert_load, u.expert_load, err_msg=f"{name} expert_load")
        _same(s.aux_loss, u.aux_loss, f"{name} aux_loss")
        assert s.routes.shape == (B, T, cfg.num_moe_layers, cfg.top_k) and s.routes.dtype == jnp.int32
    # replay applied per layer inside the scan: the forced ids exactly where the mask is True
    routes, live = np.asarray(s_rep.routes), np.asarray(s_rep.live_routes)
    np.testing.assert_array_equal(routes[mask], forced[mask])
    np.testing.assert_array_equal(routes[~mask], live[~mask])
    assert not np.allclose(s_rep.logits, s_live.logits, atol=1e-4)


def test_scanned_gradients_equal_the_unrolled_ones(outputs):
    cfg, _, _, _, (_, _, s_grads), (_, _, u_grads) = outputs
    want = stacking.stack_layers(nnx.to_pure_dict(u_grads), cfg)
    got = nnx.to_pure_dict(s_grads)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        _same(a, b, jax.tree_util.keystr(path))
    router = np.asarray(got["moe_layers"]["mlp"]["router"])  # [L, D, E]
    assert (np.abs(router).max(axis=(1, 2)) > 0).all()  # every MoE layer's router learns under replay


def test_kv_cache_through_the_scan_equals_the_full_forward(outputs):
    """Prefill then decode steps through the scanned runs (cache [n_g, B, S, Hkv, Dh] carried through
    each loop) give the full forward's logits and routes (which equal the unrolled model's)."""
    cfg, scanned, _, _, (full, _, _), _ = outputs
    tokens, positions = _inputs(cfg)
    graphdef, state = nnx.split(scanned)
    step = jax.jit(lambda s, tok, pos, cache: nnx.merge(graphdef, s)(tok, pos, cache=cache))
    first = step(state, tokens[:, :6], positions[:, :6], KVCache.init(cfg, B, 16))  # prefill
    cache, pieces = first.cache, [first]
    for t in range(6, T):  # decode steps
        o = step(state, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        cache = o.cache
        pieces.append(o)
    _same(jnp.concatenate([o.logits for o in pieces], axis=1), full.logits, "cached vs full logits")
    np.testing.assert_array_equal(jnp.concatenate([o.routes for o in pieces], axis=1), full.routes)
    assert [k.shape for k in cache.k] == [(len(ids), B, 16, cfg.num_kv_heads, cfg.head_dim)
                                          for _, ids in stacking.layer_groups(cfg)]
    k_last, _ = cache.layer(cfg, cfg.num_layers - 1)
    np.testing.assert_array_equal(k_last, cache.k[-1][-1])
    assert np.abs(np.asarray(k_last[:, :T])).min(axis=(2, 3)).max() > 0 and not np.asarray(k_last[:, T:]).any()


def test_layout_maps_round_trip_and_the_same_seed_gives_the_same_numbers():
    cfg = CONFIGS["dense_first"]
    scanned = nnx.to_pure_dict(nnx.state(MoeTransformer(cfg, rngs=nnx.Rngs(3))))
    unrolled = nnx.to_pure_dict(nnx.state(MoeTransformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(3))))
    assert sorted(scanned) == ["dense_layers", "embed", "final_norm", "lm_head", "moe_layers"]
    assert scanned["moe_layers"]["mlp"]["gate_proj"].shape == (2, 16, 32, 8)  # [L, E, D, I]
    assert scanned["dense_layers"]["mlp"]["gate_proj"].shape == (2, 32, 16)  # [n_dense, D, I]
    for a, b in ((stacking.stack_layers(unrolled, cfg), scanned), (stacking.unstack_layers(scanned, cfg), unrolled)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)
    for i in range(cfg.num_layers):
        for x, y in zip(jax.tree.leaves(stacking.layer(scanned, cfg, i)), jax.tree.leaves(unrolled["layers"][i])):
            np.testing.assert_array_equal(x, y)
    assert stacking.is_stacked(("moe_layers", "mlp", "router")) and not stacking.is_stacked(("layers", 1, "mlp"))
    with pytest.raises(ValueError, match=r"layer=4: expected a layer id in \[0, num_layers=4\)"):
        stacking.layer(scanned, cfg, 4)


def test_router_bias_update_in_both_layouts():
    cfg = CONFIGS["dense_first"]
    load = jnp.asarray(np.random.default_rng(0).integers(0, 9, (cfg.num_moe_layers, cfg.num_experts)), jnp.float32)
    new = {}
    for scan in (True, False):
        _, _, rest = nnx.split(MoeTransformer(cfg.replace(scan_layers=scan), rngs=nnx.Rngs(0)), nnx.Param, ...)
        new[scan] = routers.update_state_biases(rest, load, cfg.moe_layer_ids, 0.01)
        for m, i in enumerate(cfg.moe_layer_ids):
            got = np.asarray(stacking.layer(new[scan], cfg, i)["mlp"]["router_bias"][...])
            want = 0.01 * np.sign(np.asarray(load[m]).mean() - np.asarray(load[m]))
            np.testing.assert_allclose(got, want, atol=1e-7)


def test_config_fields_are_validated():
    with pytest.raises(ValueError, match=r"MoeConfig.remat='some': expected one of 'none', 'full', 'dots'"):
        MoeConfig.tiny(remat="some")
    with pytest.raises(ValueError, match=r"MoeConfig.scan_min_layers=0: expected an int >= 1"):
        MoeConfig.tiny(scan_min_layers=0)
    with pytest.raises(ValueError, match=r"MoeConfig.scan_layers=1: expected a bool"):
        MoeConfig.tiny(scan_layers=1)
    assert MoeConfig.tiny().scan_layers is True
