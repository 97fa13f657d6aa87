"""Truncated importance sampling across minibatch updates: the surrogate's ratio is taken against the
trainer's pre-update logprobs π_old, recorded once per rollout batch, so PPO's clip bounds how far
later updates move the policy, and each token's weight min(π_old / π_rollout, C) stays fixed."""

import jax
import numpy as np
import optax
import pytest

from r3jax.train import (LossConfig, eval_step, init_train_state, ppo_update, record_old_logprobs, token_logprobs,
                         train_step)

CFG = LossConfig(tis_cap=2.0)


def _scalars(m):
    return {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}


def test_old_logprobs_are_the_pre_update_forward(tiny, rollout_batch, tx):
    cfg, model = tiny
    b = rollout_batch
    state = init_train_state(model, tx)
    old = np.asarray(record_old_logprobs(state, b, replay="none", config=CFG))
    logits = state.model()(b.tokens, b.positions, segment_ids=b.segment_ids).logits
    ref = np.asarray(token_logprobs(logits, b.tokens))
    m = np.asarray(b.loss_mask) > 0
    assert old.shape == tuple(b.tokens.shape) and old.dtype == np.float32
    np.testing.assert_allclose(old[m], ref[m], atol=2e-5)
    assert (old[~m] == 0).all()


def test_ppo_update_clips_against_the_pre_update_policy(tiny, rollout_batch):
    cfg, model = tiny
    # large steps, so the policy moves far between updates on the same rows
    state = init_train_state(model, optax.sgd(30.0))
    state, hist = ppo_update(state, rollout_batch, replay="none", config=CFG, num_minibatches=2, epochs=2)
    hist = [_scalars(m) for m in hist]
    assert hist[0]["clip_fraction"] == 0.0  # update 1 runs on π_old itself: ratio 1
    # epoch 2 revisits rows the policy has been trained on: the ratio to π_old leaves the clip range
    assert hist[2]["clip_fraction"] > 0.0 and hist[3]["clip_fraction"] > 0.0, hist
    # the weights are π_old's, recorded once: the same rows weigh the same in both epochs, although
    # the current policy (and so its own ratio to the rollout) has moved
    for a, c in ((0, 2), (1, 3)):
        assert hist[c]["importance_weight"] == pytest.approx(hist[a]["importance_weight"], rel=1e-6)
        assert hist[c]["mean_abs_delta"] != pytest.approx(hist[a]["mean_abs_delta"], rel=1e-3)


def test_old_logprobs_only_with_tis(tiny, rollout_batch, tx):
    cfg, model = tiny
    state = init_train_state(model, tx)
    zeros = np.zeros(rollout_batch.tokens.shape, np.float32)
    with pytest.raises(ValueError, match=r"old_logprobs given with LossConfig.tis_cap=None"):
        eval_step(state, rollout_batch, replay="none", old_logprobs=zeros)
    with pytest.raises(ValueError, match=r"old_logprobs shape=\(4, 31\): expected \[B, S\] = \(4, 32\)"):
        train_step(state, rollout_batch, replay="none", config=CFG, old_logprobs=zeros[:, 1:])
