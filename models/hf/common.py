"""What the architecture modules share: the family record, dtype names and config.json helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from models.config import MoeConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face architecture. ``moe_prefix``: the MoE module's name in a layer ("mlp" or
    Mixtral's "block_sparse_moe"); ``expert_leaf``: our expert matrix -> HF per-expert leaf name;
    ``to_config(hf, dtype, param_dtype, moe_impl) -> MoeConfig``; ``to_hf(cfg) -> dict`` (without
    the dtype and max_position_embeddings keys); ``fits(cfg)``: whether this family can write cfg."""

    architecture: str
    model_types: tuple[str, ...]
    to_config: Callable
    to_hf: Callable
    fits: Callable
    moe_prefix: str = "mlp"
    expert_leaf: tuple = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj"))


def dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: expected one of {sorted(DTYPES)} for a Hugging Face checkpoint")
    return name


def require(hf: Mapping, key: str, arch: str):
    if hf.get(key) is None:
        raise ValueError(f"config.json is missing {key!r}: expected it in a {arch} config")
    return hf[key]


def expect(hf: Mapping, key: str, want, default=None) -> None:
    """Refuse a feature our model does not implement, naming the field."""
    got = hf.get(key, default)
    if got != want:
        raise ValueError(f"config.json {key}={got!r}: expected {want!r}")


def rope(hf: Mapping) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) at the top level (hub checkpoints) or inside
    rope_parameters (transformers 5.x). Any RoPE scaling (YaRN, linear, ...) is refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, r in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = r.get("rope_type", r.get("type", "default"))
        if kind != "default":
            raise ValueError(f"config.json {field}.rope_type={kind!r}: expected 'default' (no RoPE scaling)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    return theta, float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def param_dtype_of(hf: Mapping, param_dtype):
    if param_dtype is not None:
        return param_dtype
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json torch_dtype={name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def common_fields(hf: Mapping, arch: str, experts_key: tuple[str, ...], dtype, param_dtype, moe_impl) -> dict:
    """MoeConfig fields every family spells alike (sizes, norms, embeddings, dtypes, E and K)."""
    if hf.get("quantization_config"):
        raise ValueError("config.json quantization_config is set: expected an unquantized checkpoint")
    expect(hf, "hidden_act", "silu", "silu")
    experts = {k: hf[k] for k in experts_key if hf.get(k) is not None}
    if not experts:
        raise ValueError(f"config.json is missing {experts_key[0]!r} (or {experts_key[1]!r})")
    if len(set(experts.values())) > 1:
        a, b = experts_key
        raise ValueError(f"config.json {a}={experts[a]} and {b}={experts[b]} disagree: expected equal values")
    num_experts = int(next(iter(experts.values())))
    if num_experts < 1:
        raise ValueError(f"config.json {next(iter(experts))}={num_experts}: expected >= 1 (an MoE model)")
    hidden, heads = int(require(hf, "hidden_size", arch)), int(require(hf, "num_attention_heads", arch))
    param_dtype = param_dtype_of(hf, param_dtype)
    return dict(
        vocab_size=int(require(hf, "vocab_size", arch)), hidden_size=hidden,
        num_layers=int(require(hf, "num_hidden_layers", arch)), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=int(hf.get("head_dim") or hidden // heads),
        rope_theta=rope(hf)[0], num_experts=num_experts, top_k=int(require(hf, "num_experts_per_tok", arch)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=param_dtype if dtype is None else dtype, param_dtype=param_dtype, moe_impl=moe_impl,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def common_hf(cfg: MoeConfig, family: Family) -> dict:
    """config.json keys every family spells alike."""
    return {
        "architectures": [family.architecture], "model_type": family.model_types[0],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu", "attention_dropout": 0.0, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
    }


def refuse(cfg: MoeConfig, family: Family, **wanted) -> None:
    """Raise ValueError for the first MoeConfig field this family cannot express."""
    for name, want in wanted.items():
        got = getattr(cfg, name)
        ok = want(got) if callable(want) else got == want
        if not ok:
            what = "" if callable(want) else f" (expected {want!r})"
            raise ValueError(f"MoeConfig.{name}={got!r}: {family.architecture} cannot express it{what}")
