"""Pilot runs for a testbed where RL learns: does the no-replay arm's reward rise, by how much, with
which learning rate and how many steps.

    python -m experiments.learn_pilot [--quick] [--settings NAME,...]

Each setting is the demo (``python -m r3jax demo``: tiny model, the toy multi-turn task, a supervised
warm start on demonstrations, then GRPO steps, rollouts in bf16 on the in-process engine) run with
``--replay none`` over 5 seeds. Reported per setting over seeds (mean ± 95% CI half-width): the
training reward over the first and the last quarter of the steps, their paired difference per seed
(``reward_gain``: the learning signal the testbed must show, goal >= 0.1 with a CI above 0), and the
greedy reward on held-out environments after step 1 and after the last (``eval_first`` /
``eval_last``, ``eval_gain``), and the trainer router's disagreement with the rollout's routes
(``live_routing_disagreement``: the mismatch a setting carries; ``--router-noise`` adds simulated
selection noise to the rollout engine's router to make it material). Settings that did not learn are
reported as well. Writes
experiments/results/learn_pilot.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from experiments.common import table, write_json
from r3jax.demo import main as demo_main

# name -> demo flags (besides --replay none, --in-process, --seeds, --out, --no-progress)
SETTINGS = {
    "echo lr1e-3 30 steps": ["--env", "echo", "--lr", "1e-3", "--steps", "30"],
    "echo lr3e-3 30 steps": ["--env", "echo", "--lr", "3e-3", "--steps", "30"],
    # material mismatch for the replay grid: simulated selection noise on the rollout router's logits
    **{f"echo lr1e-3 30 steps, router noise {sigma}": ["--env", "echo", "--lr", "1e-3", "--steps", "30",
                                                       "--router-noise", sigma] for sigma in ("0.1", "0.25", "0.5")},
}
QUICK = {"echo lr1e-3 3 steps (quick)": ["--env", "echo", "--lr", "1e-3", "--steps", "3", "--eval-every", "2"]}


def run_setting(flags: list[str], seeds: int, out: str) -> dict:
    summary = demo_main(["--replay", "none", "--in-process", "--seeds", str(seeds), "--out", out, "--no-progress",
                         *flags])
    [row] = [r for r in summary["runs"] if r["mode"] == "none"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one 3-step setting over 2 seeds (a smoke run)")
    ap.add_argument("--settings", default=None, help="comma-separated setting names (default: all)")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    settings = QUICK if args.quick else SETTINGS
    if args.settings:
        settings = {k: settings[k] for k in args.settings.split(",")}
    seeds = 2 if args.quick else args.seeds
    rows, t0 = [], time.perf_counter()
    for name, flags in settings.items():
        with tempfile.TemporaryDirectory(prefix="r3jax-learn-pilot-") as out:
            row = run_setting(flags, seeds, out)
        gain = row["reward_gain"]
        rows.append({"setting": name, "flags": " ".join(flags), "seeds": len(row["seeds"]), "steps": row["steps"],
                     "reward_first": row["reward_first"], "reward_last": row["reward_last"], "reward_gain": gain,
                     "eval_first": row.get("eval_first"), "eval_last": row.get("eval_last"),
                     "eval_gain": row.get("eval_gain"), "collapses": row["collapses"],
                     "live_routing_disagreement": row.get("live_routing_disagreement"),
                     "learns": bool(gain[0] >= 0.1 and gain[0] - gain[1] > 0)})
        print(rows[-1], flush=True)
    cols = ["setting", "seeds", "steps", "reward_first", "reward_last", "reward_gain", "eval_first", "eval_last",
            "live_routing_disagreement", "collapses", "learns"]
    fmt = lambda v: f"{v[0]:.3g} ± {v[1]:.2g}" if isinstance(v, list) else v
    print(table([{k: fmt(v) for k, v in r.items()} for r in rows], cols))
    write_json("learn_pilot", {"quick": args.quick, "seeds": seeds, "rows": rows, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
