"""The replaying train/eval step on real tiny-engine rollouts: zero mismatch with the engine's own
routes, replay removing a perturbed trainer's routing disagreement, router gradients under replay,
inert padding and uncaptured rows, and host-side validation."""

import dataclasses

import jax
import numpy as np
import pytest

from models import stacking
from r3jax import train
from r3jax.batch import collate
from r3jax.sharding import make_mesh


def _np(metrics):
    return {k: np.asarray(v) for k, v in metrics.items()}


def test_replay_with_engine_routes_same_dtype_has_zero_mismatch(tiny, rollout_batch, tx):
    cfg, model = tiny
    state = train.init_train_state(model, tx)
    m = _np(train.eval_step(state, rollout_batch, replay="rollout"))
    assert m["num_targets"] == 4 * 8
    assert m["fallback_fraction"] == 0.0  # the terminal gap only holds the last sampled token
    # the trainer's own router picks the engine's experts (same weights, same dtype)
    for k in ("live_routing_disagreement", "live_token_any_disagreement"):
        assert m[k] == 0.0, k
    assert m["live_routing_disagreement_per_layer"].tolist() == [0.0] * cfg.num_moe_layers
    assert m["mean_abs_delta"] < 1e-5
    assert m["k3_kl"] < 1e-9
    # the aux term enters the loss with the model's coefficient
    assert m["loss"] == pytest.approx(m["pg_loss"] + cfg.router_aux_loss_coef * m["aux_loss"], abs=1e-7)


def test_perturbed_trainer_disagrees_without_replay_and_not_with_it(tiny, rollout_batch, tx):
    _, model = tiny
    state = train.init_train_state(model, tx)
    noise = lambda p, k: p + 0.01 * jax.random.normal(k, p.shape, p.dtype)
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.PRNGKey(42), len(leaves))
    state = state.replace(params=jax.tree.unflatten(treedef, [noise(p, k) for p, k in zip(leaves, keys)]))
    off = _np(train.eval_step(state, rollout_batch, replay="none"))
    on = _np(train.eval_step(state, rollout_batch, replay="rollout"))
    assert off["live_routing_disagreement"] > 0.0
    assert off["live_token_any_disagreement"] > 0.0
    # under replay the reported disagreement is still the router's own: the first MoE layer's input
    # does not depend on any routing, so its router disagrees exactly as much as without replay
    first = off["live_routing_disagreement_per_layer"][0]
    assert first > 0.0 and on["live_routing_disagreement_per_layer"][0] == first
    assert off["mean_abs_delta"] > 1e-4  # the perturbation is visible in the logprobs too


def test_router_gets_gradient_under_replay(tiny, rollout_batch, tx, train_cfg):
    _, model = tiny
    state = train.init_train_state(model, tx)
    before = jax.device_get(state.params)
    state, m = train.train_step(state, rollout_batch, replay="rollout", config=train_cfg)
    after = jax.device_get(state.params)
    assert int(state.step) == 1
    assert float(m["grad_norm"]) > 0.0
    for i in model.config.moe_layer_ids:  # aux_coef=0: the policy loss alone moves the router
        router = lambda params: stacking.layer(params, model.config, i)["mlp"]["router"][...]
        delta = np.abs(router(after) - router(before))
        assert delta.max() > 0.0, f"layer {i} router got no gradient"


def _dirty(batch, rng):
    """Garbage everywhere the contract says is ignored: padding (segment 0) and uncaptured rows."""
    pad = np.asarray(batch.segment_ids) == 0
    unc = ~np.asarray(batch.route_mask)
    shape = batch.tokens.shape
    rnd = lambda hi: rng.integers(0, hi, shape).astype(np.int32)
    routes = np.asarray(batch.routes).copy()
    perm = np.stack([rng.permutation(8)[:2] for _ in range(routes[unc].shape[0] * routes.shape[2])])
    routes[unc] = perm.reshape(routes[unc].shape).astype(routes.dtype)
    return dataclasses.replace(
        batch,
        tokens=np.where(pad, rnd(272), batch.tokens), positions=np.where(pad, rnd(64), batch.positions),
        rollout_logprobs=np.where(pad, -1e30, batch.rollout_logprobs).astype(np.float32),
        advantages=np.where(pad, 1e9, batch.advantages).astype(np.float32), routes=routes)


def test_padding_and_uncaptured_rows_change_neither_loss_nor_aux(tiny, rollout_batch, tx):
    _, model = tiny
    state = train.init_train_state(model, tx)
    dirty = _dirty(rollout_batch, np.random.default_rng(0))
    assert not np.array_equal(dirty.routes, rollout_batch.routes)
    clean_m = _np(train.eval_step(state, rollout_batch, replay="rollout"))
    dirty_m = _np(train.eval_step(state, dirty, replay="rollout"))
    for k in ("loss", "pg_loss", "aux_loss", "mean_abs_delta", "live_routing_disagreement"):
        np.testing.assert_allclose(dirty_m[k], clean_m[k], rtol=1e-6, atol=1e-7, err_msg=k)

    # The aux loss is over real, *captured* tokens: change the (uncaptured) terminal token of each
    # row with its loss masked out; under replay nothing changes, live routing's aux does.
    last = (np.asarray(rollout_batch.segment_ids) > 0).sum(1) - 1
    rows = np.arange(4)
    assert not np.asarray(rollout_batch.route_mask)[rows, last].any()
    lm = np.asarray(rollout_batch.loss_mask).copy()
    lm[rows, last] = 0.0
    a = dataclasses.replace(rollout_batch, loss_mask=lm)
    tok = np.asarray(a.tokens).copy()
    tok[rows, last] = (tok[rows, last] + 101) % 272
    b = dataclasses.replace(a, tokens=tok)
    ma, mb = _np(train.eval_step(state, a, replay="rollout")), _np(train.eval_step(state, b, replay="rollout"))
    np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mb["aux_loss"], ma["aux_loss"], rtol=1e-6, atol=1e-7)
    na, nb = _np(train.eval_step(state, a, replay="none")), _np(train.eval_step(state, b, replay="none"))
    assert abs(float(nb["aux_loss"]) - float(na["aux_loss"])) > 1e-6  # the probe can see a change


def test_packed_layout_matches_padded(tiny, rollout_trajs, tx):
    """Two trajectories per row (segment ids, restarting positions) score like one per row."""
    cfg, model = tiny
    trajs = rollout_trajs
    padded = collate(trajs, seq_len=32, num_experts=cfg.num_experts, top_k=cfg.top_k,
                     num_layers=cfg.num_moe_layers)
    packed = collate(trajs, seq_len=32, packed=True, num_experts=cfg.num_experts, top_k=cfg.top_k,
                     num_layers=cfg.num_moe_layers)
    assert packed.tokens.shape == (2, 32) and int(np.asarray(packed.segment_ids).max()) == 2
    state = train.init_train_state(model, tx)
    a, b = _np(train.eval_step(state, padded)), _np(train.eval_step(state, packed))
    for k in ("loss", "pg_loss", "aux_loss", "mean_abs_delta", "k3_kl", "num_targets"):
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert b["live_routing_disagreement"] == 0.0 and b["fallback_fraction"] == 0.0


def test_no_captured_route_reads_nan_not_zero_disagreement(tiny, rollout_batch, tx):
    """A batch whose rollouts captured no route row: routing disagreement is NaN (nothing was
    compared), every target fell back to live routing, and the logprob metrics are still measured."""
    _, model = tiny
    state = train.init_train_state(model, tx)
    bare = dataclasses.replace(rollout_batch, route_mask=np.zeros_like(np.asarray(rollout_batch.route_mask)))
    m = _np(train.eval_step(state, bare, replay="rollout"))
    assert np.isnan(m["live_routing_disagreement"]) and np.isnan(m["live_token_any_disagreement"])
    assert np.isnan(m["live_routing_disagreement_per_layer"]).all()
    assert m["fallback_fraction"] == 1.0
    assert np.isfinite(m["mean_abs_delta"]) and np.isfinite(m["loss"])


def test_aux_coefficient_is_explicit_or_the_models():
    from models import MoeConfig

    assert train.loss.aux_coefficient(train.LossConfig(), MoeConfig.tiny(router_aux_loss_coef=0.03)) == 0.03
    assert train.loss.aux_coefficient(train.LossConfig(aux_coef=0.0), None) == 0.0
    with pytest.raises(ValueError, match=r"LossConfig.aux_coef=None: expected a float >= 0 \(the model config "
                                         r"NoneType has no router_aux_loss_coef"):
        train.loss.aux_coefficient(train.LossConfig(), None)


def test_reference_kl_enters_the_loss(tiny, rollout_batch, tx):
    cfg, model = tiny
    state = train.init_train_state(model, tx)
    ref = np.asarray(rollout_batch.rollout_logprobs) - 0.25 * np.asarray(rollout_batch.loss_mask)
    m = _np(train.eval_step(state, rollout_batch, config=train.LossConfig(kl_coef=0.5), ref_logprobs=ref))
    # log(π_ref/π) = -0.25 - Δ with Δ ~ 1e-7 here
    assert m["kl_ref"] == pytest.approx(np.exp(-0.25) - 1 + 0.25, rel=1e-4)
    assert m["loss"] == pytest.approx(m["pg_loss"] + 0.5 * m["kl_ref"] + cfg.router_aux_loss_coef * m["aux_loss"],
                                      abs=1e-6)
    with pytest.raises(ValueError, match=r"ref_logprobs shape=\(4, 31\): expected \[B, S\] = \(4, 32\)"):
        train.eval_step(state, rollout_batch, config=train.LossConfig(kl_coef=0.5), ref_logprobs=ref[:, :31])


def test_host_validation_errors(tiny, rollout_batch, tx, train_cfg):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with pytest.raises(ValueError, match=r"replay='always': expected one of \('rollout', 'trainer', 'none'\)"):
        train.eval_step(state, rollout_batch, replay="always")
    with pytest.raises(ValueError, match=r"ref_logprobs=None with LossConfig.kl_coef=0.1"):
        train.eval_step(state, rollout_batch, config=train.LossConfig(kl_coef=0.1))
    bad = dataclasses.replace(rollout_batch, routes=np.asarray(rollout_batch.routes)[:, :, :1])
    with pytest.raises(ValueError, match=r"batch.routes shape=\(4, 32, 1, 2\): expected \[B, S, L, K\] = \(4, 32, 2, 2\)"):
        train.eval_step(state, bad)
    bad = dataclasses.replace(rollout_batch, loss_mask=np.asarray(rollout_batch.loss_mask)[:, :31])
    with pytest.raises(ValueError, match=r"batch.loss_mask shape=\(4, 31\): expected \[B, S\]"):
        train.eval_step(state, bad)
    state8 = train.init_train_state(model, tx, mesh=make_mesh(2, 2, 2))
    three = jax.tree.map(lambda x: np.asarray(x)[:3], rollout_batch)
    with pytest.raises(ValueError, match=r"batch size B=3: expected a multiple of data x fsdp x expert = 8"):
        train.train_step(state8, three, config=train_cfg)
    explicit = make_mesh(8, 1, 1, axis_type=jax.sharding.AxisType.Explicit)
    with pytest.raises(ValueError, match=r"mesh.axis_types=.*expected all AxisType.Auto"):
        train.init_train_state(model, tx, mesh=explicit)


def test_bias_update_rate_moves_the_router_biases_by_the_replayed_load(tx, rollout_batch):
    """DeepSeek-V3's loss-free balancing in the train step: biases move by rate * sign(mean - load) of
    the load the step's forward counted (replayed experts over captured tokens), independently
    recomputed here; rate 0 leaves them alone."""
    import jax.numpy as jnp
    from flax import nnx

    from models import MoeConfig, MoeTransformer, Replay
    from models.routers import RouterBias

    cfg = MoeConfig.tiny().replace(router="sigmoid_bias_grouped", n_group=2, topk_group=1)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    b = rollout_batch
    captured = jnp.asarray(b.route_mask, bool)
    out = model(jnp.asarray(b.tokens), jnp.asarray(b.positions), replay=Replay(jnp.asarray(b.routes), captured),
                segment_ids=jnp.asarray(b.segment_ids), token_mask=(jnp.asarray(b.segment_ids) > 0) & captured)
    load = np.asarray(out.expert_load)  # [L, E] counted by the same forward, outside the step
    assert load.sum() > 0 and (load != load.mean(-1, keepdims=True)).any()
    biases = lambda s: np.asarray(jax.tree.leaves(nnx.split_state(s.rest, RouterBias, ...)[0])[0])
    rate = 0.01
    for r in (0.0, rate):
        state = train.init_train_state(model, tx)
        before = biases(state)
        state, m = train.train_step(state, b, replay="rollout", config=train.LossConfig(bias_update_rate=r))
        want = before + r * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_allclose(biases(state), want, atol=1e-7)
        assert float(m["expert_load_imbalance"]) == pytest.approx(
            float(np.mean(load.max(-1) / load.mean(-1))), rel=1e-5)
    with pytest.raises(ValueError, match=r"LossConfig.bias_update_rate=-1.0: expected >= 0"):
        train.LossConfig(bias_update_rate=-1.0)
    soft = train.init_train_state(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)), tx)  # no router_bias
    with pytest.raises(ValueError, match=r"LossConfig.bias_update_rate=0.01: expected 0 for a model without router_bias"):
        train.train_step(soft, b, replay="rollout", config=train.LossConfig(bias_update_rate=rate))
