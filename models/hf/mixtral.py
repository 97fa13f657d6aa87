"""Mixtral (``MixtralForCausalLM``): softmax top-k router with the K gates renormalised (the same as
a softmax over the top-k logits), no q/k norm, every layer MoE, experts named ``w1`` (gate),
``w3`` (up), ``w2`` (down) under ``block_sparse_moe``."""

from __future__ import annotations

from collections.abc import Mapping

from models.config import MoeConfig
from models.hf.common import Family, common_fields, common_hf, refuse, require

ARCH = "MixtralForCausalLM"


def to_config(hf: Mapping, dtype=None, param_dtype=None, moe_impl="ragged") -> MoeConfig:
    if hf.get("sliding_window") is not None:
        raise ValueError(f"config.json sliding_window={hf['sliding_window']!r}: expected None (full attention)")
    f = common_fields(hf, ARCH, ("num_local_experts", "num_experts"), dtype, param_dtype, moe_impl)
    inter = int(require(hf, "intermediate_size", ARCH))  # Mixtral's expert size
    return MoeConfig(**f, qk_norm=False, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                     moe_intermediate_size=inter, norm_topk_prob=True, first_dense_layers=0,
                     dense_intermediate_size=inter)


def fits(cfg: MoeConfig) -> bool:
    return cfg.attention == "gqa" and cfg.router == "softmax_topk" and not cfg.qk_norm


def to_hf(cfg: MoeConfig) -> dict:
    refuse(cfg, FAMILY, qk_norm=False, router="softmax_topk", attention="gqa", norm_topk_prob=True,
           num_shared_experts=0, attention_bias=False, partial_rotary_factor=1.0, first_dense_layers=0,
           clip_qkv=None, routed_scaling_factor=1.0)
    return {**common_hf(cfg, FAMILY), "head_dim": cfg.head_dim, "sliding_window": None,
            "num_local_experts": cfg.num_experts, "intermediate_size": cfg.moe_intermediate_size,
            "router_jitter_noise": 0.0}


FAMILY = Family(ARCH, ("mixtral",), to_config, to_hf, fits, moe_prefix="block_sparse_moe",
                expert_leaf=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")))
