"""Where a decode step's time goes in the paged engine: host planning, handing the step to the device,
waiting for its outputs, taking them in, against the device step alone.

    python -m experiments.bench_step [--quick]

For tiny, small_100m (its preset's scanned layers) and small_100m with ``scan_layers=False`` (the same
model unrolled) at B = 1, 8, 32, 64 (prompt 16, greedy, routes captured, the engine's CPU
expert kernel): one warm ``generate`` of B requests x ``new`` tokens, then the engine's own counters
over it (``Engine.stats``: plan_s, dispatch_s, host_wait_s, process_s, steps), per step in ms; and the
decode-only step program timed alone on the same shapes (inputs on the device, outputs waited for):
``device_ms``. ``host_ms`` = plan + dispatch + process, the work the scheduler thread does per step
besides waiting; ``wall_ms`` = the generate's wall seconds per step. Writes
experiments/results/bench_step.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from experiments.common import table, write_json
from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateRequest

PROMPT = 16
KEYS = ("plan_s", "dispatch_s", "host_wait_s", "process_s", "steps")


def device_step_ms(eng: Engine, batch: int, kv_len: int, repeats: int = 10) -> float:
    """Best wall ms of the decode-only step program at ``batch`` rows with its inputs already on the
    device (the engine idle: its pool and ``last`` buffers are donated to the step and taken back)."""
    from r3jax.engine import step as dev

    lay = eng.layout(batch, 0)
    x = {name: np.zeros(shape, dtype) for name, shape, dtype in dev.input_spec(lay)}
    x["kv_len"][:], x["positions"][:], x["from_slot"][:], x["slot"][:] = kv_len, kv_len - 1, -1, eng.max_batch_size
    inputs = eng.placement.put(dev.pack(x, lay))
    args = lambda: (eng._params, eng._rest, eng._k, eng._v, eng._last, inputs)
    exe = eng.programs.get("step", lay, lambda: eng._build(lay, False), *args())
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = exe(*args())
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
        eng._k, eng._v, eng._last = out[:3]
    return 1e3 * best


def run(name: str, batches, new: int, scan_layers: bool = True) -> list[dict]:
    model = MoeTransformer(MoeConfig.preset(name, scan_layers=scan_layers), rngs=nnx.Rngs(0))
    layout = "scanned" if model.config.scan_layers and model.config.num_layers >= model.config.scan_min_layers else "unrolled"
    eng = Engine(model, max_seq_len=PROMPT + new, max_batch_size=max(batches), prefix_cache_bytes=0)
    eng.warmup()
    rows = []
    rng = np.random.default_rng(0)
    try:
        for b in batches:
            reqs = lambda: [GenerateRequest(prompt_ids=rng.integers(0, model.config.vocab_size, PROMPT).tolist(),
                                            max_tokens=new, temperature=0.0, return_routed_experts=True)
                            for _ in range(b)]
            eng.generate(reqs())  # warm: threads, first dispatches
            before = {k: eng.stats[k] for k in KEYS}
            t0 = time.perf_counter()
            eng.generate(reqs())
            wall = time.perf_counter() - t0
            d = {k: eng.stats[k] - before[k] for k in KEYS}
            steps = max(d["steps"], 1)
            ms = lambda k: 1e3 * d[k] / steps
            row = {"config": name, "layers": layout, "B": b, "new_tokens": new, "steps": d["steps"], "wall_ms": 1e3 * wall / steps,
                   "plan_ms": ms("plan_s"), "dispatch_ms": ms("dispatch_s"), "wait_ms": ms("host_wait_s"),
                   "process_ms": ms("process_s"), "tok_s": b * new / wall}
            row["host_ms"] = row["plan_ms"] + row["dispatch_ms"] + row["process_ms"]
            row["device_ms"] = device_step_ms(eng, b, PROMPT + new // 2)
            row["host_over_device"] = row["host_ms"] / row["device_ms"]
            rows.append(row)
            print(row, flush=True)
    finally:
        eng.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 new tokens (64 otherwise)")
    args = ap.parse_args()
    new = 32 if args.quick else 64
    rows = []
    for name, scan in (("tiny", True), ("small_100m", True), ("small_100m", False)):
        rows += run(name, (1, 8, 32, 64), new, scan_layers=scan)
    print(table(rows, ["config", "layers", "B", "steps", "wall_ms", "plan_ms", "dispatch_ms", "wait_ms", "process_ms", "host_ms",
                       "device_ms", "host_over_device", "tok_s"]))
    print("wrote", write_json("bench_step", {"quick": args.quick, "prompt_tokens": PROMPT, "rows": rows}))


if __name__ == "__main__":
    main()
