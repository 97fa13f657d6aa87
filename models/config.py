"""Model configuration of the MoE transformer (Qwen3-MoE, OLMoE, Mixtral, GLM-4.5, DeepSeek-V3 / Kimi-K2
families), with shape presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from models.attention import ATTENTION_IMPLS
from models.fields import FieldError

ROUTERS = ("softmax_topk", "sigmoid_bias_grouped")


# expert kernels (models/moe.py): "ragged" dropless grouped matmul, "dense" one-hot reference, "loop"
# per-expert loop skipping unchosen experts, "gather" each chosen expert on only its tokens (decode on CPU)
MOE_IMPLS = ("ragged", "dense", "loop", "gather")

# activation checkpointing of each decoder layer (models/decoder.py): "none"; "full" saves only the layer's
# inputs and recomputes the rest in the backward pass; "dots" also saves the matmuls without batch dims
REMAT_MODES = ("none", "full", "dots")

# MLA's KV cache (models/cache.py): "latent" (c_kv and the shared RoPE key) or "expanded" (per-head k, v)
MLA_CACHES = ("latent", "expanded")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Hyper-parameters of a decoder-only MoE transformer.

    Layers ``0 .. first_dense_layers - 1`` use a dense SwiGLU MLP of ``dense_intermediate_size``;
    every later layer is an MoE layer with ``num_experts`` experts of ``moe_intermediate_size``,
    ``top_k`` experts per token and ``num_shared_experts`` always-on shared experts (one SwiGLU MLP
    of ``num_shared_experts * moe_intermediate_size``; they have no route rows).

    Routers (models/routers.py): ``"softmax_topk"`` (Qwen3-MoE, OLMoE, Mixtral; ``norm_topk_prob``
    renormalises the K gates) and ``"sigmoid_bias_grouped"`` (DeepSeek-V3, Kimi-K2, GLM-4.5: sigmoid
    scores, a non-trainable ``e_score_correction_bias`` for selection only, the best ``topk_group``
    of ``n_group`` expert groups, ``norm_topk_prob``). Gates are multiplied by
    ``routed_scaling_factor``.

    Attention: ``"gqa"`` (``qk_norm`` per head or, with ``qk_norm_scope="full"``, over the whole
    projection as OLMoE; ``attention_bias`` on q/k/v as GLM-4.5; RoPE on the first
    ``partial_rotary_factor`` of each head; ``clip_qkv`` as OLMoE) or ``"mla"`` (DeepSeek multi-head
    latent attention: ``q_lora_rank`` (0: a plain q projection), ``kv_lora_rank``,
    ``qk_nope_head_dim + qk_rope_head_dim = head_dim``, ``v_head_dim <= head_dim``,
    ``num_kv_heads = num_heads``). ``mla_cache`` (one of ``MLA_CACHES``) picks MLA's KV cache:
    ``"latent"`` (the default) holds the normalised latent and the shared RoPE key,
    ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, and decodes with the
    up-projections absorbed into the query and output; ``"expanded"`` holds every head's full key and
    its value padded to ``head_dim`` (the GQA cache layout; models/cache.py, models/mla.py). The softmax
    kernel is ``attention_impl``, one of ``ATTENTION_IMPLS`` (models/attention.py; the same mask in
    each): ``"auto"`` picks TPU splash, GPU cuDNN or the blockwise XLA kernel (``attention_block`` per
    block) from the trace-time backend.

    Layer layout (models/stacking.py): ``scan_layers=True`` (the default) stacks each run of identical
    layers (the dense-first layers, then the MoE layers) along a leading layer axis and runs it with one
    ``jax.lax.scan``, so compile time does not grow with depth; ``scan_layers=False`` keeps one module
    per layer and a Python loop (for debugging; same outputs). A run of fewer than
    ``scan_min_layers`` layers is still scanned over stacked variables but lowered unrolled
    (``jax.lax.scan(..., unroll=n)``): on XLA:CPU a loop costs about as much compile time as four or
    five layer bodies, so short runs compile faster without one. ``remat`` checkpoints each layer's
    activations: one of ``REMAT_MODES``.
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
    # the LM head's matmul in fp32 (inputs cast up, fp32 accumulation and output) whatever ``dtype`` is, as
    # MaxText's logits_dot_in_fp32: bf16 rollouts then add no rounding of their own in the head, whose
    # logprobs are what replay and importance ratios compare (the engine turns it on by default)
    logits_dot_in_fp32: bool = False
    # "ragged" (dropless grouped matmul), "dense" (one-hot reference) or "loop" (per-expert loop that
    # skips unchosen experts: decode on CPU)
    moe_impl: str = "ragged"
    # expert parallelism (models/expert_parallel.py): most tokens one device gathers per exchange; a
    # device's tokens go through the exchange in chunks so its buffers stay this size whatever the group
    moe_exchange_tokens: int = 16384
    router_aux_loss_coef: float = 0.001
    # routing (models/routers.py)
    router: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    # simulated rollout mismatch (models/routers.py): std of Gaussian noise added to the router logits
    # used for top-k selection only (gates stay clean), when no replay ids are given; 0 turns it off
    router_noise: float = 0.0
    # attention variants
    attention: str = "gqa"
    qk_norm_scope: str = "head"
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0
    clip_qkv: float | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    mla_cache: str = "latent"
    # layer layout and activation checkpointing
    scan_layers: bool = True
    scan_min_layers: int = 4
    remat: str = "none"
    # attention kernel (models/attention.py): "auto" = splash on TPU, cudnn on GPU, blockwise elsewhere
    # (decided at trace time from jax.default_backend(): compiling for TPU from a CPU host needs "splash");
    # "xla" the einsum reference; attention_block bounds blockwise's query and key blocks
    attention_impl: str = "auto"
    attention_block: int = 512

    def __post_init__(self):
        checks = [
            ("num_heads", self.num_heads % self.num_kv_heads == 0, "a multiple of num_kv_heads"),
            ("top_k", 1 <= self.top_k <= self.num_experts, f"in [1, num_experts={self.num_experts}]"),
            ("first_dense_layers", 0 <= self.first_dense_layers <= self.num_layers,
             f"in [0, num_layers={self.num_layers}]"),
            ("moe_exchange_tokens", isinstance(self.moe_exchange_tokens, int) and self.moe_exchange_tokens >= 1,
             "an int >= 1"),
            ("moe_impl", self.moe_impl in MOE_IMPLS, "one of " + ", ".join(map(repr, MOE_IMPLS))),
            ("scan_layers", isinstance(self.scan_layers, bool), "a bool"),
            ("logits_dot_in_fp32", isinstance(self.logits_dot_in_fp32, bool), "a bool"),
            ("scan_min_layers", isinstance(self.scan_min_layers, int) and not isinstance(self.scan_min_layers, bool)
             and self.scan_min_layers >= 1, "an int >= 1"),
            ("remat", self.remat in REMAT_MODES, "one of " + ", ".join(map(repr, REMAT_MODES))),
            ("attention_impl", self.attention_impl in ATTENTION_IMPLS,
             "one of " + ", ".join(map(repr, ATTENTION_IMPLS))),
            ("attention_block", isinstance(self.attention_block, int) and not isinstance(self.attention_block, bool)
             and self.attention_block >= 1, "an int >= 1"),
            ("head_dim", self.head_dim % 2 == 0, "even (RoPE rotates pairs)"),
            ("router", self.router in ROUTERS, f"one of {ROUTERS}"),
            ("n_group", self.n_group >= 1 and self.num_experts % self.n_group == 0,
             f">= 1 and dividing num_experts={self.num_experts}"),
            ("n_group", self.n_group == 1 or self.num_experts // self.n_group >= 2,
             "at most num_experts / 2 (a group's score is the sum of its top-2 experts)"),
            ("topk_group", 1 <= self.topk_group <= self.n_group, f"in [1, n_group={self.n_group}]"),
            ("topk_group", self.topk_group * (self.num_experts // self.n_group) >= self.top_k,
             f"enough groups for top_k={self.top_k} experts (topk_group * num_experts / n_group >= top_k)"),
            ("num_shared_experts", self.num_shared_experts >= 0, ">= 0"),
            ("router_noise", isinstance(self.router_noise, (int, float)) and not isinstance(self.router_noise, bool)
             and self.router_noise >= 0, "a float >= 0 (the std of the selection noise; 0 turns it off)"),
            ("attention", self.attention in ("gqa", "mla"), "'gqa' or 'mla'"),
            ("qk_norm_scope", self.qk_norm_scope in ("head", "full"), "'head' or 'full'"),
            ("partial_rotary_factor", 0 < self.partial_rotary_factor <= 1
             and int(self.head_dim * self.partial_rotary_factor) % 2 == 0,
             "in (0, 1] with an even rotary dim int(head_dim * factor)"),
        ]
        if self.attention == "mla":
            checks += [
                ("kv_lora_rank", self.kv_lora_rank >= 1, ">= 1 for attention='mla'"),
                ("qk_rope_head_dim", 2 <= self.qk_rope_head_dim < self.head_dim
                 and self.qk_rope_head_dim % 2 == 0,
                 f"even, in [2, head_dim={self.head_dim}) (head_dim = qk_nope_head_dim + qk_rope_head_dim)"),
                ("v_head_dim", 1 <= self.v_head_dim <= self.head_dim, f"in [1, head_dim={self.head_dim}]"),
                ("num_kv_heads", self.num_kv_heads == self.num_heads,
                 f"num_heads={self.num_heads} for attention='mla' (the cache holds every head)"),
                ("q_lora_rank", self.q_lora_rank >= 0, ">= 0 (0: a plain q projection)"),
            ]
        if self.mla_cache not in MLA_CACHES:
            raise FieldError("MoeConfig.mla_cache", self.mla_cache, "one of " + ", ".join(map(repr, MLA_CACHES)))
        for name, ok, expected in checks:
            if not ok:
                value = getattr(self, name)
                raise FieldError(f"MoeConfig.{name}", value, expected,
                                 f"MoeConfig.{name}={value!r}: expected {expected}")

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Global indices of the MoE layers, in model order (the L axis of every route array)."""
        return tuple(range(self.first_dense_layers, self.num_layers))

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of each query/key head without RoPE."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    def replace(self, **changes) -> "MoeConfig":
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        """Total parameter count (all experts, shared experts; not the router bias), from the shapes."""
        d, hd, h, hkv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        if self.attention == "mla":
            ql, kvl, rope, v = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
            q = d * ql + ql + ql * h * hd if ql else d * h * hd
            attn = q + d * (kvl + rope) + kvl + kvl * h * (self.qk_nope_head_dim + v) + h * v * d
        else:
            norm = (2 * hd if self.qk_norm_scope == "head" else (h + hkv) * hd) if self.qk_norm else 0
            bias = (h + 2 * hkv) * hd if self.attention_bias else 0
            attn = d * hd * (2 * h + 2 * hkv) + norm + bias
        shared = 3 * d * self.num_shared_experts * self.moe_intermediate_size
        moe = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts + shared
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
                    norm_topk_prob=False, qk_norm_scope="full", first_dense_layers=0, dense_intermediate_size=1024,
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
    def qwen3_235b_a22b(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of Qwen3-235B-A22B (94 MoE layers, E=128, K=8)."""
        base = dict(vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                    head_dim=128, rope_theta=1_000_000.0, num_experts=128, top_k=8,
                    moe_intermediate_size=1536, first_dense_layers=0, dense_intermediate_size=12288,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        return cls(**{**base, **overrides})

    @classmethod
    def deepseek_v3(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of DeepSeek-V3 (61 layers, 3 dense + 58 MoE, E=256, K=8, 8 groups pick 4,
        1 shared expert, MLA). The hub checkpoint's YaRN RoPE scaling is not modelled."""
        base = dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
                    head_dim=192, qk_norm=False, rope_theta=10_000.0, num_experts=256, top_k=8,
                    moe_intermediate_size=2048, first_dense_layers=3, dense_intermediate_size=18432,
                    router="sigmoid_bias_grouped", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    num_shared_experts=1, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                    qk_rope_head_dim=64, v_head_dim=128, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        return cls(**{**base, **overrides})

    @classmethod
    def kimi_k2(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of Kimi-K2 (DeepSeek-V3 architecture: 61 layers, 1 dense + 60 MoE,
        E=384 so routes are int16, K=8, no group limit, 1 shared expert, MLA with 64 heads)."""
        base = dict(vocab_size=163840, num_heads=64, num_kv_heads=64, rope_theta=50_000.0, num_experts=384,
                    first_dense_layers=1, n_group=1, topk_group=1, routed_scaling_factor=2.827)
        return cls.deepseek_v3(**{**base, **overrides})

    @classmethod
    def glm4_5_air(cls, **overrides) -> "MoeConfig":
        """Shape-only preset of GLM-4.5-Air (46 layers, 1 dense + 45 MoE, E=128, K=8, sigmoid router
        with bias, 1 shared expert, q/k/v bias, RoPE on half of each head)."""
        base = dict(vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
                    head_dim=128, qk_norm=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                    num_experts=128, top_k=8, moe_intermediate_size=1408, first_dense_layers=1,
                    dense_intermediate_size=10944, router="sigmoid_bias_grouped", num_shared_experts=1,
                    attention_bias=True, partial_rotary_factor=0.5, dtype=jnp.bfloat16,
                    param_dtype=jnp.bfloat16)
        return cls(**{**base, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides) -> "MoeConfig":
        presets = {"tiny": cls.tiny, "small_100m": cls.small_100m, "qwen3_30b_a3b": cls.qwen3_30b_a3b,
                   "olmoe_1b_7b": cls.olmoe_1b_7b, "mixtral_8x7b": cls.mixtral_8x7b,
                   "qwen3_235b_a22b": cls.qwen3_235b_a22b, "deepseek_v3": cls.deepseek_v3,
                   "kimi_k2": cls.kimi_k2, "glm4_5_air": cls.glm4_5_air}
        if name not in presets:
            raise ValueError(f"preset={name!r}: expected one of {sorted(presets)}")
        return presets[name](**overrides)
