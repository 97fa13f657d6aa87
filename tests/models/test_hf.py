"""Hugging Face Qwen3-MoE interop: parity with transformers, save/load round trips, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer, stacking
from models.hf import config_from_hf, config_to_hf, load_pretrained, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

B, T = 2, 12

_QWEN = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
_MLA = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, moe_intermediate_size=16,
            intermediate_size=48, first_k_dense_replace=1, num_experts_per_tok=4)
PARITY = {  # (transformers class, config kwargs)
    # norm_topk_prob on, E=8 K=2, GQA ratio 2, one leading dense layer
    "qwen3_renorm_dense0": ("Qwen3Moe", dict(_QWEN, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=16, intermediate_size=48, mlp_only_layers=[0],
                                             norm_topk_prob=True, tie_word_embeddings=False)),
    # norm_topk_prob off, E=16 K=4, GQA ratio 4, no dense layer, tied embeddings, non-default theta
    "qwen3_plain_tied": ("Qwen3Moe", dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=8, num_experts=16, num_experts_per_tok=4,
                                          moe_intermediate_size=16, intermediate_size=64, mlp_only_layers=[],
                                          norm_topk_prob=False, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # OLMoE: q/k norm over the whole projection; without renormalisation and with clip_qkv, then with it
    "olmoe_plain_clip": ("Olmoe", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                       intermediate_size=16, norm_topk_prob=False, clip_qkv=0.5)),
    "olmoe_renorm": ("Olmoe", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
                                   intermediate_size=16, norm_topk_prob=True)),
    # Mixtral: no q/k norm, renormalised top-k (= softmax over the top-k logits)
    "mixtral": ("Mixtral", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=16)),
    # GLM-4.5: sigmoid + bias, 4 groups pick 2, scaling, shared expert, q/k/v bias, half RoPE, q/k norm
    "glm4_moe": ("Glm4Moe", dict(_QWEN, num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=4,
                                 n_group=4, topk_group=2, routed_scaling_factor=2.0, n_shared_experts=1,
                                 moe_intermediate_size=16, intermediate_size=48, first_k_dense_replace=1,
                                 attention_bias=True, use_qk_norm=True)),
    # DeepSeek-V3: MLA (q LoRA, interleaved RoPE), sigmoid + bias, 4 groups pick 2, 2 shared experts
    "deepseek_v3": ("DeepseekV3", dict(_MLA, q_lora_rank=24, n_routed_experts=16, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, n_shared_experts=2)),
    # Kimi-K2-like: no q LoRA, no group limit, half-split RoPE, tied embeddings
    "kimi_k2_like": ("DeepseekV3", dict(_MLA, q_lora_rank=None, n_routed_experts=12, n_group=1, topk_group=1,
                                        routed_scaling_factor=2.827, n_shared_experts=1, rope_interleave=False,
                                        tie_word_embeddings=True)),
}


def _hf_model(name_or_kwargs, seed=0):
    """A random fp32 transformers model; norms away from 1 and a nonzero selection bias, so a
    mis-mapped norm or bias cannot hide."""
    kind, kwargs = PARITY[name_or_kwargs] if isinstance(name_or_kwargs, str) else ("Qwen3Moe", name_or_kwargs)
    torch.manual_seed(seed)
    config = getattr(transformers, f"{kind}Config")(**kwargs)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    return model


def _hf_forward(hf, tokens):
    """transformers logits [B, T, V] and each MoE layer's selected ids [B*T, K] (hooked on the routers)."""
    picked, hooks = [], []
    for name, mod in hf.named_modules():
        if name.endswith(".mlp.gate") and hasattr(mod, "top_k"):
            hooks.append(mod.register_forward_hook(lambda m, i, o: picked.append(o[2].numpy())))
    try:
        with torch.no_grad():
            logits = hf(torch.from_numpy(np.asarray(tokens)).long()).logits.numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, picked


def _inputs(vocab, seed=0):
    tokens = np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    return tokens, positions


def _forward(model, tokens, positions):
    """One jitted forward (an eager NNX forward compiles op by op: several times slower on CPU)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, a, b: nnx.merge(graphdef, s)(a, b))(state, jnp.asarray(tokens), jnp.asarray(positions))


def _params(model):
    return nnx.to_pure_dict(nnx.state(model))  # params and router biases


def _assert_params_equal(a, b):
    pa, pb = _params(a), _params(b)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parity_with_transformers(name, tmp_path):
    """Logits within 1e-4 and identical top-k sets on every (token, MoE layer); then our save loads
    back into transformers with the same logits (round trip through both writers)."""
    kind, kwargs = PARITY[name]
    hf = _hf_model(name)
    sharded = kwargs.get("tie_word_embeddings", False)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB" if sharded else "50GB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == sharded
    cfg, model = load_pretrained(tmp_path / "hf")

    assert cfg.top_k == kwargs["num_experts_per_tok"]
    assert cfg.tie_embeddings == kwargs.get("tie_word_embeddings", False)
    tokens, positions = _inputs(kwargs["vocab_size"])
    out = _forward(model, tokens, positions)
    ref_logits, ref_ids = _hf_forward(hf, tokens)

    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
    assert len(ref_ids) == cfg.num_moe_layers > 0
    k = cfg.top_k
    for layer, theirs in enumerate(ref_ids):
        ours = np.sort(np.asarray(out.live_routes[:, :, layer]).reshape(B * T, k), axis=-1)
        np.testing.assert_array_equal(ours, np.sort(theirs, axis=-1), err_msg=f"{name} MoE layer {layer}")

    save_pretrained(model, tmp_path / "ours")
    _, again = load_pretrained(tmp_path / "ours")
    _assert_params_equal(model, again)
    back = getattr(transformers, f"{kind}ForCausalLM").from_pretrained(tmp_path / "ours").eval()
    np.testing.assert_allclose(_hf_forward(back, tokens)[0], ref_logits, atol=1e-5, rtol=0)


def test_fused_expert_tensors_load_like_per_expert(tmp_path):
    """transformers 5.x keeps experts fused in memory (gate_up_proj [E, 2I, D]); a file in that form loads."""
    hf = _hf_model("qwen3_renorm_dense0")
    hf.save_pretrained(tmp_path / "split")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "split" / "config.json").read_text())
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    safetensors_numpy.save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    _, a = load_pretrained(tmp_path / "split")
    _, b = load_pretrained(fused)
    _assert_params_equal(a, b)


def _tiny(**overrides):
    base = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                moe_intermediate_size=16, dense_intermediate_size=48)
    return MoeConfig.tiny(**{**base, **overrides})


def test_save_load_round_trip_and_transformers_reads_it(tmp_path):
    cfg = _tiny()
    model = MoeTransformer(cfg, rngs=nnx.Rngs(3))
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    cfg2, model2 = load_pretrained(tmp_path)
    assert cfg2 == cfg
    _assert_params_equal(model, model2)
    tokens, positions = _inputs(cfg.vocab_size, seed=1)
    out, out2 = _forward(model, tokens, positions), _forward(model2, tokens, positions)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(out2.logits))
    np.testing.assert_array_equal(np.asarray(out.routes), np.asarray(out2.routes))

    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.num_experts == cfg.num_experts and hf.config.mlp_only_layers == [0]
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long())
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)


def test_sharded_save_round_trips_with_index(tmp_path):
    cfg = _tiny(tie_embeddings=True, first_dense_layers=0, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(4))
    save_pretrained(model, tmp_path, max_shard_size="20KB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    assert "lm_head.weight" not in index["weight_map"]  # tied: the head is the embedding
    assert len([n for n in index["weight_map"] if ".mlp.experts." in n]) == 3 * 3 * cfg.num_experts
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg2, model2 = load_pretrained(tmp_path)
    assert cfg2 == cfg
    _assert_params_equal(model, model2)

    save_pretrained(model2, tmp_path)  # re-saving unsharded removes the stale shards and index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_round_trip_with_scan_on_maps_stacked_layers_to_per_layer_tensors(tmp_path):
    """A scanned model (stacked dense-first and MoE runs) writes the same per-layer HF tensors as its
    unrolled twin, and its files load back into either layout with the same numbers."""
    cfg = _tiny(num_layers=4, first_dense_layers=2, router="sigmoid_bias_grouped", num_shared_experts=1,
                attention_bias=True, qk_norm=False)  # Glm4Moe: per-layer router bias, shared experts, biases
    scanned = MoeTransformer(cfg, rngs=nnx.Rngs(5))
    bias = scanned.moe_layers.mlp.router_bias  # [L, E]: a distinct bias per layer, so a layer mix-up shows
    bias[...] = jax.random.normal(jax.random.key(0), bias.shape)
    unrolled = MoeTransformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))
    pure = stacking.unstack_layers(nnx.to_pure_dict(nnx.state(scanned)), cfg)
    state = nnx.state(unrolled)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(unrolled, state)
    save_pretrained(scanned, tmp_path / "scanned")
    save_pretrained(unrolled, tmp_path / "unrolled")
    a = safetensors_numpy.load_file(str(tmp_path / "scanned" / "model.safetensors"))
    b = safetensors_numpy.load_file(str(tmp_path / "unrolled" / "model.safetensors"))
    assert sorted(a) == sorted(b) and "model.layers.3.mlp.gate.e_score_correction_bias" in a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    np.testing.assert_array_equal(a["model.layers.3.mlp.gate.e_score_correction_bias"], np.asarray(bias[...])[1])
    cfg2, back = load_pretrained(tmp_path / "scanned")
    assert cfg2 == cfg and cfg2.scan_layers
    _assert_params_equal(back, scanned)
    cfg3, back_unrolled = load_pretrained(tmp_path / "scanned", scan_layers=False)
    assert cfg3 == cfg.replace(scan_layers=False) and "layers" in nnx.state(back_unrolled)
    _assert_params_equal(back_unrolled, unrolled)
    with pytest.raises(ValueError, match=r"scan_layers='yes': expected a bool"):
        load_pretrained(tmp_path / "scanned", scan_layers="yes")


def test_config_spellings_and_round_trip():
    cfg = _tiny(norm_topk_prob=False, rope_theta=1e6, first_dense_layers=2)
    hf = config_to_hf(cfg)
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["mlp_only_layers"] == [0, 1]
    assert config_from_hf(hf) == cfg
    new = {k: v for k, v in hf.items() if k not in ("num_experts", "rope_theta", "torch_dtype")}
    new.update(num_local_experts=8, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
               dtype="float32")
    assert config_from_hf(new) == cfg
    # decoder_sparse_step=2 over 2 layers: layer 0 dense, layer 1 MoE -> a leading dense prefix
    step = config_from_hf({**hf, "num_hidden_layers": 2, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert (step.first_dense_layers, step.moe_layer_ids) == (1, (1,))
    assert config_from_hf(hf, dtype=jnp.bfloat16, moe_impl="dense").dtype == jnp.bfloat16


def test_config_errors():
    hf = config_to_hf(_tiny())
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\], model_type='llama': expected one"):
        config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ValueError, match=r"make layers \[1\] dense: expected the dense layers to be a leading"):
        config_from_hf({**hf, "mlp_only_layers": [1]})
    with pytest.raises(ValueError, match=r"num_experts=8 and num_local_experts=4 disagree"):
        config_from_hf({**hf, "num_local_experts": 4})
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type='yarn': expected 'default'"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"MoeConfig.qk_norm=False: Qwen3MoeForCausalLM cannot express it"):
        config_to_hf(_tiny(qk_norm=False), architecture="Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match=r"MoeConfig.first_dense_layers=1: MixtralForCausalLM cannot express it"):
        config_to_hf(_tiny(qk_norm=False))  # no q/k norm -> Mixtral, which has no dense layers
    with pytest.raises(ValueError, match=r"config.json scoring_func='softmax': expected 'sigmoid'"):
        config_from_hf({**config_to_hf(_tiny(router="sigmoid_bias_grouped")), "scoring_func": "softmax"})
    with pytest.raises(ValueError, match=r"max_shard_size='5 parsecs'"):
        save_pretrained(MoeTransformer(_tiny(), rngs=nnx.Rngs(0)), "/nonexistent", max_shard_size="5 parsecs")


def _rewrite(path, edit):
    tensors = safetensors_numpy.load_file(str(path / "model.safetensors"))
    edit(tensors)
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_load_errors_name_the_problem(tmp_path):
    save_pretrained(MoeTransformer(_tiny(), rngs=nnx.Rngs(0)), tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\], model_type='llama': expected"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(conf))

    _rewrite(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\).*'model.layers.2.mlp.experts.5.up_proj.weight'"):
        load_pretrained(tmp_path)

    def bad_shape(t):
        t["model.layers.2.mlp.experts.5.up_proj.weight"] = np.zeros((16, 31), np.float32)
    _rewrite(tmp_path, bad_shape)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.2.mlp.experts.5.up_proj.weight' has shape "
                                         r"\(16, 31\): expected \(16, 32\)"):
        load_pretrained(tmp_path)

    def extra(t):
        t["model.layers.2.mlp.experts.5.up_proj.weight"] = np.zeros((16, 32), np.float32)
        t["model.mtp.weight"] = np.zeros((2,), np.float32)
    _rewrite(tmp_path, extra)
    with pytest.warns(UserWarning, match=r"1 checkpoint tensor\(s\) not used by the model, e.g. \['model.mtp.weight'\]"):
        load_pretrained(tmp_path)


def test_hub_config_of_qwen3_30b_a3b_maps_to_the_preset():
    hub = {  # config.json of Qwen/Qwen3-30B-A3B on the hub (older spellings, bf16)
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936}
    assert config_from_hf(hub) == MoeConfig.qwen3_30b_a3b()


def test_hub_configs_of_glm4_5_air_and_deepseek_v3_map_to_the_presets():
    glm = {  # config.json of zai-org/GLM-4.5-Air on the hub
        "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
        "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
        "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
        "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552}
    assert config_from_hf(glm) == MoeConfig.glm4_5_air()
    ds = {  # config.json of deepseek-ai/DeepSeek-V3 on the hub (fp8, YaRN)
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
        "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
        "quantization_config": {"quant_method": "fp8"},
        "rope_scaling": {"factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "type": "yarn"}}
    with pytest.raises(ValueError, match=r"quantization_config is set: expected an unquantized checkpoint"):
        config_from_hf(ds)
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type='yarn': expected 'default'"):
        config_from_hf({**ds, "quantization_config": None})
    assert config_from_hf({**ds, "quantization_config": None, "rope_scaling": None}) == MoeConfig.deepseek_v3()
    kimi = {**ds, "quantization_config": None, "rope_scaling": None, "model_type": "kimi_k2", "vocab_size": 163840,
            "num_attention_heads": 64, "num_key_value_heads": 64, "rope_theta": 50000.0, "n_routed_experts": 384,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}
    assert config_from_hf(kimi) == MoeConfig.kimi_k2()
