"""Qwen3-MoE (``Qwen3MoeForCausalLM``): softmax top-k router, per-head q/k RMSNorm, optional leading
dense layers (``mlp_only_layers`` / ``decoder_sparse_step``)."""

from __future__ import annotations

from collections.abc import Mapping

from models.config import MoeConfig
from models.hf.common import Family, common_fields, common_hf, expect, refuse, require

ARCH = "Qwen3MoeForCausalLM"


def _first_dense_layers(hf: Mapping, num_layers: int) -> int:
    """HF makes layer i dense when ``i in mlp_only_layers or (i + 1) % decoder_sparse_step != 0``;
    ours supports exactly a leading prefix of dense layers."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step}: expected >= 1")
    only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(num_layers) if i in only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        raise ValueError(
            f"config.json mlp_only_layers={sorted(only)}, decoder_sparse_step={step} make layers {dense} "
            f"dense: expected the dense layers to be a leading prefix 0..n-1 (MoeConfig.first_dense_layers)")
    return len(dense)


def to_config(hf: Mapping, dtype=None, param_dtype=None, moe_impl="ragged") -> MoeConfig:
    for key, want in (("attention_bias", False), ("use_sliding_window", False)):
        expect(hf, key, want, want)
    f = common_fields(hf, ARCH, ("num_experts", "num_local_experts"), dtype, param_dtype, moe_impl)
    first_dense = _first_dense_layers(hf, f["num_layers"])
    return MoeConfig(**f, qk_norm=True, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                     moe_intermediate_size=int(require(hf, "moe_intermediate_size", ARCH)),
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)), first_dense_layers=first_dense,
                     dense_intermediate_size=int(require(hf, "intermediate_size", ARCH) if first_dense
                                                 else hf.get("intermediate_size", 4 * f["hidden_size"])))


def fits(cfg: MoeConfig) -> bool:
    return (cfg.attention == "gqa" and cfg.router == "softmax_topk" and cfg.qk_norm and cfg.qk_norm_scope == "head"
            and cfg.num_shared_experts == 0 and not cfg.attention_bias and cfg.partial_rotary_factor == 1
            and cfg.clip_qkv is None and cfg.routed_scaling_factor == 1)


def to_hf(cfg: MoeConfig) -> dict:
    refuse(cfg, FAMILY, qk_norm=True, qk_norm_scope="head", router="softmax_topk", attention="gqa",
           num_shared_experts=0, attention_bias=False, partial_rotary_factor=1.0, clip_qkv=None,
           routed_scaling_factor=1.0)
    return {**common_hf(cfg, FAMILY), "head_dim": cfg.head_dim, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.first_dense_layers)),
            "intermediate_size": cfg.dense_intermediate_size}


FAMILY = Family(ARCH, ("qwen3_moe",), to_config, to_hf, fits)
