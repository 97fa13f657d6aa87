"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): sigmoid router with selection bias and group limit,
shared experts, leading dense layers, q/k/v bias, RoPE on ``partial_rotary_factor`` of each head,
optional per-head q/k RMSNorm. ``sigmoid_fields`` is shared with DeepSeek-V3."""

from __future__ import annotations

from collections.abc import Mapping

from models.config import MoeConfig
from models.hf.common import Family, common_fields, common_hf, expect, refuse, require, rope

ARCH = "Glm4MoeForCausalLM"
EXPERTS = ("n_routed_experts", "num_local_experts")


def sigmoid_fields(hf: Mapping, arch: str, num_layers: int) -> dict:
    """The DeepSeek-style MoE fields (router, groups, scaling, shared experts, dense prefix)."""
    expect(hf, "scoring_func", "sigmoid", "sigmoid")
    expect(hf, "topk_method", "noaux_tc", "noaux_tc")
    expect(hf, "moe_layer_freq", 1, 1)
    first_dense = min(int(hf.get("first_k_dense_replace", 0) or 0), num_layers)
    return dict(router="sigmoid_bias_grouped", n_group=int(hf.get("n_group") or 1),
                topk_group=int(hf.get("topk_group") or 1),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                num_shared_experts=int(hf.get("n_shared_experts") or 0),
                moe_intermediate_size=int(require(hf, "moe_intermediate_size", arch)),
                first_dense_layers=first_dense,
                dense_intermediate_size=int(require(hf, "intermediate_size", arch)))


def sigmoid_hf(cfg: MoeConfig) -> dict:
    return {"n_routed_experts": cfg.num_experts, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
            "n_shared_experts": cfg.num_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
            "first_k_dense_replace": cfg.first_dense_layers, "intermediate_size": cfg.dense_intermediate_size,
            "num_nextn_predict_layers": 0}


def to_config(hf: Mapping, dtype=None, param_dtype=None, moe_impl="ragged") -> MoeConfig:
    f = common_fields(hf, ARCH, EXPERTS, dtype, param_dtype, moe_impl)
    return MoeConfig(**f, **sigmoid_fields(hf, ARCH, f["num_layers"]), qk_norm=bool(hf.get("use_qk_norm", False)),
                     rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                     attention_bias=bool(hf.get("attention_bias", False)),
                     partial_rotary_factor=rope({"partial_rotary_factor": 0.5, **hf})[1])


def fits(cfg: MoeConfig) -> bool:
    return cfg.attention == "gqa" and cfg.router == "sigmoid_bias_grouped"


def to_hf(cfg: MoeConfig) -> dict:
    refuse(cfg, FAMILY, attention="gqa", router="sigmoid_bias_grouped", qk_norm_scope="head", clip_qkv=None)
    out = {**common_hf(cfg, FAMILY), **sigmoid_hf(cfg), "head_dim": cfg.head_dim,
           "attention_bias": cfg.attention_bias, "use_qk_norm": cfg.qk_norm}
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                              "partial_rotary_factor": cfg.partial_rotary_factor}
    out["partial_rotary_factor"] = cfg.partial_rotary_factor
    return out


FAMILY = Family(ARCH, ("glm4_moe",), to_config, to_hf, fits)
