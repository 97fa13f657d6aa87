"""Attention kernels on CPU: train-step temporaries vs sequence length, and step time.

    python -m experiments.bench_attention [--quick]

(a) Memory: ``jax.jit(grad(loss)).lower(...).compile().memory_analysis().temp_size_in_bytes`` of a small
model's train step (loss + gradient, batch 1) at 2k and 8k tokens, for the einsum reference (``xla``)
and ``blockwise``. Linear memory gives about 4x from 2k to 8k; materialised scores about 16x.
(b) Time: forward + backward of the attention of a whole model (each layer's q, k, v shapes at 2k
tokens, batch 1, f32, causal), blockwise at several block sizes ÷ the einsum reference, median of a few
repetitions in the same run, for the ``tiny`` and ``small_100m`` presets. The rest of the train step
(MLP, MoE, embeddings) is the same for every kernel, so the attention alone is the stricter ratio;
(c) the whole train step (loss + gradient at [1, 2048]) blockwise ÷ einsum on the same presets.
Writes experiments/results/bench_attention.json.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.common import block, table, timeit, write_json
from models import MoeConfig, MoeTransformer
from models.attention import attention

MEM_WIDTHS = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  num_experts=4, top_k=2, moe_intermediate_size=32, dense_intermediate_size=64, moe_impl="dense")


def train_temp_bytes(impl: str, seq: int, block_size: int = 512) -> int:
    """Temporaries of the compiled loss + gradient at [1, seq] tokens."""
    cfg = MoeConfig(**MEM_WIDTHS, attention_impl=impl, attention_block=block_size)
    graphdef, params, rest = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss(p, tokens):
        out = nnx.merge(graphdef, p, rest)(tokens, jnp.arange(seq, dtype=jnp.int32)[None])
        return jnp.mean(jax.nn.logsumexp(out.logits, axis=-1)) + out.aux_loss

    compiled = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, seq), jnp.int32)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def train_step_s(cfg: MoeConfig, impl: str, seq: int, repeats: int) -> float:
    """Median seconds of the whole model's loss + gradient at [1, seq] tokens with ``impl``."""
    cfg = cfg.replace(attention_impl=impl)
    graphdef, params, rest = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (1, seq), 0, cfg.vocab_size, jnp.int32)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]

    def loss(p):
        out = nnx.merge(graphdef, p, rest)(tokens, positions)
        return jnp.mean(jax.nn.logsumexp(out.logits, axis=-1)) + out.aux_loss

    step = jax.jit(jax.grad(loss))
    return timeit(lambda: block(step(params)), warmup=1, repeats=repeats)


def attention_step_s(cfg: MoeConfig, impl: str, seq: int, block_size: int, repeats: int) -> float:
    """Median seconds of forward + backward of ``cfg.num_layers`` attentions at [1, seq]."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (cfg.num_layers, 1, seq, cfg.num_heads, cfg.head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (cfg.num_layers, 1, seq, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    v = jax.random.normal(keys[2], k.shape, jnp.float32)
    w = jax.random.normal(keys[3], q.shape, jnp.float32)

    def loss(q, k, v):
        def layer(total, qkvw):
            q, k, v, w = qkvw
            out = attention(q, k, v, scale=cfg.head_dim ** -0.5, impl=impl, block=block_size)
            return total + jnp.sum(out * w), None

        return jax.lax.scan(layer, jnp.zeros(()), (q, k, v, w))[0]

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return timeit(lambda: block(step(q, k, v)), warmup=1, repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2k/4k memory, tiny only, 2 repetitions")
    ap.add_argument("--presets", default=None, help="comma-separated presets to time (default tiny,small_100m)")
    ap.add_argument("--blocks", default=None, help="comma-separated blockwise block sizes (default 256,512,1024)")
    ap.add_argument("--skip-memory", action="store_true", help="time only")
    args = ap.parse_args()
    short, long_ = (2048, 4096) if args.quick else (2048, 8192)
    blocks = tuple(int(b) for b in (args.blocks or ("512" if args.quick else "256,512,1024")).split(","))
    names = (args.presets or ("tiny" if args.quick else "tiny,small_100m")).split(",")
    presets = {n: getattr(MoeConfig, n)() for n in names}
    repeats = 2 if args.quick else 5

    memory = []
    for impl in () if args.skip_memory else ("xla", "blockwise"):
        a, b = train_temp_bytes(impl, short), train_temp_bytes(impl, long_)
        memory.append({"impl": impl, f"temp_{short}": a, f"temp_{long_}": b, "ratio": b / a})
    print(table([{"impl": m["impl"], f"temp MiB @{short}": m[f"temp_{short}"] / 2**20,
                  f"temp MiB @{long_}": m[f"temp_{long_}"] / 2**20, f"{long_}÷{short}": m["ratio"]} for m in memory],
                ["impl", f"temp MiB @{short}", f"temp MiB @{long_}", f"{long_}÷{short}"]))

    timing = []
    for name, cfg in presets.items():
        ref = attention_step_s(cfg, "xla", 2048, 512, repeats)
        timing.append({"preset": name, "impl": "xla", "block": None, "seconds": ref, "ratio": 1.0})
        for bs in blocks:
            sec = attention_step_s(cfg, "blockwise", 2048, bs, repeats)
            timing.append({"preset": name, "impl": "blockwise", "block": bs, "seconds": sec, "ratio": sec / ref})
    print(table([{"preset": t["preset"], "impl": t["impl"], "block": t["block"], "fwd+bwd s": t["seconds"],
                  "÷ xla": t["ratio"]} for t in timing], ["preset", "impl", "block", "fwd+bwd s", "÷ xla"]))

    steps = []  # the whole train step (MoE, MLP, embeddings included) at the default block
    for name, cfg in presets.items():
        ref = train_step_s(cfg, "xla", 2048, max(2, repeats // 2))
        sec = train_step_s(cfg, "blockwise", 2048, max(2, repeats // 2))
        steps.append({"preset": name, "tokens": 2048, "xla_s": ref, "blockwise_s": sec, "ratio": sec / ref})
    print(table(steps, ["preset", "tokens", "xla_s", "blockwise_s", "ratio"]))
    write_json("bench_attention", {"seq_lengths": [short, long_], "memory": memory, "timing": timing,
                                   "train_step": steps,
                                   "memory_widths": MEM_WIDTHS, "quick": args.quick})


if __name__ == "__main__":
    main()
