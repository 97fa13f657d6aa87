"""Model configuration for the Qwen3-MoE-style transformer, with size presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


# expert kernels (models/moe.py): "ragged" dropless grouped matmul, "dense" one-hot reference, "loop"
# per-expert loop skipping unchosen experts, "gather" each chosen expert on only its tokens (decode on CPU)
MOE_IMPLS = ("ragged", "dense", "loop", "gather")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Hyper-parameters of a decoder-only MoE transformer (Qwen3-MoE architecture).

    Layers ``0 .. first_dense_layers - 1`` use a dense SwiGLU MLP of ``dense_intermediate_size``;
    every later layer is an MoE layer with ``num_experts`` experts of ``moe_intermediate_size``
    and ``top_k`` experts per token.
    """

    vocab_size: int = 272
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    qk_norm: bool = True
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    first_dense_layers: int = 1
    dense_intermediate_size: int = 128
    tie_embeddings: bool = False
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    # "ragged" (dropless grouped matmul), "dense" (one-hot reference) or "loop" (per-expert loop that
    # skips unchosen experts: decode on CPU)
    moe_impl: str = "ragged"
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        checks = [
            ("num_heads", self.num_heads % self.num_kv_heads == 0, "a multiple of num_kv_heads"),
            ("top_k", 1 <= self.top_k <= self.num_experts, f"in [1, num_experts={self.num_experts}]"),
            ("first_dense_layers", 0 <= self.first_dense_layers <= self.num_layers,
             f"in [0, num_layers={self.num_layers}]"),
            ("moe_impl", self.moe_impl in MOE_IMPLS, "one of " + ", ".join(map(repr, MOE_IMPLS))),
            ("head_dim", self.head_dim % 2 == 0, "even (RoPE rotates pairs)"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"MoeConfig.{name}={getattr(self, name)!r}: expected {expected}")

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Global indices of the MoE layers, in model order (the L axis of every route array)."""
        return tuple(range(self.first_dense_layers, self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    def replace(self, **changes) -> "MoeConfig":
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        """Total parameter count (all experts), computed from the shapes."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + (2 * hd if self.qk_norm else 0)
        moe = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
        dense = 3 * d * self.dense_intermediate_size
        per_layer = attn + 2 * d
        total = self.num_layers * per_layer + self.num_moe_layers * moe + self.first_dense_layers * dense
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total + emb + d

    # ---- presets ---------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> "MoeConfig":
        """The CPU default: 3 layers (1 dense + 2 MoE), E=8, K=2; a forward takes milliseconds."""
        return cls(**overrides)

    @classmethod
    def small_100m(cls, **overrides) -> "MoeConfig":
        """About 103M parameters (~20M active): 8 MoE layers, E=16, K=2, D=512."""
        base = dict(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                    head_dim=64, num_experts=16, top_k=2, moe_intermediate_size=448,
                    first_dense_layers=0, dense_intermediate_size=1024)
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of Qwen3-30B-A3B (48 MoE layers, E=128, K=8)."""
        base = dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                    head_dim=128, rope_theta=1_000_000.0, num_experts=128, top_k=8,
                    moe_intermediate_size=768, first_dense_layers=0, dense_intermediate_size=6144,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        return cls(**{**base, **overrides})

    @classmethod
    def olmoe_1b_7b(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of OLMoE-1B-7B (16 MoE layers, E=64, K=8, no top-k renormalisation)."""
        base = dict(vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16,
                    head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=1024,
                    norm_topk_prob=False, first_dense_layers=0, dense_intermediate_size=1024,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        return cls(**{**base, **overrides})

    @classmethod
    def mixtral_8x7b(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of Mixtral-8x7B (32 MoE layers, E=8, K=2)."""
        base = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    head_dim=128, qk_norm=False, rope_theta=1_000_000.0, num_experts=8, top_k=2,
                    moe_intermediate_size=14336, first_dense_layers=0, dense_intermediate_size=14336,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        return cls(**{**base, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides) -> "MoeConfig":
        presets = {"tiny": cls.tiny, "small_100m": cls.small_100m, "qwen3_30b_a3b": cls.qwen3_30b_a3b,
                   "olmoe_1b_7b": cls.olmoe_1b_7b, "mixtral_8x7b": cls.mixtral_8x7b}
        if name not in presets:
            raise ValueError(f"preset={name!r}: expected one of {sorted(presets)}")
        return presets[name](**overrides)
