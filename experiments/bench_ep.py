"""Expert parallelism on 8 simulated CPU devices: does the compiled train step's work split?

For each mesh, the jitted train step (replay="rollout", momentum SGD) is compiled ahead of time and
XLA's cost analysis of the compiled program gives its per-device flops and bytes accessed (a
partitioned program's cost analysis is per device); the ratio to the one-device program is the
share of the work each device does (ideal 1/8 = 0.125). Meshes: (data 8): experts replicated,
each device its own tokens; (data 2, expert 4) and (expert 8): expert-parallel; for reference also
(fsdp 2, expert 4). Kernels: the default "ragged" and "dense" (reference). "partitioner" rows
compile the same step with the MoE layers left to XLA's partitioner (models.expert_parallel.plan
patched to None: what main did, except for the batch and expert layouts of this branch).

Wall time (default kernel): median of interleaved step times on each mesh, and the ratio to
(data 8), whose experts are replicated (each device runs every expert on its own tokens). The 8
devices share this machine's few cores (2 here, loaded by other jobs): the wall times say little
about a real multi-chip speedup; the cost-analysis ratios are deterministic.

    python -m experiments.bench_ep [--quick] [--kernels ragged,dense] [--no-wall]
"""

from __future__ import annotations

import argparse
import os
import time

# 8 simulated devices, set before JAX starts (run as a script: nothing imported JAX yet)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from experiments.common import table, write_json  # noqa: E402
from models import expert_parallel  # noqa: E402
from r3jax import train  # noqa: E402
from experiments.synthetic import synthetic_batch
from r3jax.sharding import make_mesh, shard_batch  # noqa: E402

MESHES = {"data8": (8, 1, 1), "data2_expert4": (2, 1, 4), "fsdp2_expert4": (1, 2, 4), "expert8": (1, 1, 8)}



def compiled_step(model, batch, mesh, *, ep: bool):
    """(compiled train step, state, placed batch); ep=False leaves the MoE to the partitioner."""
    jax.clear_caches()
    train.step._CACHE.clear()
    tx = optax.sgd(1e-3, momentum=0.9)
    state = train.init_train_state(model, tx, mesh=mesh)
    placed = shard_batch(batch, state.mesh)
    plan = expert_parallel.plan
    if not ep:
        expert_parallel.plan = lambda *a: None
    try:
        c = train.make_train_step(state, replay="rollout").lower(state, placed).compile()
    finally:
        expert_parallel.plan = plan
    return c, state, placed


def cost(c) -> tuple[float, float]:
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca["flops"]), float(ca["bytes accessed"])


def step_times(runs: dict, reps: int) -> dict:
    """Median wall seconds per step of each compiled step, taken in interleaved rounds."""
    times = {k: [] for k in runs}
    for i in range(reps + 1):  # round 0 warms up
        for k in (list(runs) if i % 2 else list(runs)[::-1]):
            c, state, batch = runs[k]
            t0 = time.perf_counter()
            state, m = c(state, batch)
            jax.block_until_ready((state, m))
            runs[k] = (c, state, batch)
            if i:
                times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kernels", default="ragged,dense")
    ap.add_argument("--no-wall", action="store_true", help="cost analysis only")
    ap.add_argument("--quick", action="store_true", help="smaller batch, fewer reps")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq, args.reps = 16, 32, 3
    cfg = models.MoeConfig.tiny()
    batch = synthetic_batch(cfg, args.batch, args.seq)
    rows, walls = [], {}
    for kernel in args.kernels.split(","):
        m = models.MoeTransformer(cfg.replace(moe_impl=kernel), rngs=nnx.Rngs(0))
        c1, _, _ = compiled_step(m, batch, None, ep=True)
        f1, b1 = cost(c1)
        rows.append(dict(kernel=kernel, mesh="one device", layer="-", flops=f1, bytes=b1,
                         flops_ratio=1.0, bytes_ratio=1.0))
        for name, shape in MESHES.items():
            for ep in (True, False):
                c, state, placed = compiled_step(m, batch, make_mesh(*shape), ep=ep)
                f, b = cost(c)
                rows.append(dict(kernel=kernel, mesh=name, layer="shard_map" if ep else "partitioner",
                                 flops=f, bytes=b, flops_ratio=f / f1, bytes_ratio=b / b1))
                if kernel == "ragged" and (ep or name == "data2_expert4"):
                    walls[f"{name} {'shard_map' if ep else 'partitioner'}"] = (c, state, placed)
    wall = {} if args.no_wall else step_times(walls, args.reps)
    base = wall.get("data8 shard_map", 1.0)  # experts replicated: each device all experts, own tokens
    wall_rows = [dict(run=k, step_s=v, vs_data8_replicated=v / base) for k, v in wall.items()]
    print(f"tiny model (E={cfg.num_experts}, K={cfg.top_k}, D={cfg.hidden_size}, "
          f"I={cfg.moe_intermediate_size}), batch [{args.batch}, {args.seq}], replay, 8 CPU devices")
    print(table(rows, ["kernel", "mesh", "layer", "flops", "bytes", "flops_ratio", "bytes_ratio"]))
    print(table(wall_rows, ["run", "step_s", "vs_data8_replicated"]))
    path = write_json("bench_ep", {
        "config": {"batch": args.batch, "seq": args.seq, "reps": args.reps, "model": "tiny",
                   "num_experts": cfg.num_experts, "top_k": cfg.top_k},
        "note": "per-device cost-analysis flops/bytes of the compiled train step (replay) ÷ one "
                "device's; wall times on 8 simulated devices sharing a loaded 2-core machine",
        "cost": rows, "wall": wall_rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
