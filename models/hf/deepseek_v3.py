"""DeepSeek-V3 and Kimi-K2 (``DeepseekV3ForCausalLM``): multi-head latent attention (models/mla.py)
with interleaved RoPE, the sigmoid router with selection bias and group limit, shared experts and
leading dense layers."""

from __future__ import annotations

from collections.abc import Mapping

from models.config import MoeConfig
from models.hf.common import Family, common_fields, common_hf, expect, refuse, require
from models.hf.glm4_moe import EXPERTS, sigmoid_fields, sigmoid_hf

ARCH = "DeepseekV3ForCausalLM"


def to_config(hf: Mapping, dtype=None, param_dtype=None, moe_impl="ragged") -> MoeConfig:
    expect(hf, "attention_bias", False, False)
    f = common_fields(hf, ARCH, EXPERTS, dtype, param_dtype, moe_impl)
    if f["num_kv_heads"] != f["num_heads"]:
        raise ValueError(f"config.json num_key_value_heads={f['num_kv_heads']}: expected num_attention_heads="
                         f"{f['num_heads']} (MLA expands keys and values per head)")
    nope, rot = int(require(hf, "qk_nope_head_dim", ARCH)), int(require(hf, "qk_rope_head_dim", ARCH))
    f.update(head_dim=nope + rot)
    return MoeConfig(**f, **sigmoid_fields(hf, ARCH, f["num_layers"]), qk_norm=False, attention="mla",
                     rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                     kv_lora_rank=int(require(hf, "kv_lora_rank", ARCH)), qk_rope_head_dim=rot,
                     v_head_dim=int(require(hf, "v_head_dim", ARCH)),
                     rope_interleave=bool(hf.get("rope_interleave", True)))


def fits(cfg: MoeConfig) -> bool:
    return cfg.attention == "mla"


def to_hf(cfg: MoeConfig) -> dict:
    refuse(cfg, FAMILY, attention="mla", router="sigmoid_bias_grouped", qk_norm=False, attention_bias=False)
    return {**common_hf(cfg, FAMILY), **sigmoid_hf(cfg), "attention_bias": False,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


FAMILY = Family(ARCH, ("deepseek_v3", "kimi_k2"), to_config, to_hf, fits)
