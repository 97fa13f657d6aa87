"""Behaviour logprobs from processed-mode rollouts: with ``LossConfig(temperature=T)`` the fp32 trainer's
logprobs equal the engine's at temperature T, so the importance weight is 1 on its own rollouts (and it
is not with the temperature-1 trainer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Replay
from r3jax import train
from r3jax.batch import collate
from r3jax.engine import GenerateRequest
from r3jax.trace import RoutedExpertTrace

T = 0.7
PROMPT_LENS, MAX_TOKENS, ADVANTAGES = (4, 5, 6, 7), 8, (1.0, -1.0, 0.5, -0.5)  # the conftest's batch shape


def _processed_rollouts(engine, cfg):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, cfg.vocab_size, p).tolist() for p in PROMPT_LENS]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, temperature=T, seed=50 + i, return_routed_experts=True,
                            logprobs_mode="processed_logprobs") for i, p in enumerate(prompts)]
    trajs = []
    for prompt, out, adv in zip(prompts, engine.generate(reqs), ADVANTAGES):
        p, g = len(prompt), len(out.output_ids)
        loss_mask = np.array([0.0] * p + [1.0] * g, np.float32)
        trace = RoutedExpertTrace().record(prompt_len=p, generated_len=g, routes=out.routed_experts)
        routes, captured = trace.finalize(token_count=p + g, loss_mask=loss_mask)
        trajs.append(dict(tokens=np.array(prompt + list(out.output_ids), np.int32), loss_mask=loss_mask,
                          rollout_logprobs=np.array([0.0] * p + list(out.logprobs), np.float32),
                          advantage=adv, routes=routes, captured=captured))
    return collate(trajs, seq_len=32, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers)


@pytest.fixture(scope="module")
def processed_batch(tiny, engine):
    return _processed_rollouts(engine, tiny[0])


def test_trainer_at_the_rollout_temperature_has_importance_weight_one(tiny, processed_batch, tx):
    _, model = tiny
    b = processed_batch
    # per token: the trainer's fp32 forward (replaying the rollout's routes) and its logprobs at T
    graphdef, state = nnx.split(model)

    @jax.jit
    def trainer_logprobs(state, tokens, positions, segment_ids, routes, mask):
        out = nnx.merge(graphdef, state)(tokens, positions, replay=Replay(routes, mask), segment_ids=segment_ids,
                                         token_mask=segment_ids > 0)
        return train.token_logprobs(out.logits, tokens, T), train.token_logprobs(out.logits, tokens)

    at_t, at_1 = jax.device_get(trainer_logprobs(state, b.tokens, b.positions, b.segment_ids, b.routes,
                                                 jnp.asarray(b.route_mask)))
    m = np.asarray(b.loss_mask) > 0
    assert m.sum() == 4 * MAX_TOKENS
    ratio = np.exp(at_t[m] - np.asarray(b.rollout_logprobs)[m])
    np.testing.assert_allclose(ratio, 1.0, atol=1e-5)
    assert np.abs(np.exp(at_1[m] - np.asarray(b.rollout_logprobs)[m]) - 1).max() > 1e-2  # temperature matters

    # and the train step's own metrics: truncated-IS weight 1, no logprob mismatch, at T only
    st = train.init_train_state(model, tx)
    tempered = train.eval_step(st, b, replay="rollout", config=train.LossConfig(tis_cap=2.0, temperature=T))
    plain = train.eval_step(st, b, replay="rollout", config=train.LossConfig(tis_cap=2.0))
    assert float(tempered["importance_weight"]) == pytest.approx(1.0, abs=1e-5)
    assert float(tempered["mean_abs_delta"]) < 1e-5 and float(tempered["k3_kl"]) < 1e-9
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


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "0.7"])
def test_bad_loss_temperature_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"LossConfig\.temperature="):
        train.LossConfig(temperature=bad)
