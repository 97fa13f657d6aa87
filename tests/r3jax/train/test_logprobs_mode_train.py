"""Behaviour logprobs from processed-mode rollouts: with ``LossConfig(temperature=T, top_k, top_p)`` as
sampled, the fp32 trainer's logprobs equal the engine's, so the importance weight is 1 on its own
rollouts (and it is not with the temperature-1 trainer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Replay
from r3jax import train
from r3jax.batch import collate

T = 0.7
MAX_TOKENS = 8  # the conftest's rollouts


def _processed_rollouts(sample_rollouts, engine, cfg, top_k, top_p):
    trajs = sample_rollouts(engine, cfg, seed=7, request_seed=50, temperature=T, top_k=top_k, top_p=top_p,
                            logprobs_mode="processed_logprobs")
    return collate(trajs, seq_len=32, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers)


@pytest.fixture(scope="module")
def replayed_logits(tiny):
    """``fn(batch) -> logits [B, S, V]``: the trainer's fp32 forward replaying the rollout's routes."""
    graphdef, state = nnx.split(tiny[1])

    @jax.jit
    def fwd(state, tokens, positions, segment_ids, routes, mask):
        return nnx.merge(graphdef, state)(tokens, positions, replay=Replay(routes, mask), segment_ids=segment_ids,
                                          token_mask=segment_ids > 0).logits

    return lambda b: fwd(state, b.tokens, b.positions, b.segment_ids, b.routes, jnp.asarray(b.route_mask))


def _ratios(logits, b, *process):
    lp = np.asarray(train.token_logprobs(logits, jnp.asarray(b.tokens), *process))
    m = np.asarray(b.loss_mask) > 0
    assert m.sum() == 4 * MAX_TOKENS
    return np.exp(lp[m] - np.asarray(b.rollout_logprobs)[m])


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.9)])
def test_trainer_matching_the_rollout_has_importance_weight_one(tiny, engine, tx, replayed_logits, sample_rollouts,
                                                                top_k, top_p):
    cfg, model = tiny
    b = _processed_rollouts(sample_rollouts, engine, cfg, top_k, top_p)
    logits = replayed_logits(b)
    # per token: exp(train_lp - rollout_lp) == 1 with the rollout's processing, and not without it
    np.testing.assert_allclose(_ratios(logits, b, T, top_k, top_p), 1.0, atol=1e-5)
    assert np.abs(_ratios(logits, b) - 1).max() > 1e-2  # the temperature-1 trainer
    if top_k:
        assert np.abs(_ratios(logits, b, T) - 1).max() > 1e-2  # tempered but not truncated

    # the train step's own metrics: truncated-IS weight 1 and no logprob mismatch at the matching config
    st = train.init_train_state(model, tx)
    config = train.LossConfig(tis_cap=2.0, temperature=T, top_k=top_k, top_p=top_p, logits_chunk=12)
    m = train.eval_step(st, b, replay="rollout", config=config)
    assert float(m["importance_weight"]) == pytest.approx(1.0, abs=1e-5)
    assert float(m["mean_abs_delta"]) < 1e-5 and float(m["k3_kl"]) < 1e-9
    if not top_k:
        plain = train.eval_step(st, b, replay="rollout", config=train.LossConfig(tis_cap=2.0))
        assert float(plain["mean_abs_delta"]) > 1e-2


def test_token_logprobs_divide_by_the_temperature():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 4, 9)).astype(np.float32)
    tokens = rng.integers(0, 9, (2, 4)).astype(np.int32)
    got = np.asarray(train.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 0.5))
    z = logits.astype(np.float64)[:, :-1] / 0.5
    ref = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(ref, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got[:, 1:], want, atol=1e-5)
    assert got[:, 0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("field, bad", [("temperature", 0.0), ("temperature", -1.0), ("temperature", float("inf")),
                                        ("temperature", float("nan")), ("temperature", True), ("temperature", "0.7"),
                                        ("top_k", -1), ("top_k", 2.0), ("top_k", True), ("top_p", 0.0),
                                        ("top_p", 1.5), ("top_p", float("nan"))])
def test_bad_loss_processing_is_refused_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=rf"LossConfig\.{field}="):
        train.LossConfig(**{field: bad})


def test_truncated_logprobs_renormalise_over_the_kept_set_and_keep_the_target():
    logits = np.log(np.array([[[0.5, 0.3, 0.15, 0.05]] * 3], np.float32))  # [1, 3, 4]
    tokens = np.array([[0, 1, 3]], np.int32)  # targets 1 (kept by top_k=2) and 3 (outside: kept as the target)
    got = np.asarray(train.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 1.0, 2))
    np.testing.assert_allclose(got[0, 1:], [np.log(0.3 / 0.8), np.log(0.05 / 0.85)], rtol=1e-5)
