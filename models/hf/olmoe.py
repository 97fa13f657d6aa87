"""OLMoE (``OlmoeForCausalLM``): softmax top-k router (``norm_topk_prob`` usually off), q/k RMSNorm
over the whole projection, optional ``clip_qkv``, every layer MoE."""

from __future__ import annotations

from collections.abc import Mapping

from models.config import MoeConfig
from models.hf.common import Family, common_fields, common_hf, expect, refuse, require

ARCH = "OlmoeForCausalLM"


def to_config(hf: Mapping, dtype=None, param_dtype=None, moe_impl="ragged") -> MoeConfig:
    expect(hf, "attention_bias", False, False)
    f = common_fields(hf, ARCH, ("num_experts", "num_local_experts"), dtype, param_dtype, moe_impl)
    if f["head_dim"] * f["num_heads"] != f["hidden_size"]:  # transformers sizes k_norm from hidden / heads
        raise ValueError(f"config.json head_dim={f['head_dim']}: expected hidden_size / num_attention_heads "
                         f"= {f['hidden_size'] // f['num_heads']} for {ARCH}")
    inter = int(require(hf, "intermediate_size", ARCH))  # OLMoE's expert size
    clip = hf.get("clip_qkv")
    return MoeConfig(**f, qk_norm=True, qk_norm_scope="full", clip_qkv=None if clip is None else float(clip),
                     rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), moe_intermediate_size=inter,
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)), first_dense_layers=0,
                     dense_intermediate_size=inter)


def fits(cfg: MoeConfig) -> bool:
    return cfg.attention == "gqa" and cfg.router == "softmax_topk" and cfg.qk_norm and cfg.qk_norm_scope == "full"


def to_hf(cfg: MoeConfig) -> dict:
    refuse(cfg, FAMILY, qk_norm=True, qk_norm_scope="full", router="softmax_topk", attention="gqa",
           num_shared_experts=0, attention_bias=False, partial_rotary_factor=1.0, first_dense_layers=0,
           routed_scaling_factor=1.0, head_dim=lambda hd: hd * cfg.num_heads == cfg.hidden_size)
    return {**common_hf(cfg, FAMILY), "attention_bias": False, "clip_qkv": cfg.clip_qkv,
            "num_experts": cfg.num_experts, "intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob}


FAMILY = Family(ARCH, ("olmoe",), to_config, to_hf, fits)
