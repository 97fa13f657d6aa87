"""Compile time of the jitted train step vs depth: scanned layers vs unrolled.

    python -m experiments.bench_scan [--depths 2,8,16,48] [--quick]

For each depth (all-MoE layers, tiny widths so it fits on 2 CPU cores) and layout, builds the real
``r3jax.train`` step (value_and_grad of the policy loss with rollout replay, then an adam update) and
times ``lower`` (tracing) and ``compile`` (XLA) of it, wall and process-CPU seconds (the CPU time is
less disturbed by other jobs on a shared machine). Layouts: ``unrolled`` (``scan_layers=False``),
``scanned`` (the default; a run of fewer than ``scan_min_layers`` layers is lowered unrolled) and
``scanned_loop`` (``scan_min_layers=1``: a real loop at every depth; listed only where it differs from
``scanned``). Ratios are scanned ÷ unrolled from the same run. Also: decode step time through the KV
cache (the cache carried through the scan) at depths 8 and 16, so a loop does not cost the engine
speed. Writes experiments/results/bench_scan.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.common import table, write_json
from models import KVCache, MoeConfig, MoeTransformer
from r3jax import train
from r3jax.batch import collate

WIDTHS = dict(vocab_size=128, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
              moe_intermediate_size=16, first_dense_layers=0)
B, S = 2, 32


def _batch(cfg: MoeConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    trajs = []
    for _ in range(B):
        n = S - 4
        routes = np.stack([[rng.permutation(cfg.num_experts)[:cfg.top_k] for _ in range(cfg.num_moe_layers)]
                           for _ in range(n)]).astype(np.uint8)
        captured = np.arange(n) < n - 1
        trajs.append(dict(tokens=rng.integers(1, cfg.vocab_size, n).astype(np.int32),
                          loss_mask=(np.arange(n) >= 8).astype(np.float32),
                          rollout_logprobs=np.full(n, -1.0, np.float32), advantage=1.0, routes=routes,
                          captured=captured))
    return collate(trajs, seq_len=S, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers)


def measure(depth: int, layout: str) -> dict:
    layout_cfg = {"unrolled": dict(scan_layers=False), "scanned": {},
                  "scanned_loop": dict(scan_min_layers=1)}[layout]
    cfg = MoeConfig(**WIDTHS, num_layers=depth, **layout_cfg)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    state = train.init_train_state(model, optax.adam(1e-3))
    step = train.make_train_step(state, replay="rollout")
    batch = _batch(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.lower(state, batch)
    t1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return {"depth": depth, "layout": layout, "lower_s": t1 - t0, "compile_s": t2 - t1, "compile_cpu_s": c2 - c1,
            "lower_cpu_s": c1 - c0}


def decode_ms(depth: int, layout: str, *, batch: int = 8, seq: int = 1024, steps: int = 32) -> dict:
    """Milliseconds per greedy decode step (all rows, one token each) over a [batch, seq] cache, the
    steps inside one jitted fori_loop; best of 5."""
    cfg = MoeConfig(**WIDTHS, num_layers=depth, moe_impl="loop", scan_layers=layout != "unrolled")
    graphdef, state = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)))

    def run(state, cache):
        model = nnx.merge(graphdef, state)

        def body(i, carry):
            tok, cache = carry
            out = model(tok, jnp.full((batch, 1), seq // 2 + i, jnp.int32), cache=cache)
            return jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32), out.cache

        return jax.lax.fori_loop(0, steps, body, (jnp.zeros((batch, 1), jnp.int32), cache))

    fn = jax.jit(run, donate_argnums=1)
    jax.block_until_ready(fn(state, KVCache.init(cfg, batch, seq)))
    times = []
    for _ in range(5):
        cache = jax.block_until_ready(KVCache.init(cfg, batch, seq))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(state, cache))
        times.append(time.perf_counter() - t0)
    return {"depth": depth, "layout": layout, "B": batch, "S": seq, "ms_per_step": min(times) / steps * 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--depths", default="2,8,16,48")
    ap.add_argument("--quick", action="store_true", help="depths 2 and 8 only")
    args = ap.parse_args()
    depths = [2, 8] if args.quick else [int(d) for d in args.depths.split(",")]
    min_loop = MoeConfig().scan_min_layers
    rows = []
    for depth in depths:
        layouts = ["unrolled", "scanned"] + (["scanned_loop"] if depth < min_loop else [])
        for layout in layouts:
            rows.append(measure(depth, layout))
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    by = {(r["depth"], r["layout"]): r for r in rows}
    summary = []
    for depth in depths:
        u = by[(depth, "unrolled")]
        for layout in ("scanned", "scanned_loop"):
            if (depth, layout) in by:
                s = by[(depth, layout)]
                summary.append({"depth": depth, "layout": layout, "unrolled_compile_s": u["compile_s"],
                                "scanned_compile_s": s["compile_s"], "ratio": s["compile_s"] / u["compile_s"],
                                "unrolled_cpu_s": u["compile_cpu_s"], "scanned_cpu_s": s["compile_cpu_s"],
                                "cpu_ratio": s["compile_cpu_s"] / u["compile_cpu_s"],
                                "unrolled_lower_s": u["lower_s"], "scanned_lower_s": s["lower_s"]})
    cols = ["depth", "layout", "unrolled_compile_s", "scanned_compile_s", "ratio", "unrolled_cpu_s", "scanned_cpu_s",
            "cpu_ratio", "unrolled_lower_s", "scanned_lower_s"]
    print(table(summary, cols))
    decode = [decode_ms(d, layout) for d in ([8] if args.quick else [8, 16]) for layout in ("unrolled", "scanned")]
    for r in decode:
        r["scanned_over_unrolled"] = r["ms_per_step"] / next(x["ms_per_step"] for x in decode
                                                            if x["depth"] == r["depth"] and x["layout"] == "unrolled")
    print(table(decode, ["depth", "layout", "B", "S", "ms_per_step", "scanned_over_unrolled"]))
    print("wrote", write_json("bench_scan", {"rows": rows, "summary": summary, "decode": decode, "widths": WIDTHS,
                                             "B": B, "S": S,
                                             "scan_min_layers": min_loop,
                                             "note": "shared 2-core machine under load; CPU seconds are the "
                                                     "steadier measure"}))


if __name__ == "__main__":
    main()
