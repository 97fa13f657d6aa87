"""r3jax.metrics: hand-computed values, masking, set semantics, packed-segment shift."""

import math

import jax
import numpy as np
import pytest

from r3jax import metrics as mm

# jitted: one compilation per call site instead of one per eager op
logprob_mismatch = jax.jit(mm.logprob_mismatch)
routing_disagreement = jax.jit(mm.routing_disagreement)
mismatch_metrics = jax.jit(mm.mismatch_metrics)


def test_logprob_mismatch_hand_values_and_masked_garbage():
    train = np.array([[-1.0, -1.1, -2.0, -0.5, 0.0]], np.float32)
    rollout = np.array([[-1.0, -1.2, -1.2, -0.5, np.nan]], np.float32)  # NaN sits under mask 0
    loss_mask = np.array([[0, 1, 1, 1, 0]], np.float32)
    out = {k: float(v) for k, v in logprob_mismatch(train, rollout, loss_mask).items()}
    delta = np.array([0.1, -0.8, 0.0])
    assert out["mean_abs_delta"] == pytest.approx(np.abs(delta).mean(), abs=1e-6)
    assert out["k3_kl"] == pytest.approx(np.mean(np.exp(delta) - 1 - delta), abs=1e-6)
    assert out["f2"] == pytest.approx(1 / 3)  # only |-0.8| > ln 2
    assert out["abs_delta_p99"] == pytest.approx(np.percentile(np.abs(delta), 99), abs=1e-6)  # garbage excluded
    assert out["abs_delta_max"] == pytest.approx(0.8, abs=1e-6)
    assert 0.8 > math.log(2) > 0.1


def _nan(v):
    return bool(np.all(np.isnan(np.asarray(v))))


def test_empty_loss_mask_gives_nan_not_a_perfect_score():
    z = np.zeros((2, 3), np.float32)
    out = mismatch_metrics(train_logprobs=z, rollout_logprobs=z, loss_mask=z,
                           live_routes=np.zeros((2, 3, 2, 2), np.int32),
                           rollout_routes=np.ones((2, 3, 2, 2), np.int32),
                           route_mask=np.zeros((2, 3), bool))
    assert sorted(k for k, v in out.items() if not _nan(v)) == []
    assert np.asarray(out["live_routing_disagreement_per_layer"]).shape == (2,)
    assert _nan(mm.target_entropy(np.zeros((2, 3, 4), np.float32), z))


def test_all_false_route_mask_gives_nan_disagreement():
    # targets exist, but no route row was captured: nothing to compare routing with (NaN), every
    # target fell back to live routing (1.0), and the logprob metrics are unaffected
    loss_mask = np.array([[0, 1, 1, 1]], np.float32)
    lp = np.array([[0.0, -1.0, -1.0, -1.0]], np.float32)
    out = mismatch_metrics(train_logprobs=lp, rollout_logprobs=lp - 0.5 * loss_mask, loss_mask=loss_mask,
                           live_routes=np.zeros((1, 4, 2, 2), np.int32),
                           rollout_routes=np.ones((1, 4, 2, 2), np.int32),
                           route_mask=np.zeros((1, 4), bool))
    for k in ("live_routing_disagreement", "live_routing_disagreement_per_layer", "live_token_any_disagreement"):
        assert _nan(out[k]), (k, out[k])
    assert float(out["fallback_fraction"]) == 1.0
    assert float(out["mean_abs_delta"]) == pytest.approx(0.5)
    # no MoE layer at all: nothing compared either
    none = routing_disagreement(np.zeros((1, 4, 0, 2), np.int32), np.zeros((1, 4, 0, 2), np.int32),
                                np.ones((1, 4), bool), loss_mask)
    assert _nan(none["routing_disagreement"]) and np.asarray(none["routing_disagreement_per_layer"]).shape == (0,)


def test_masked_mean_empty_is_nan_with_a_finite_gradient():
    x = np.array([1.0, np.inf, 3.0], np.float32)
    assert float(mm.masked_mean(x, np.array([1, 0, 1]))) == 2.0
    assert _nan(mm.masked_mean(x, np.zeros(3)))
    # a loss over no target is NaN, but its gradient is 0, so a step on it cannot poison the weights
    g = jax.grad(lambda v: mm.masked_mean(v * v, np.zeros(3)))(np.array([1.0, 2.0, 3.0], np.float32))
    assert np.asarray(g).tolist() == [0.0, 0.0, 0.0]
    g = jax.grad(lambda v: mm.masked_mean(v * v, np.array([1, 0, 1])))(np.array([1.0, 2.0, 3.0], np.float32))
    assert np.asarray(g).tolist() == [1.0, 0.0, 3.0]


def test_route_sets_ignore_order_and_dtype():
    a = np.array([[[[1, 2], [3, 4]]]], np.int32)
    b = np.array([[[[2, 1], [3, 5]]]], np.uint8)
    assert np.asarray(mm.route_set_differs(a, b)).tolist() == [[[False, True]]]


def test_routing_disagreement_counts_predicting_captured_positions():
    # S=5, L=2, K=2. loss_mask marks targets 2..4, so positions 1..3 predict them; rows exist for
    # 0..2 only, so routing is measured at positions 1 and 2.
    rollout = np.zeros((1, 5, 2, 2), np.int32)
    rollout[..., 1] = 1
    live = rollout.copy()
    live[0, 0, 0] = [5, 6]  # position 0 predicts no target: ignored
    live[0, 1, 0] = [1, 7]  # counted: layer 0 differs
    live[0, 3, 1] = [4, 6]  # no row at 3: ignored
    loss_mask = np.array([[0, 0, 1, 1, 1]], np.float32)
    route_mask = np.array([[1, 1, 1, 0, 0]], bool)
    out = routing_disagreement(live, rollout, route_mask, loss_mask)
    assert np.asarray(out["routing_disagreement_per_layer"]).tolist() == [0.5, 0.0]
    assert float(out["routing_disagreement"]) == 0.25
    assert float(out["token_any_disagreement"]) == 0.5
    # predicting positions 1, 2, 3; position 3 has no row
    assert float(mm.fallback_fraction(route_mask, loss_mask)) == pytest.approx(1 / 3)


def test_predicting_mask_never_crosses_packed_segments():
    # one row, segment 1 = 3 tokens, segment 2 = 2 tokens; loss_mask 0 at each segment start
    loss_mask = np.array([[0, 1, 1, 0, 1]], np.float32)
    assert np.asarray(mm.predicting_mask(loss_mask)).tolist() == [[True, True, False, True, False]]


def test_reported_disagreement_is_the_routers_own():
    # the routes a replaying trainer uses are the rollout's wherever a row exists, so only the
    # router's own (live) top-k is compared, and no used-vs-rollout metric is reported
    rollout = np.zeros((1, 3, 1, 2), np.int32)
    rollout[..., 1] = 1
    live = rollout.copy()
    live[0, 0, 0] = [2, 3]
    out = mismatch_metrics(train_logprobs=np.zeros((1, 3)), rollout_logprobs=np.zeros((1, 3)),
                           loss_mask=np.array([[0, 1, 1]]), live_routes=live, rollout_routes=rollout,
                           route_mask=np.ones((1, 3), bool))
    assert float(out["live_routing_disagreement"]) == 0.5
    assert float(out["live_token_any_disagreement"]) == 0.5
    assert [k for k in out if "disagreement" in k and not k.startswith("live_")] == []
    with pytest.raises(TypeError, match="used_routes"):
        mm.mismatch_metrics(train_logprobs=np.zeros((1, 3)), rollout_logprobs=np.zeros((1, 3)),
                            loss_mask=np.array([[0, 1, 1]]), live_routes=live, rollout_routes=rollout,
                            route_mask=np.ones((1, 3), bool), used_routes=rollout)


def test_collapse_detector_on_synthetic_curves():
    rise = [0.1, 0.2, 0.3, 0.4]
    # falls below half the peak (0.4 -> < 0.2) and stays 5 steps: collapse starts at index 4
    assert mm.collapse_step(rise + [0.1, 0.0, 0.05, 0.1, 0.15, 0.3]) == 4
    # a 4-step dip then recovery is not a collapse; neither is a fall to exactly half the peak
    assert mm.collapse_step(rise + [0.1, 0.0, 0.0, 0.1, 0.4, 0.4]) is None
    assert mm.collapse_step(rise + [0.2] * 8) is None
    # a late fall with fewer than 5 steps left is not (yet) a collapse
    assert mm.collapse_step(rise + [0.0] * 4) is None
    # the peak is the running one: after a later, higher peak, a fall below half of it counts
    assert mm.collapse_step([0.2, 0.15, 0.8, 0.7, 0.3, 0.3, 0.3, 0.3, 0.3]) == 4
    # flat or noisy-but-stable curves never collapse; an all-zero curve has no positive peak
    rng = np.random.default_rng(0)
    assert mm.collapse_step(0.5 + 0.1 * rng.standard_normal(200)) is None
    assert mm.collapse_step([0.0] * 10) is None
    assert mm.collapse_step(rise + [0.1] * 3, patience=3) == 4
    with pytest.raises(ValueError, match="patience=0: expected >= 1"):
        mm.collapse_step(rise, patience=0)


def test_mean_ci95_uses_student_t():
    mean, half = mm.mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(half, 4.303 * 1.0 / math.sqrt(3), rel_tol=1e-9)
    mean, half = mm.mean_ci95([0.5] * 5)
    assert mean == 0.5 and half == 0.0
    assert math.isnan(mm.mean_ci95([0.7])[1])
    with pytest.raises(ValueError, match=r"values=\[\]: expected at least one value"):
        mm.mean_ci95([])


def test_target_entropy_reads_the_predicting_position():
    v = 4
    logits = np.zeros((1, 3, v), np.float32)  # uniform at position 0: entropy ln 4
    logits[0, 1] = [100.0, 0.0, 0.0, 0.0]  # one-hot at position 1: entropy 0
    logits[0, 2] = np.nan  # never read: no target after it
    assert math.isclose(float(mm.target_entropy(logits, np.array([[0.0, 1.0, 0.0]]))), math.log(v), rel_tol=1e-6)
    assert float(mm.target_entropy(logits, np.array([[0.0, 0.0, 1.0]]))) < 1e-6
