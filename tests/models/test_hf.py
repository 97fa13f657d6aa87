"""Hugging Face Qwen3-MoE interop: parity with transformers, save/load round trips, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from models.hf import config_from_hf, config_to_hf, load_pretrained, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

B, T = 2, 12

PARITY = {
    # norm_topk_prob on, E=8 K=2, GQA ratio 2, one leading dense layer
    "renorm_dense0": dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=16, intermediate_size=48, mlp_only_layers=[0],
                          norm_topk_prob=True, tie_word_embeddings=False),
    # norm_topk_prob off, E=16 K=4, GQA ratio 4, no dense layer, tied embeddings, non-default theta
    "plain_tied": dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=8, num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=16, intermediate_size=64, mlp_only_layers=[],
                       norm_topk_prob=False, tie_word_embeddings=True, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
}


def _hf_model(kwargs, seed=0):
    """A random fp32 Qwen3MoeForCausalLM; norms away from 1 so a mis-mapped norm cannot hide."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _inputs(vocab, seed=0):
    tokens = np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    return tokens, positions


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _assert_params_equal(a, b):
    pa, pb = _params(a), _params(b)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parity_with_transformers(name, tmp_path):
    kwargs = PARITY[name]
    hf = _hf_model(kwargs)
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if kwargs["tie_word_embeddings"] else "50GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == kwargs["tie_word_embeddings"]
    cfg, model = load_pretrained(tmp_path)

    assert (cfg.num_experts, cfg.top_k) == (kwargs["num_experts"], kwargs["num_experts_per_tok"])
    assert cfg.first_dense_layers == len(kwargs["mlp_only_layers"])
    assert cfg.norm_topk_prob == kwargs["norm_topk_prob"]
    assert cfg.tie_embeddings == kwargs["tie_word_embeddings"]
    tokens, positions = _inputs(kwargs["vocab_size"])
    out = model(jnp.asarray(tokens), jnp.asarray(positions))
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long(), output_router_logits=True)

    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    assert len(ref.router_logits) == cfg.num_moe_layers
    k = cfg.top_k
    for layer, router_logits in enumerate(ref.router_logits):  # [B*T, E]
        theirs = np.sort(torch.topk(router_logits, k, dim=-1).indices.numpy(), axis=-1)
        ours = np.sort(np.asarray(out.live_routes[:, :, layer]).reshape(B * T, k), axis=-1)
        np.testing.assert_array_equal(ours, theirs)


def test_fused_expert_tensors_load_like_per_expert(tmp_path):
    """transformers 5.x keeps experts fused in memory (gate_up_proj [E, 2I, D]); a file in that form loads."""
    hf = _hf_model(PARITY["renorm_dense0"])
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
    out, out2 = model(tokens, positions), model2(tokens, positions)
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
    with pytest.raises(ValueError, match=r"architectures=\['MixtralForCausalLM'\], model_type='mixtral'"):
        config_from_hf({**hf, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
    with pytest.raises(ValueError, match=r"make layers \[1\] dense: expected the dense layers to be a leading"):
        config_from_hf({**hf, "mlp_only_layers": [1]})
    with pytest.raises(ValueError, match=r"num_experts=8 and num_local_experts=4 disagree"):
        config_from_hf({**hf, "num_local_experts": 4})
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type='yarn': expected 'default'"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"MoeConfig.qk_norm=False: expected True"):
        config_to_hf(_tiny(qk_norm=False))
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
