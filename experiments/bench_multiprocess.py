"""Multi-process training on one machine: step time of 2 processes x 4 CPU devices ÷ 1 process x 8.

    python -m experiments.bench_multiprocess [--steps 12] [--batch-size 32] [--repeats 2] [--quick]

Each run is ``python -m r3jax train`` on the same synthetic rollout rows (tiny model, S = 32,
``--replay rollout``), started by r3jax.train.local_job; the step time is the median of the
``step_s`` of steps 3.. (step 1 compiles, or loads from runs/.jax-compilation-cache; checkpoints
only after the last step). Three ways to run
the same 8-device mesh: one plain process (XLA's in-process CPU collectives), one process in a
1-process jax.distributed job (gloo collectives, the bit-exact reference of the two-process test),
and two processes of 4 devices (gloo over loopback TCP). ratio = two processes ÷ one plain process,
ratio_gloo = two processes ÷ one gloo process, all from the same invocation. The three runs are
repeated round-robin ``--repeats`` times and each keeps its best median (the least disturbed run).
All processes share this machine's cores (2 here, and other jobs), so this measures coordination
overhead, not a speed-up: on real hosts each process brings its own accelerators.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


import models
from experiments.common import table, write_json
from experiments.synthetic import synthetic_rows
from r3jax.train.local_job import LocalJob

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("8,1,1", "1,4,2")  # pure data parallel; fsdp across both processes x expert



def step_time(out: Path) -> tuple[float, int]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step_s"] for r in recs[2:]]
    return statistics.median(timed), len(timed)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="6 steps, batch 16, one mesh, one repeat")
    args = ap.parse_args(argv)
    steps, batch, meshes, repeats = ((6, 16, MESHES[:1], 1) if args.quick else
                                     (args.steps, args.batch_size, MESHES, args.repeats))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", NPROC="8")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = synthetic_rows(models.MoeConfig.tiny(), tmp / "rows", 2 * batch)
        for mesh in meshes:
            common = ["--data", str(rows), "--batch-size", str(batch), "--mesh", mesh, "--steps", str(steps),
                      "--save-every", str(steps), "--compilation-cache", str(ROOT / "runs" / ".jax-compilation-cache")]
            times = {}
            for rep in range(repeats):
                for name, n, distributed in (("one", 1, False), ("one_gloo", 1, True), ("two", 2, True)):
                    out = tmp / f"{mesh}-{name}-{rep}"
                    with LocalJob(n, common + ["--out", str(out)], devices_per_process=8 // n, env=env,
                                  cwd=ROOT, distributed=distributed) as job:
                        job.wait(timeout=900)
                    t, timed = step_time(out)
                    times[name] = min(times.get(name, t), t)
                    print(f"mesh {mesh} {name} run {rep + 1}: {t * 1e3:.1f} ms/step (median of {timed})", flush=True)
            results.append({"mesh": mesh, "B": batch, "S": 32, "one_ms": times["one"] * 1e3,
                            "one_gloo_ms": times["one_gloo"] * 1e3, "two_ms": times["two"] * 1e3,
                            "ratio": times["two"] / times["one"], "ratio_gloo": times["two"] / times["one_gloo"]})
    print(table(results, ["mesh", "B", "S", "one_ms", "one_gloo_ms", "two_ms", "ratio", "ratio_gloo"]))
    path = write_json("bench_multiprocess", {"steps": steps, "repeats": repeats,
                                             "timed_steps": f"best of {repeats} runs' medians of steps 3..{steps}",
                                             "config": "tiny", "replay": "rollout", "results": results,
                                             "note": "all processes share this machine's CPU cores (loaded)"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
