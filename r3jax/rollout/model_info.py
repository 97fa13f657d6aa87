"""What an agent loop needs to know about its generator (an ``Engine`` or a ``RemoteInferenceClient``)."""

from __future__ import annotations

from typing import Any


def describe(generator: Any) -> dict:
    """``num_experts, top_k, moe_layer_ids, vocab_size, max_seq_len`` of an engine or a client."""
    if callable(getattr(generator, "model_info", None)):
        info = dict(generator.model_info())
    elif hasattr(generator, "config"):
        cfg = generator.config
        info = {"num_experts": cfg.num_experts, "top_k": cfg.top_k, "vocab_size": cfg.vocab_size,
                "moe_layer_ids": list(generator.moe_layer_ids), "max_seq_len": generator.max_seq_len}
    else:
        raise ValueError(f"generator: {type(generator).__name__} has neither model_info() nor "
                         f"config; expected an Engine or a RemoteInferenceClient")
    missing = [k for k in ("num_experts", "top_k", "moe_layer_ids", "vocab_size", "max_seq_len")
               if k not in info]
    if missing:
        raise ValueError(f"generator model info lacks {missing}")
    info["moe_layer_ids"] = tuple(int(i) for i in info["moe_layer_ids"])
    return info
