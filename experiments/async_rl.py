"""Synchronous against asynchronous RL on the testbed that learns, without and with routing replay.

    python -m experiments.async_rl [--schedules sync,async1,async4] [--arms none,R3] [--seeds 3]
                                   [--summarize] [--quick]

The testbed is experiments/replay_learn's (the demo's echo task on the tiny model, a supervised warm
start, 30 GRPO steps at lr 1e-3, in-process engine, bf16 rollouts). A **schedule** says when rollouts are
sampled: ``sync`` samples each step's rollouts after the previous step's weights are pushed (staleness
0); ``async<K>`` is the demo's ``--async --max-staleness K``: a thread samples up to K steps ahead of the
trainer on the weights pushed so far (pushed with mode "keep", so a trajectory can span versions), and
no token is older than K versions when trained on. **Arms**: ``none`` (live routing) and ``R3`` (the
rollout's routes, each row from the version that produced it). Seed s is the demo's ``--seed s`` in every
cell (same initialisation, warm start and sampling seeds).

Per run it stores the demo's per-step records (reward, eval_reward where evaluated, version_lag_mean /
max, stale_masked, k3_kl, elapsed_s, samples, ...) in ``experiments/results/async_rl[_quick].json``
(``runs["<schedule>/<arm>"][seed]``, resumable: experiments/dose_grid.py). The summary, per cell: the
reward over the first and the last quarter of the steps, the throughput (samples per second from the end
of step 1 to the end of the last step, so step 1's compiles are left out), the mean and largest version
lag of trained tokens, the tokens masked as too stale, the k3 KL (mean ± 95% CI over seeds); and per
async cell the paired ratio of its throughput to ``sync``'s and the paired difference of its
last-quarter reward, same arm, same seeds. On 2 CPU cores the sampler and the trainer share the cores,
so the throughput gain is a lower bound of what separate rollout devices give.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

from experiments.common import RESULTS
from experiments.dose_grid import _locked, load, run_grid
from experiments.replay_learn import TESTBED, demo_records
from r3jax.metrics import mean_ci95

ARMS = {"none": ["--replay", "none"], "R3": ["--replay", "rollout"]}
BASE = "sync"


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str  # "sync" or "async<K>"

    @property
    def flags(self) -> list[str]:
        if self.name == "sync":
            return []
        if self.name.startswith("async") and self.name[5:].isdigit():
            return ["--async", "--max-staleness", self.name[5:]]
        raise ValueError(f"schedule {self.name!r}: expected 'sync' or 'async<K>' (K >= 0 steps ahead)")

    def describe(self) -> dict:
        return {"flags": self.flags}


def _quarter(records: list[dict], key: str, last: bool) -> float:
    vals = [r[key] for r in records if key in r]
    n = max(1, len(vals) // 4)
    return float(np.mean(vals[-n:] if last else vals[:n]))


def throughput(records: list[dict]) -> float:
    """Samples per second over steps 2..N (step 1 compiles the train step)."""
    later = records[1:]
    return sum(r["samples"] for r in later) / (records[-1]["elapsed_s"] - records[0]["elapsed_s"])


def _ci(values) -> list[float]:
    m, h = mean_ci95([float(v) for v in values])
    return [m, h]


def summarize(runs: dict, seeds_wanted: int, provenance: dict | None = None) -> dict:
    """Per cell, and per async cell against ``sync`` (same arm, paired seeds), from the records alone."""
    cells = {}
    for cell, per_seed in runs.items():
        recs = list(per_seed.values())
        cells[cell] = {
            "seeds": len(recs), "complete": len(recs) >= seeds_wanted,
            "reward_first": _ci(_quarter(rs, "reward", False) for rs in recs),
            "reward_last": _ci(_quarter(rs, "reward", True) for rs in recs),
            "samples_per_s": _ci(throughput(rs) for rs in recs),
            "version_lag_mean": _ci(np.mean([r.get("version_lag_mean", 0.0) for r in rs]) for rs in recs),
            "version_lag_max": int(max(r.get("version_lag_max", 0) for rs in recs for r in rs)),
            "stale_masked": int(sum(r.get("stale_masked", 0) for rs in recs for r in rs)),
            "k3_kl": _ci(np.mean([r["k3_kl"] for r in rs]) for rs in recs)}
    comparisons = []
    for cell in cells:
        schedule, arm = cell.rsplit("/", 1)
        base = f"{BASE}/{arm}"
        if schedule == BASE or base not in runs:
            continue
        seeds = sorted(set(runs[cell]) & set(runs[base]), key=int)
        if len(seeds) < 2:
            continue
        ratio = [throughput(runs[cell][s]) / throughput(runs[base][s]) for s in seeds]
        diff = [_quarter(runs[cell][s], "reward", True) - _quarter(runs[base][s], "reward", True) for s in seeds]
        r, d = mean_ci95(ratio), mean_ci95(diff)
        comparisons.append({"arm": arm, "comparison": f"{schedule} vs {BASE}", "seeds": len(seeds),
                            "throughput_ratio": list(r), "reward_last_diff": list(d),
                            "reward_verdict": "higher" if d[0] - d[1] > 0 else "lower" if d[0] + d[1] < 0
                            else "no measurable difference"})
    return {"cells": cells, "comparisons": comparisons}


def tables(summary: dict) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v[0]:.3g} ± {v[1]:.2g}"  # noqa: E731
    lines = ["| schedule | arm | seeds | reward first → last | samples/s | version lag (mean, max) | "
             "stale tokens masked | k3 KL |", "|---|---|---|---|---|---|---|---|"]
    for cell, c in summary["cells"].items():
        schedule, arm = cell.rsplit("/", 1)
        lines.append(f"| {schedule} | {arm} | {c['seeds']}{'' if c['complete'] else ' (incomplete)'} | "
                     f"{fmt(c['reward_first'])} → {fmt(c['reward_last'])} | {fmt(c['samples_per_s'])} | "
                     f"{fmt(c['version_lag_mean'])}, {c['version_lag_max']} | {c['stale_masked']} | {fmt(c['k3_kl'])} |")
    if summary["comparisons"]:
        lines += ["", "| arm | comparison | seeds | throughput ratio (95% CI) | last-quarter reward diff | verdict |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c['arm']} | {c['comparison']} | {c['seeds']} | {fmt(c['throughput_ratio'])} | "
                  f"{fmt(c['reward_last_diff'])} | {c['reward_verdict']} |" for c in summary["comparisons"]]
    return "\n".join(lines)


def run_one(testbed: list[str], schedule: Schedule, arm: str, seed: int) -> list[dict]:
    """One demo run of ``arm`` on ``schedule`` with ``--seed seed``; its per-step records."""
    return demo_records([*testbed, *schedule.flags, *ARMS[arm]], seed)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default="sync,async1,async4")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--summarize", action="store_true", help="re-derive the summary from the stored records")
    ap.add_argument("--quick", action="store_true", help="2 seeds, 3 steps, sync and async1 (a smoke grid)")
    args = ap.parse_args(argv)
    args.testbed = TESTBED if not args.quick else ["--env", "echo", "--lr", "1e-3", "--steps", "3",
                                                   "--eval-every", "0", "--prompts", "4", "--samples", "2"]
    if args.quick:
        args.seeds, args.schedules = 2, "sync,async1"
    args.schedules = [Schedule(s) for s in args.schedules.split(",")]
    for sc in args.schedules:
        sc.flags  # refuse an unknown schedule before anything runs
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: {unknown[0]!r}: expected one of {', '.join(ARMS)}")
    args.results = RESULTS / ("async_rl_quick.json" if args.quick else "async_rl.json")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    fixed = {"testbed": args.testbed}
    if args.summarize:
        with _locked(args.results):
            result = load(args.results, fixed)
            result.update(summarize(result["runs"], result.get("seeds_wanted", args.seeds),
                                    result.get("run_provenance")))
            args.results.write_text(json.dumps(result, indent=1))
        print(tables(result))
        return result
    command = "python -m experiments.async_rl " + " ".join(argv if argv is not None else os.sys.argv[1:])
    result = run_grid(args.results, fixed, args.schedules, args.arms, args.seeds,
                      lambda sc, arm, seed: run_one(args.testbed, sc, arm, seed), command=command.strip(),
                      on_done=lambda cell, seed, recs: print(
                          f"{cell} seed {seed}: reward {recs[0]['reward']:.3f} -> {recs[-1]['reward']:.3f}, "
                          f"{throughput(recs):.1f} samples/s", flush=True),
                      summarize=summarize)
    print(tables(result))
    print(f"{args.results} ({'complete' if result.get('complete') else 'incomplete'} grid)")
    return result


if __name__ == "__main__":
    main()
