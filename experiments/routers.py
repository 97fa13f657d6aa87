"""Router families under replay, small: mismatch with and without R3, replay cost, route bytes per preset.

    python -m experiments.routers [--quick] [--families softmax_topk,sigmoid_bias_grouped,sigmoid_mla]

1. For each router family (tiny dims, random init, fp32 parameters) this reruns the
   ``replay_mismatch`` measurement (experiments/replay_mismatch.py): the in-process engine samples
   rollouts in bf16 and in fp32 (control); an fp32 trainer scores them with ``replay="none"`` and
   ``"rollout"``. Reported: the trainer router's own routing disagreement with the rollout (under
   replay too; the experts replay uses are the rollout's by construction), tokens with any
   differing layer, mean |Δ|, k3 KL.
   The sigmoid families use a nonzero selection bias and (grouped) 4 groups of which 2 are chosen.
2. The fp32 train step with replay ÷ without per family (interleaved wall-time pairs and XLA's
   flops/bytes ratio of the two compiled programs).
3. Route bytes per token row (L x K ids) for every preset, in uint8 (E <= 256 only) and int16.

Writes experiments/results/routers.json.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import table, write_json
from experiments.replay_mismatch import COLUMNS, measure
from models import MoeConfig
from r3jax.routes import route_dtype

PRESETS = ("tiny", "small_100m", "qwen3_30b_a3b", "qwen3_235b_a22b", "olmoe_1b_7b", "mixtral_8x7b",
           "deepseek_v3", "kimi_k2", "glm4_5_air")
_SIGMOID = dict(router="sigmoid_bias_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                num_shared_experts=1)
FAMILIES = {
    "softmax_topk": dict(),  # MoeConfig.tiny(): Qwen3-MoE-style
    "sigmoid_bias_grouped": _SIGMOID,  # DeepSeek-V3 / GLM-4.5 routing on GQA attention
    "sigmoid_mla": dict(_SIGMOID, attention="mla", num_kv_heads=4, head_dim=24, qk_rope_head_dim=8,
                        q_lora_rank=32, kv_lora_rank=16, v_head_dim=16, qk_norm=False),  # DeepSeek-V3-shaped
}


def route_bytes() -> list[dict]:
    rows = []
    for name in PRESETS:
        cfg = MoeConfig.preset(name)
        ids = cfg.num_moe_layers * cfg.top_k
        rows.append({"preset": name, "moe_layers": cfg.num_moe_layers, "E": cfg.num_experts, "K": cfg.top_k,
                     "dtype": np.dtype(route_dtype(cfg.num_experts)).name,
                     "uint8_bytes_per_row": ids if cfg.num_experts <= 256 else None,
                     "int16_bytes_per_row": 2 * ids,
                     "bytes_per_row": ids * np.dtype(route_dtype(cfg.num_experts)).itemsize,
                     "mib_per_32k_tokens": ids * np.dtype(route_dtype(cfg.num_experts)).itemsize * 32768 / 2**20})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rollouts and timing repeats")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plan = dict(n=8, prompt_len=8, max_tokens=24, reps=15) if args.quick else \
        dict(n=8, prompt_len=16, max_tokens=48, reps=31)

    sizes = route_bytes()
    print(table(sizes, list(sizes[0])))
    print()

    import experiments.replay_mismatch as rm
    original = rm.MoeTransformer

    def biased_model(cfg, *, rngs):  # a nonzero selection bias, so replaying it (or not) matters
        model = original(cfg, rngs=rngs)
        bias = 0.02 * jax.random.normal(jax.random.key(args.seed + 7), (cfg.num_experts,))  # same in every layer
        mlps = [model.moe_layers.mlp] if cfg.scan_layers else [layer.mlp for layer in model.layers]
        for mlp in mlps:
            if hasattr(mlp, "router_bias"):
                mlp.router_bias[...] = jnp.broadcast_to(bias, mlp.router_bias.shape)
        return model

    rm.MoeTransformer = biased_model
    rows, timings = [], []
    print(table([], COLUMNS))
    try:
        for fam in args.families.split(","):
            r, t = measure(fam, MoeConfig.tiny(**FAMILIES[fam]), seed=args.seed, **plan)
            rows += r
            timings.append(t)
    finally:
        rm.MoeTransformer = original
    print()
    print(table(rows, COLUMNS))
    print()
    tcols = ["config", "tokens", "step_s_live", "step_s_replay", "replay_step_ratio", "ratio_of_min",
             "xla_flops_ratio", "xla_bytes_ratio", "reps"]
    print(table(timings, tcols))
    path = write_json("routers", {"args": vars(args), "plan": plan, "families": {k: {kk: str(vv) for kk, vv in v.items()}
                                                                                  for k, v in FAMILIES.items()},
                                  "route_bytes": sizes, "mismatch": rows, "timing": timings,
                                  "rollout": "in-process r3jax.engine.Engine (bf16 and fp32 compute)"})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
