"""Engine(router_noise=sigma): rollouts whose router selection sees simulated noise (a mismatch knob),
while the model the engine was built from (the trainer's) stays noiseless."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeTransformer
from r3jax.checks import FieldError
from r3jax.engine import GenerateRequest

SIGMA = 1.0
REF_LEN = 64  # the shared engine configuration's max_seq_len (conftest.ENGINE_KW)


def _forward(model_cfg, state):
    """Jitted full-sequence forward ``tokens [4, REF_LEN] -> (logits, live_routes)`` of ``state`` under
    ``model_cfg`` (its graphdef; the parameters are shared)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: MoeTransformer(model_cfg, rngs=nnx.Rngs(0))))

    @jax.jit
    def fwd(state, tokens):
        positions = jnp.broadcast_to(jnp.arange(REF_LEN, dtype=jnp.int32), tokens.shape)
        out = nnx.merge(graphdef, state)(tokens, positions)
        return out.logits, out.live_routes

    return lambda tokens: jax.device_get(fwd(state, tokens))


def _requests():
    rng = np.random.default_rng(0)
    return [GenerateRequest(prompt_ids=rng.integers(1, 272, p).tolist(), max_tokens=g, temperature=0.0,
                            return_routed_experts=True, routed_experts_prompt_start=s)
            for p, g, s in [(5, 9, 0), (40, 6, 3), (12, 12, 12), (20, 4, 7)]]


def _tokens(reqs, outs):
    tokens = np.zeros((4, REF_LEN), np.int32)
    for r, (req, out) in enumerate(zip(reqs, outs)):
        seq = list(req.prompt_ids) + out.output_ids[:-1]
        tokens[r, :len(seq)] = seq
    return tokens


def test_noisy_engine_routes_follow_the_noisy_model_and_the_trainer_is_untouched(tiny_model, make_engine):
    cfg = tiny_model.config
    state = nnx.state(tiny_model)
    clean_fwd = _forward(cfg, state)
    probe = np.random.default_rng(1).integers(1, cfg.vocab_size, (4, REF_LEN)).astype(np.int32)
    before = clean_fwd(probe)

    engine = make_engine(tiny_model, router_noise=SIGMA)
    assert engine.config.router_noise == SIGMA and tiny_model.config.router_noise == 0.0
    reqs = _requests()
    outs = engine.generate(reqs)

    # the trainer's model: same config, bit-identical logits and routes after the engine was built and ran
    after = clean_fwd(probe)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    assert tiny_model.config is cfg and cfg.router_noise == 0.0

    # the engine's rows are the noisy model's live routes (prefill chunks and decode steps: the noise
    # depends on position and layer only), and differ from the clean model's on the same tokens
    tokens = _tokens(reqs, outs)
    _, noisy_live = _forward(cfg.replace(router_noise=SIGMA), state)(tokens)
    _, clean_live = clean_fwd(tokens)
    flips = []
    for r, (req, out) in enumerate(zip(reqs, outs)):
        p, s, g = len(req.prompt_ids), req.routed_experts_prompt_start, len(out.output_ids)
        rows = np.asarray(out.routed_experts)
        assert rows.shape == (p - s + g - 1, cfg.num_moe_layers, cfg.top_k) and rows.dtype == np.uint8
        assert rows.min() >= 0 and rows.max() < cfg.num_experts
        srt = np.sort(rows, axis=-1)
        assert np.all(srt[..., 1:] != srt[..., :-1])
        np.testing.assert_array_equal(rows, noisy_live[r, s:p + g - 1])
        flips.append(np.any(srt != np.sort(clean_live[r, s:p + g - 1], -1), axis=-1))
    assert np.concatenate(flips).mean() > 0.3  # sigma=1 is well above the tiny router's logit spread

    # deterministic: the same requests give the same routes
    again = engine.generate(reqs)
    for a, b in zip(outs, again):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_negative_router_noise_is_refused_naming_the_argument(tiny_model, make_engine):
    with pytest.raises(FieldError, match="router_noise") as e:
        make_engine(tiny_model, router_noise=-0.5)
    assert e.value.field == "router_noise" and e.value.value == -0.5 and ">= 0" in e.value.expected
