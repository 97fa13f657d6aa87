"""int8 and fp8 weight-only fake quantisation (models.quant): what they round, and what int8 / fp8
rollouts do.

The rollout cases use the engine API (``Engine.set_weights`` with the quantized params): the
tokens a greedy decode picks survive int8 weights when their margins are wide, while routes whose
router scores sit within one int8 step of each other do not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import stacking
from models.quant import FP8_MAX, fake_quant_fp8, fake_quant_int8, quantize_fp8, quantize_int8
from r3jax.engine import Engine, GenerateRequest


def _leaf(params, *names):
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if all(n in jax.tree_util.keystr(path) for n in names):
            return x
    raise KeyError(names)


def test_fake_quant_is_per_output_channel_symmetric_int8():
    w = jnp.array([[0.5, -2.0, 0.0], [-1.0, 1.0, 0.0], [0.25, 0.003, 0.0]], jnp.float32)  # [in=3, out=3]
    q = np.asarray(fake_quant_int8(w))
    s = np.array([1.0, 2.0, 1.0]) / 127  # max |w| per output column / 127; the zero column stays 0
    np.testing.assert_allclose(q, np.clip(np.round(np.asarray(w) / s), -127, 127) * s, rtol=1e-6)
    assert q[2, 1] == 0.0 and q[0, 1] == -2.0 and np.all(q[:, 2] == 0.0)
    # an expert bank [E, in, out] gets a scale per expert and output channel
    bank = jnp.stack([w, 10 * w])
    np.testing.assert_allclose(np.asarray(fake_quant_int8(bank))[1], 10 * q, rtol=1e-6)


def _unrolled(cfg, params):
    """Per-layer view (``layers/{i}``) of a params state in either layout, as a nested dict."""
    return stacking.to_layout(nnx.to_pure_dict(params), cfg, scan_layers=False)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_quantize_keeps_vocab_tables_norms_and_router_unless_asked(scan_layers):
    cfg = models.MoeConfig.tiny(scan_layers=scan_layers)
    model = models.MoeTransformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    q = quantize_int8(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(q)):
        assert a.shape == b.shape and a.dtype == b.dtype  # drops into Engine.set_weights
    params, q_router = _unrolled(cfg, params), _unrolled(cfg, quantize_int8(params, quantize_router=True))
    q = _unrolled(cfg, q)
    same = lambda *names: np.array_equal(_leaf(params, *names), _leaf(q, *names))
    assert same("embed") and same("lm_head") and same("final_norm") and same("[1]", "router")
    assert same("[1]", "input_norm") and same("[0]", "q_norm")  # 1-D per layer, also when stacked
    assert not same("[1]", "gate_proj") and not same("[0]", "attn", "q_proj")
    assert not np.array_equal(_leaf(params, "[1]", "router"), _leaf(q_router, "[1]", "router"))
    # each matrix is quantized on its own: the stacked layout gives exactly the per-layer result
    unrolled = models.MoeTransformer(cfg.replace(scan_layers=not scan_layers), rngs=nnx.Rngs(0))
    other = _unrolled(cfg, quantize_int8(nnx.state(unrolled, nnx.Param), quantize_router=True))
    for a, b in zip(jax.tree.leaves(q_router), jax.tree.leaves(other)):
        np.testing.assert_array_equal(a, b)


def _constructed_model():
    """Tiny model whose greedy argmax has a wide margin (the LM head reads the input token's
    embedding back, x20) and whose layer-1 router has 8 columns equal on an int8 grid plus per-column
    offsets below a quarter of the int8 step: fp32 ranks the experts by those offsets, int8 sees
    an exact 8-way tie (so top-k takes experts 0 and 1)."""
    cfg = models.MoeConfig.tiny()
    model = models.MoeTransformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    d, e = cfg.hidden_size, cfg.num_experts
    step = 0.1 / 127
    base = rng.integers(-126, 127, d).astype(np.float32)
    base[0] = 127  # the column max sits here: same scale for every column
    offsets = rng.uniform(-0.2, 0.2, (d, e)).astype(np.float32)
    offsets[0] = 0.0
    router = (base[:, None] + offsets) * step
    embed = np.asarray(_leaf(params, "embed"))
    lm_head = 20.0 * embed.T / np.mean(np.linalg.norm(embed, axis=1))

    pure = _unrolled(cfg, params)
    pure["lm_head"] = jnp.asarray(lm_head, jnp.float32)
    pure["layers"][1]["mlp"]["router"] = jnp.asarray(router, jnp.float32)
    nnx.replace_by_pure_dict(params, stacking.to_layout(pure, cfg, cfg.scan_layers))
    nnx.update(model, params)
    return cfg, model


def test_int8_rollouts_keep_greedy_tokens_and_change_close_routes():
    cfg, model = _constructed_model()
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, cfg.vocab_size, 6).tolist() for _ in range(4)]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=8, temperature=0.0, return_routed_experts=True)
            for p in prompts]
    engine = Engine(model, max_seq_len=32, max_batch_size=4)
    fp32 = engine.generate(reqs)
    engine.set_weights(quantize_int8(params, quantize_router=True))
    int8 = engine.generate(reqs)

    assert [o.output_ids for o in int8] == [o.output_ids for o in fp32]
    r32 = np.concatenate([np.asarray(o.routed_experts) for o in fp32])  # [N, L, K]
    r8 = np.concatenate([np.asarray(o.routed_experts) for o in int8])
    assert r32.shape == r8.shape == (4 * (6 + 8 - 1), cfg.num_moe_layers, cfg.top_k)
    sets = lambda r: np.sort(r, axis=-1)
    # layer 1 (the first MoE layer): int8 ties every expert, so each token takes {0, 1}; fp32 ranks
    # them by the offsets, so most tokens take another pair
    assert np.all(sets(r8[:, 0]) == [0, 1])
    differ = np.any(sets(r8[:, 0]) != sets(r32[:, 0]), axis=-1)
    assert differ.mean() > 0.5, differ.mean()


@pytest.mark.parametrize("quantize_router", [False, True])
def test_quantize_is_pure(quantize_router):
    model = models.MoeTransformer(models.MoeConfig.tiny(), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(params)]
    quantize_int8(params, quantize_router=quantize_router)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(params)))


def test_fake_quant_fp8_error_is_within_half_an_e4m3_step():
    rng = np.random.default_rng(0)
    # [E=2, in=64, out=6]: column 1 spans 2**-12 .. 1 (reaches e4m3's subnormals), column 5 is zero
    w = rng.normal(size=(2, 64, 6)).astype(np.float32)
    w[..., 1] = np.sign(w[..., 1]) * 2.0 ** rng.uniform(-12, 0, (2, 64))
    w[..., 5] = 0.0
    q = np.asarray(fake_quant_fp8(jnp.asarray(w)))
    amax = np.max(np.abs(w), axis=-2, keepdims=True)
    s = np.where(amax > 0, amax / FP8_MAX, 1.0)
    # e4m3: 3 mantissa bits, so a normal scaled value |x| in [2**e, 2**(e+1)) sits on a grid of step
    # 2**(e-3) and rounds by at most 2**(e-4) <= |x| * 2**-4; subnormals (|x| < 2**-6) step by 2**-9
    bound = np.maximum(np.abs(w) * 2.0 ** -4, s * 2.0 ** -10)
    assert np.all(np.abs(w - q) <= bound * (1 + 1e-6))
    # per channel: the worst case is the top binade [256, 448] (step 32): |w - q| <= 16 s = max|w| / 28
    assert np.all(np.max(np.abs(w - q), axis=-2, keepdims=True) <= amax / 28 * (1 + 1e-6))
    np.testing.assert_allclose(np.max(np.abs(q), axis=-2), amax[:, 0], rtol=1e-6)  # 448 is on the grid
    assert np.all(q[..., 5] == 0.0)
    i8 = np.asarray(fake_quant_int8(jnp.asarray(w)))
    assert not np.array_equal(q, w) and not np.array_equal(q, i8)
    # bf16 weights come back bf16
    assert fake_quant_fp8(jnp.asarray(w, jnp.bfloat16)).dtype == jnp.bfloat16


def test_quantize_fp8_rounds_the_leaves_int8_rounds():
    cfg = models.MoeConfig.tiny()
    params = nnx.state(models.MoeTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    for router in (False, True):
        p8 = jax.tree.leaves(quantize_fp8(params, quantize_router=router))
        i8 = jax.tree.leaves(quantize_int8(params, quantize_router=router))
        for a, f, i in zip(jax.tree.leaves(params), p8, i8):
            assert a.shape == f.shape and a.dtype == f.dtype
            assert np.array_equal(a, f) == np.array_equal(a, i)  # the same selection of leaves


def test_fp8_rollouts_change_logprobs_a_little_and_keep_the_route_contract():
    cfg = models.MoeConfig.tiny()
    model = models.MoeTransformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, cfg.vocab_size, 6).tolist() for _ in range(4)]
    starts = [0, 2, 6, 3]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=8, temperature=0.0, return_logprobs=True,
                            return_routed_experts=True, routed_experts_prompt_start=s)
            for p, s in zip(prompts, starts)]
    engine = Engine(model, max_seq_len=32, max_batch_size=4)  # the int8 test's engine: same programs
    try:
        fp32 = engine.generate(reqs)
        engine.set_weights(quantize_fp8(params))
        fp8 = engine.generate(reqs)
    finally:
        engine.close()
    deltas = []
    for a, b in zip(fp32, fp8):
        # compare while both decodes saw the same context: the greedy logprob is the max of the
        # log-softmax, so it is comparable at the first differing token too
        same = np.cumprod(np.asarray(a.output_ids) == np.asarray(b.output_ids))
        n = min(len(same), int(same.sum()) + 1)
        deltas.append(np.abs(np.asarray(a.logprobs[:n]) - np.asarray(b.logprobs[:n])))
    delta = np.concatenate(deltas)
    # nonzero: fp8 moves every quantized weight; bounded: log-softmax is 2-Lipschitz in the max-norm of
    # the logits, and weight errors of at most 2**-4 relative move this model's logits (spread about
    # 1.3) by a few hundredths, expert flips included (a full forward of this model: 0.046 at most over
    # the whole vocabulary, 6% of routes flipped); 0.5 would mean another model
    assert 0 < delta.max() < 0.5, delta.max()
    for r, out in zip(reqs, fp8):
        routes = np.asarray(out.routed_experts)
        p, s, g = len(r.prompt_ids), r.routed_experts_prompt_start, len(out.output_ids)
        assert routes.shape == (p - s + g - 1, cfg.num_moe_layers, cfg.top_k)
        assert routes.dtype == np.asarray(fp32[0].routed_experts).dtype == np.uint8
        assert routes.min() >= 0 and routes.max() < cfg.num_experts
        assert np.all(np.sort(routes, axis=-1)[..., 1:] != np.sort(routes, axis=-1)[..., :-1])
