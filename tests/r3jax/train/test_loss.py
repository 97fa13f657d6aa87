"""Loss pieces: shifted token logprobs, clipped surrogate, truncated IS, reference KL, advantages."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.train import LossConfig, group_advantages, policy_loss, token_logprobs


def test_token_logprobs_shift_against_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, (2, 5)).astype(np.int32)
    lp = np.asarray(jax.jit(token_logprobs)(logits, tokens))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert lp[:, 0].tolist() == [0.0, 0.0]
    for b in range(2):
        for i in range(1, 5):
            assert lp[b, i] == pytest.approx(ref[b, i - 1, int(tokens[b, i])], abs=1e-5)


def _row(*xs):
    return jnp.asarray([xs], jnp.float32)


def test_clipped_surrogate_values_clip_fraction_and_gradient():
    old = _row(-1.0, -1.0, -1.0, -1.0)
    lp = old + _row(math.log(1.5), math.log(0.5), math.log(1.1), 0.0)
    adv = _row(1.0, -1.0, 1.0, 5.0)
    mask = _row(1, 1, 1, 0)  # the last token is padding
    cfg = LossConfig(clip_eps=0.2)
    loss, stats = policy_loss(lp, old, adv, mask, cfg)
    # min(r A, clip(r) A): 1.5 -> 1.2; 0.5 * -1 -> 0.8 * -1 = -0.8; 1.1 unclipped
    assert float(loss) == pytest.approx(-(1.2 - 0.8 + 1.1) / 3, abs=1e-6)
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 3)
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, old, adv, mask, cfg)[0])(lp))
    np.testing.assert_allclose(grad, [[0.0, 0.0, -1.1 / 3, 0.0]], atol=1e-6)


def test_asymmetric_upper_clip():
    old = _row(0.0)
    lp = old + math.log(1.5)
    loss, _ = policy_loss(lp, old, _row(1.0), _row(1), LossConfig(clip_eps=0.2, clip_eps_high=0.28))
    assert float(loss) == pytest.approx(-1.28, abs=1e-6)


def test_truncated_importance_weights():
    old = _row(-1.0, -1.0)
    lp = old + _row(math.log(3.0), math.log(0.5))
    adv = _row(1.0, 1.0)
    cfg = LossConfig(tis_cap=2.0)
    loss, stats = policy_loss(lp, old, adv, _row(1, 1), cfg)
    # ratio against the trainer's own logprobs is 1; weights min(3, 2) = 2 and 0.5
    assert float(loss) == pytest.approx(-(2.0 + 0.5) / 2, abs=1e-6)
    assert float(stats["importance_weight"]) == pytest.approx(1.25, abs=1e-6)
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, old, adv, _row(1, 1), cfg)[0])(lp))
    np.testing.assert_allclose(grad, [[-1.0, -0.25]], atol=1e-6)


def test_reference_kl_term():
    lp, ref = _row(-1.0, -2.0), _row(-1.5, -1.0)
    loss, stats = policy_loss(lp, lp, _row(0.0, 0.0), _row(1, 1), LossConfig(kl_coef=0.5), ref)
    log_r = np.array([-0.5, 1.0])
    kl = np.mean(np.exp(log_r) - 1 - log_r)
    assert float(stats["kl_ref"]) == pytest.approx(kl, abs=1e-6)
    assert float(loss) == pytest.approx(0.5 * kl, abs=1e-6)


def test_garbage_under_padding_is_inert():
    clean, _ = policy_loss(_row(-1.0, 0.0), _row(-1.1, 0.0), _row(1.0, 0.0), _row(1, 0), LossConfig())
    dirty, _ = policy_loss(_row(-1.0, 50.0), _row(-1.1, -1e30), _row(1.0, np.nan), _row(1, 0),
                           LossConfig(tis_cap=2.0))
    assert np.isfinite(float(dirty))
    clean_tis, _ = policy_loss(_row(-1.0, 0.0), _row(-1.1, 0.0), _row(1.0, 0.0), _row(1, 0),
                               LossConfig(tis_cap=2.0))
    assert float(dirty) == float(clean_tis)
    assert np.isfinite(float(clean))


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 2.0, 2.0, 5.0], [0, 0, 1, 1, 2])
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0, 0.0], atol=1e-5)
    np.testing.assert_allclose(group_advantages([1.0, 3.0], [7, 7], scale=False), [-1.0, 1.0])
    with pytest.raises(ValueError, match=r"group_ids shape=\(3,\): expected \(2,\)"):
        group_advantages([1.0, 2.0], [0, 0, 1])


@pytest.mark.parametrize("kw, msg", [
    (dict(clip_eps=0.0), r"LossConfig.clip_eps=0.0: expected in \(0, 1\)"),
    (dict(tis_cap=0.5), r"LossConfig.tis_cap=0.5: expected None or >= 1"),
    (dict(kl_coef=-1.0), r"LossConfig.kl_coef=-1.0: expected >= 0"),
])
def test_loss_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LossConfig(**kw)


def test_tis_ratio_is_taken_against_the_old_logprobs():
    rollout = _row(-1.0, -1.0)
    old_train = rollout + _row(math.log(3.0), math.log(0.5))  # π_old / π_rollout = 3 and 0.5
    lp = old_train + math.log(1.5)  # the updates moved both tokens' ratio π / π_old to 1.5
    adv = _row(1.0, 1.0)
    cfg = LossConfig(tis_cap=2.0, clip_eps=0.2)
    loss, stats = policy_loss(lp, rollout, adv, _row(1, 1), cfg, old_logprobs=old_train)
    # ratios clipped to 1.2; weights min(3, 2) = 2 and 0.5 from π_old, not from the current π
    assert float(loss) == pytest.approx(-(2.0 * 1.2 + 0.5 * 1.2) / 2, abs=1e-5)
    assert float(stats["clip_fraction"]) == 1.0
    assert float(stats["importance_weight"]) == pytest.approx(1.25, abs=1e-6)
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, rollout, adv, _row(1, 1), cfg, old_logprobs=old_train)[0])(lp))
    np.testing.assert_allclose(grad, [[0.0, 0.0]], atol=1e-6)  # both clipped: no gradient


def test_icepop_masks_tokens_whose_ratio_leaves_the_band():
    """IcePop (α, β) = (0.5, 2): weights π_train / π_rollout inside the band, 0 outside (not capped, as TIS
    would): of ratios 3, 1.5, 0.25 and 0.5 only 1.5 and 0.5 count."""
    old = _row(-1.0, -1.0, -1.0, -1.0)
    lp = old + _row(math.log(3.0), math.log(1.5), math.log(0.25), math.log(0.5))
    adv = _row(1.0, 1.0, 1.0, 1.0)
    cfg = LossConfig(icepop=(0.5, 2.0))
    loss, stats = policy_loss(lp, old, adv, _row(1, 1, 1, 1), cfg)
    assert float(loss) == pytest.approx(-(1.5 + 0.5) / 4, abs=1e-6)  # ratio vs the trainer's own: 1
    assert float(stats["icepop_masked"]) == pytest.approx(0.5) and float(stats["importance_weight"]) == \
        pytest.approx((1.5 + 0.5) / 4, abs=1e-6)
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, old, adv, _row(1, 1, 1, 1), cfg)[0])(lp))
    np.testing.assert_allclose(grad, [[0.0, -1.5 / 4, 0.0, -0.5 / 4]], atol=1e-6)  # masked tokens: no gradient
    assert cfg.corrects and LossConfig(tis_cap=2.0).corrects and not LossConfig().corrects
    for bad, msg in ((dict(icepop=(2.0, 5.0)), "icepop"), (dict(icepop=(0.5,)), "icepop"),
                     (dict(icepop=(0.5, 2.0), tis_cap=2.0), "one correction")):
        with pytest.raises(ValueError, match=msg):
            LossConfig(**bad)
