"""The rollout engine in bf16 against fp32, side by side in one run: step time and tokens/s.

    python -m experiments.bench_dtype [--quick] [--configs tiny peer]

For each config (tiny, and the peer config of experiments/peer_config.py: a Qwen3-MoE checkpoint
written by transformers from random weights) one fp32 model gets two engines of the same shape, one
computing in fp32 and one in bf16 (``Engine(dtype=jnp.bfloat16)``, what a bf16 rollout server runs).
Both warm up, then take turns: each round generates ``BATCH`` requests of ``PROMPT`` random tokens and
``NEW`` sampled tokens (seeded, routes returned) on one engine, then on the other, so both see the same
load on this shared machine. Figures per engine (median over rounds): wall seconds of a round, device
steps per round, seconds per step, generated tokens/s, the host's wait on step outputs per step, and
bf16 ÷ fp32. Also the page pool's storage dtype (on CPU 16-bit floats are stored as their uint16 bits:
XLA:CPU would otherwise convert the whole pool to f32 on every step).

Writes experiments/results/bench_dtype.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import table, write_json
from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateRequest

BATCH, PROMPT, NEW, MAX_SEQ = 64, 30, 16, 128


def build(name: str) -> MoeTransformer:
    if name == "peer":
        from experiments.peer_config import peer_model

        return peer_model(seed=0)[0]
    return MoeTransformer(getattr(MoeConfig, name)(), rngs=nnx.Rngs(0))


def round_trip(engine: Engine, prompts: np.ndarray, seed: int) -> tuple[float, dict]:
    before = engine.stats
    t0 = time.perf_counter()
    outs = engine.generate([GenerateRequest(prompt_ids=p.tolist(), max_tokens=NEW, seed=seed + i, temperature=1.0,
                                            return_routed_experts=True) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    after = engine.stats
    assert all(len(o.output_ids) == NEW for o in outs)
    return wall, {k: after[k] - before[k] for k in ("steps", "host_wait_s", "generated_tokens")}


def bench_config(name: str, rounds: int) -> list[dict]:
    model = build(name)
    vocab = model.config.vocab_size
    engines = {dt: Engine(model, max_seq_len=MAX_SEQ, max_batch_size=BATCH, prefix_cache_bytes=0,
                          dtype=getattr(jnp, dt)) for dt in ("float32", "bfloat16")}
    warm = {dt: e.warmup()["seconds"] for dt, e in engines.items()}
    rng = np.random.default_rng(0)
    samples = {dt: [] for dt in engines}
    for r in range(rounds + 1):  # round 0: first calls (host caches, allocator), not counted
        prompts = rng.integers(0, vocab, (BATCH, PROMPT))
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for dt in order:
            wall, d = round_trip(engines[dt], prompts, seed=1000 * r)
            if r:
                samples[dt].append((wall, d))
    rows = []
    for dt, runs in samples.items():
        wall = statistics.median(w for w, _ in runs)
        steps = statistics.median(d["steps"] for _, d in runs)
        wait = statistics.median(d["host_wait_s"] / d["steps"] for _, d in runs)
        rows.append({"config": name, "dtype": dt, "pool_dtype": str(engines[dt]._k[0].dtype),
                     "round_s": round(wall, 4), "steps": int(steps), "step_ms": round(1e3 * wall / steps, 2),
                     "tokens_per_s": round(BATCH * NEW / wall, 1), "host_wait_ms": round(1e3 * wait, 2),
                     "warmup_s": round(warm[dt], 1), "rounds": len(runs),
                     "round_s_all": [round(w, 4) for w, _ in runs]})
    for e in engines.values():
        e.close()
    ratio = rows[1]["round_s"] / rows[0]["round_s"]
    for row in rows:
        row["bf16_over_fp32"] = round(ratio, 2)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    ap.add_argument("--configs", nargs="+", default=["tiny", "peer"], help="tiny, small_100m or peer")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else 9
    rows = [row for name in args.configs for row in bench_config(name, rounds)]
    print(table(rows, ["config", "dtype", "pool_dtype", "round_s", "steps", "step_ms", "tokens_per_s",
                       "host_wait_ms", "bf16_over_fp32"]))
    payload = {"batch": BATCH, "prompt": PROMPT, "new": NEW, "max_seq_len": MAX_SEQ, "rounds": rounds, "rows": rows,
               "target": "bf16 / fp32 round time <= 1.5"}
    path = write_json("bench_dtype", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
