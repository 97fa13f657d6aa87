"""The router-noise knob (MoeConfig.router_noise): Gaussian noise on the logits of the top-k selection
only, seeded by (position, MoE layer), off under replay and at 0."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import routers
from models.fields import FieldError
from models.replay import Replay

B, T = 4, 32
SIGMAS = (0.0, 0.1, 0.3, 1.0, 3.0)


@pytest.fixture(scope="module")
def setup():
    """(config, params state, tokens [B, T], positions [B, T], forward(sigma, replay=None) -> out)."""
    cfg = models.MoeConfig.tiny(moe_impl="dense")
    state = nnx.state(models.MoeTransformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def forward(sigma, replay=None):
        # one abstract model per sigma; the same parameters (the noise changes no shape)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.MoeTransformer(cfg.replace(router_noise=sigma),
                                                                               rngs=nnx.Rngs(0))))
        return nnx.merge(graphdef, state)(tokens, positions, replay)

    return cfg, state, tokens, positions, forward


def _differ(a, b):
    """Fraction of (token, layer) top-k sets that differ: routes [B, T, L, K]."""
    return float(np.mean(np.any(np.sort(np.asarray(a), -1) != np.sort(np.asarray(b), -1), axis=-1)))


def test_flip_fraction_rises_with_sigma(setup):
    _, _, _, _, forward = setup
    clean = forward(0.0)
    fractions = [_differ(forward(s).routes, clean.routes) for s in SIGMAS]
    assert fractions[0] == 0.0
    assert all(a < b for a, b in zip(fractions, fractions[1:])), fractions
    # sigma=0 is the plain model, bit for bit
    np.testing.assert_array_equal(forward(0.0).logits, clean.logits)


def test_noise_changes_the_selection_only(setup):
    """Gates come from the clean logits: routing with noise, then replaying the noisy choice without
    noise, gives the same output (the live choice under replay is the clean one)."""
    cfg, _, _, _, forward = setup
    noisy = forward(1.0)
    replayed = forward(0.0, Replay(routes=noisy.routes, mask=jnp.ones((B, T), bool)))
    np.testing.assert_allclose(noisy.logits, replayed.logits, rtol=1e-5, atol=1e-5)
    assert _differ(replayed.live_routes, noisy.routes) > 0


def test_replay_ids_override_the_noise(setup):
    cfg, _, _, _, forward = setup
    clean = forward(0.0)
    rng = np.random.default_rng(1)
    ids = np.argsort(rng.random((B, T, cfg.num_moe_layers, cfg.num_experts)), -1)[..., :cfg.top_k]
    replay = Replay(routes=jnp.asarray(ids, jnp.int32), mask=jnp.ones((B, T), bool))
    a, b = forward(0.0, replay), forward(3.0, replay)
    np.testing.assert_array_equal(a.routes, ids)
    np.testing.assert_array_equal(b.routes, ids)
    np.testing.assert_array_equal(a.live_routes, b.live_routes)  # no noise at all under replay
    # the first MoE layer's inputs do not depend on the replay: its live choice is the clean model's
    np.testing.assert_array_equal(a.live_routes[:, :, 0], clean.routes[:, :, 0])
    np.testing.assert_array_equal(a.logits, b.logits)


def test_noise_is_a_function_of_position_and_layer():
    pos = jnp.asarray([0, 5, 5, 7], jnp.int32)
    z0, z1 = routers.selection_noise(pos, 0, 8), routers.selection_noise(pos, 1, 8)
    assert z0.shape == (4, 8) and z0.dtype == jnp.float32
    np.testing.assert_array_equal(z0[1], z0[2])  # same position, same layer: same draw
    assert not np.array_equal(z0[1], z0[3]) and not np.array_equal(z0[1], z1[1])
    np.testing.assert_array_equal(z0[1:2], routers.selection_noise(pos[1:2], jnp.int32(0), 8))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "1"])
def test_router_noise_is_validated(bad):
    with pytest.raises(FieldError, match="router_noise") as e:
        models.MoeConfig.tiny(router_noise=bad)
    assert e.value.field == "MoeConfig.router_noise" and ">= 0" in e.value.expected


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_bias_grouped"])
def test_both_layouts_and_routers_draw_the_same_noise(setup, router):
    """The noise seed is the MoE layer index in either layer layout; the sigmoid router flips too."""
    _, _, tokens, positions, _ = setup
    extra = dict(n_group=2, topk_group=1) if router == "sigmoid_bias_grouped" else {}
    out = {}
    for scan in (True, False):
        cfg = models.MoeConfig.tiny(moe_impl="dense", router=router, scan_layers=scan, **extra)
        model = models.MoeTransformer(cfg, rngs=nnx.Rngs(0))
        noisy = models.MoeTransformer(cfg.replace(router_noise=1.0), rngs=nnx.Rngs(0))
        out[scan] = model(tokens, positions).routes, noisy(tokens, positions).routes
    np.testing.assert_array_equal(out[True][1], out[False][1])
    assert _differ(out[True][0], out[True][1]) > 0.3
