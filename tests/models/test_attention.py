"""Attention kernels (models/attention.py) against the einsum reference: blockwise forward and gradient
(causal, packed segments, GQA, MLA-shaped heads, cache decode and chunks, padded rows, lengths off the
block), bf16, the model with each kernel, no S x S buffer in a compiled 2k-token train step (and one in
the reference's, so the check can fail), the splash kernel in Pallas interpret mode and compiled for a
TPU topology, and the config field."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from models.attention import ATTENTION_IMPLS, attention, reference_attention, resolve_impl
from models.blockwise import blockwise_attention, pick_block
from models.fields import FieldError

# (name, B, T, S, H, Hkv, Dh, Dv_real, form): Dv_real < Dh pads v with zeros as MLA does
CASES = {
    "causal_gqa_off_block": (2, 201, 201, 4, 2, 16, 16, "full"),      # 201: padded to 4 blocks of 64
    "segments": (2, 160, 160, 4, 2, 16, 16, "segments"),
    "mla_like": (1, 96, 96, 2, 2, 192, 128, "full"),                   # head_dim 192, v padded from 128
    "decode_t1": (3, 1, 300, 4, 1, 16, 16, "cache"),
    "cache_chunk": (2, 7, 200, 4, 2, 16, 16, "cache"),
}
SCALE = 0.3
BLOCK = 64


def _inputs(b, t, s, h, hkv, d, dv_real, form, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, t, h, d))
    k = r.normal(size=(b, s, hkv, d))
    v = r.normal(size=(b, s, hkv, d))
    v[..., dv_real:] = 0.0
    kw = {}
    if form == "segments":  # two packed sequences, then right padding (its own segment id 0)
        seg = np.zeros((b, t), np.int32)
        seg[0, :70], seg[0, 70:150] = 1, 2
        seg[1, :t - 9] = 1
        kw["segment_ids"] = jnp.asarray(seg)
    if form == "cache":  # rows at different depths of the cache: p .. p + T - 1
        start = np.array([0, s // 2, s - t][:b]).reshape(b, 1)
        kw["q_positions"] = jnp.asarray(start + np.arange(t), jnp.int32)
    w = r.normal(size=(b, t, h, d))  # the cotangent of a linear loss
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v)), kw, jnp.asarray(w, jnp.float32)


def _fwd_grad(fn, kw, w):
    def loss(q, k, v):
        out = fn(q, k, v, scale=SCALE, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_reference_forward_and_gradient(case):
    (q, k, v), kw, w = _inputs(*CASES[case])
    (_, ref), ref_grads = _fwd_grad(reference_attention, kw, w)(q, k, v)
    blockwise = lambda *a, **k_: blockwise_attention(*a, block=BLOCK, **k_)  # noqa: E731
    (_, out), grads = _fwd_grad(blockwise, kw, w)(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        scale = float(jnp.abs(g_ref).max())
        np.testing.assert_allclose(g / scale, g_ref / scale, atol=1e-5, err_msg=f"d{name}")


def test_blockwise_bf16_accumulates_in_float32():
    (q, k, v), _, _ = _inputs(2, 201, 201, 4, 2, 16, 16, "full", dtype=jnp.bfloat16)
    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, scale=SCALE, block=BLOCK))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(*(a.astype(jnp.float32) for a in (q, k, v)), scale=SCALE)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=1e-2)


def test_blockwise_padded_query_rows_are_zero_not_nan():
    # a query that sees no key exists only in the padding: the kernel gives 0 there, never NaN
    (q, k, v), _, _ = _inputs(1, 4, 8, 2, 2, 8, 8, "cache")
    out = blockwise_attention(q, k, v, scale=SCALE, q_positions=jnp.full((1, 4), -1, jnp.int32), block=4)
    np.testing.assert_array_equal(out, np.zeros_like(out))


def test_pick_block():
    assert pick_block(100, 512) == 100 and pick_block(2048, 512) == 512
    assert pick_block(1000, 512) == 500  # a divisor in [block/2, block]: no padding
    assert pick_block(1031, 512) == 512  # a prime: padded to 1536


def test_mla_model_logits_and_routes_equal_across_kernels():
    # MLA: v padded from v_head_dim to head_dim; packed segments; GQA models run blockwise in every other test
    extra = dict(attention="mla", num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=16, kv_lora_rank=8,
                 v_head_dim=6, qk_norm=False, num_layers=1, first_dense_layers=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 272, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    seg = jnp.asarray(np.repeat([[1, 2]], 20, axis=1).repeat(2, 0), jnp.int32)
    outs = {}
    for impl in ("xla", "blockwise"):
        cfg = MoeConfig.tiny(attention_impl=impl, attention_block=16, **extra)
        graphdef, state = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)))
        outs[impl] = jax.jit(lambda s: nnx.merge(graphdef, s)(tokens, positions, segment_ids=seg))(state)
    np.testing.assert_allclose(outs["blockwise"].logits, outs["xla"].logits, atol=1e-5)
    np.testing.assert_array_equal(outs["blockwise"].routes, outs["xla"].routes)


_SXS = re.compile(r"\[[^\]]*\b2048\b[^\]]*\b2048\b[^\]]*\]")  # an HLO shape with two 2048 dims


def _train_step_hlo(impl: str) -> str:
    cfg = MoeConfig.tiny(attention_impl=impl, num_layers=1, first_dense_layers=0, moe_impl="dense")
    graphdef, params, rest = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((1, 2048), jnp.int32)

    def loss(p, tokens):
        out = nnx.merge(graphdef, p, rest)(tokens, jnp.arange(2048, dtype=jnp.int32)[None])
        return jnp.mean(jax.nn.logsumexp(out.logits, axis=-1)) + out.aux_loss

    return jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()


def test_compiled_train_step_holds_no_sxs_buffer_with_blockwise():
    assert _SXS.search(_train_step_hlo("blockwise")) is None
    assert _SXS.search(_train_step_hlo("xla")) is not None  # the reference does: the check can fail


def test_splash_interpret_mode_equals_reference():
    from models.splash import splash_attention

    (q, k, v), kw, _ = _inputs(2, 256, 256, 4, 2, 128, 128, "segments")
    try:
        out = jax.jit(lambda q, k, v, s: splash_attention(q, k, v, scale=SCALE, segment_ids=s, interpret=True))(
            q, k, v, kw["segment_ids"])
    except Exception as err:  # noqa: BLE001 - the interpreter's support on CPU is outside this project
        pytest.skip(f"Pallas interpret mode does not run splash here: {type(err).__name__}: {err}")
    np.testing.assert_allclose(out, reference_attention(q, k, v, scale=SCALE, **kw), atol=5e-5)  # q pre-scaled


def test_splash_compiles_for_a_tpu_topology():
    from experiments import topologies

    if not topologies.tpu_aot_available():
        pytest.skip("libtpu not installed: install the tpu-aot extra (.venv-tpu) to compile for a TPU topology")
    from jax.sharding import NamedSharding, PartitionSpec as P

    devs = topologies.devices(topologies.topology("v5p:2x2x1"), "tpu")
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    row = NamedSharding(mesh, P("data"))
    b, t, h, hkv, d = 4, 1024, 8, 4, 128
    shapes = [jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16, sharding=row) for n in (h, hkv, hkv)]
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=row)

    def loss(q, k, v, seg):
        return jnp.sum(attention(q, k, v, scale=d ** -0.5, segment_ids=seg, impl="splash").astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes, seg).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Pallas kernel, not an XLA fallback
    per_chip_scores = (b // len(devs)) * h * t * t * 4  # the f32 scores one chip's rows would materialise
    assert compiled.memory_analysis().temp_size_in_bytes < per_chip_scores // 4


@pytest.mark.parametrize("impl,why", [("splash", r"T=5, S=5: splash tiles by 128"),
                                      ("cudnn", r"it runs on GPU, the target is cpu")])
def test_an_explicit_kernel_that_cannot_run_says_so_once_and_blockwise_runs(impl, why):
    from models import attention as attention_module

    q, k, v = (jax.random.normal(jax.random.key(i), (1, 5, 2, 8)) for i in range(3))
    attention_module._WARNED.clear()
    with pytest.warns(UserWarning, match=rf"attention_impl='{impl}' does not cover this call \({why}\): "
                                         r"blockwise attention runs instead"):
        out = attention(q, k, v, scale=0.3, impl=impl)
    np.testing.assert_allclose(out, reference_attention(q, k, v, scale=0.3), atol=1e-5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the same call again is silent
        attention(q, k, v, scale=0.3, impl=impl)


def test_paged_auto_on_a_tpu_without_a_mesh_says_xla_runs(monkeypatch):
    from models import attention as attention_module
    from models import paged

    monkeypatch.setattr(attention_module, "target_platform", lambda: "tpu")
    monkeypatch.setattr(jax, "device_count", lambda *a: 4)
    attention_module._WARNED.clear()
    with pytest.warns(UserWarning, match=r"paged attention 'auto' runs 'xla' on this TPU: 4 devices and no mesh"):
        assert paged._resolve("auto", None, None, None, jnp.float32) == "xla"


def test_auto_resolves_per_backend_and_the_field_is_validated():
    assert [resolve_impl("auto", be) for be in ("tpu", "gpu", "cpu")] == ["splash", "cudnn", "blockwise"]
    assert resolve_impl("xla", "tpu") == "xla"
    assert set(ATTENTION_IMPLS) == {"auto", "xla", "blockwise", "splash", "cudnn"}
    with pytest.raises(FieldError, match=r"MoeConfig.attention_impl='flash': expected one of 'auto', 'xla'") as err:
        MoeConfig.tiny(attention_impl="flash")
    assert err.value.field == "MoeConfig.attention_impl" and err.value.value == "flash"
    with pytest.raises(FieldError, match=r"MoeConfig.attention_block=0: expected an int >= 1"):
        MoeConfig.tiny(attention_block=0)
