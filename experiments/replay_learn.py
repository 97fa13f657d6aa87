"""Replay measured where RL learns: none / R2 / R3 / TIS / R3+TIS / IcePop on the learning testbed, resumable.

    python -m experiments.replay_learn [--settings bf16,noise0.25] [--arms none,R2,...] [--seeds 5]
                                       [--summarize] [--quick]

The testbed is the one experiments/learn_pilot.py chose: the demo's echo task on the tiny model, a
supervised warm start, then 30 GRPO steps at lr 1e-3 (in-process engine, bf16 rollouts, fp32 trainer),
where the no-replay arm's reward rises (gain >= 0.1 with a 95% CI above 0 in the pilot). A
**setting** adds a mismatch source: ``bf16`` (the rollouts' own precision, about 0.4% live
disagreement) or ``noise<σ>`` (simulated selection noise σ on the rollout router; 0.25 gives about
48%). **Arms**: ``none`` (live routing), ``R2`` (the trainer's pre-update routes), ``R3`` (the
rollout's routes), ``TIS`` (cap 2), ``R3+TIS`` and ``IcePop`` (band [0.5, 5]). Seed s is the demo's
``--seed s`` in every arm (same model initialisation, warm start and sampling seeds): paired.

Each finished run is stored at once in ``experiments/results/replay_learn[_quick].json`` as
``runs["<setting>/<arm>"][seed]`` = the demo's per-step records (reward, eval_reward where evaluated,
live_routing_disagreement, k3_kl, mean_abs_delta, the loss's importance weights, ...), with the
commit it ran on; several processes may fill one grid (experiments/dose_grid.py). ``--summarize``
re-derives the summary and the figure (``replay_learn.png``: training and held-out reward per arm
against the step, 95% bands) from the stored records: per cell the reward over the first and the last
quarter of the steps, the gain, the last held-out reward, the live disagreement and k3 KL (mean ±
95% CI over seeds); per arm the paired difference of its last-quarter reward from ``none``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from experiments.common import RESULTS
from experiments.dose_grid import _locked, load, run_grid
from r3jax.metrics import mean_ci95

TESTBED = ["--env", "echo", "--lr", "1e-3", "--steps", "30"]
ARMS = {"none": ["--replay", "none"], "R2": ["--replay", "trainer"], "R3": ["--replay", "rollout"],
        "TIS": ["--replay", "none", "--tis-cap", "2"], "R3+TIS": ["--replay", "rollout", "--tis-cap", "2"],
        "IcePop": ["--replay", "none", "--icepop", "0.5", "5"]}
BASE = "none"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # "bf16" or "noise<σ>"

    @property
    def flags(self) -> list[str]:
        if self.name == "bf16":
            return []
        if self.name.startswith("noise"):
            return ["--router-noise", str(float(self.name[5:]))]
        raise ValueError(f"setting {self.name!r}: expected 'bf16' or 'noise<σ>'")

    def describe(self) -> dict:
        return {"flags": self.flags}


def _quarter(records: list[dict], key: str, last: bool) -> float:
    vals = [r[key] for r in records if key in r]
    n = max(1, len(vals) // 4)
    return float(np.mean(vals[-n:] if last else vals[:n]))


def _ci(values) -> list[float]:
    m, h = mean_ci95([float(v) for v in values])
    return [m, h]


def summarize(runs: dict, seeds_wanted: int, provenance: dict | None = None) -> dict:
    """Per cell and per comparison with ``none``, from the stored records alone (pure)."""
    cells = {}
    for cell, per_seed in runs.items():
        recs = list(per_seed.values())
        evals = [[r["eval_reward"] for r in rs if "eval_reward" in r] for rs in recs]
        cells[cell] = {
            "seeds": len(recs), "complete": len(recs) >= seeds_wanted,
            "reward_first": _ci(_quarter(rs, "reward", False) for rs in recs),
            "reward_last": _ci(_quarter(rs, "reward", True) for rs in recs),
            "reward_gain": _ci(_quarter(rs, "reward", True) - _quarter(rs, "reward", False) for rs in recs),
            "eval_last": _ci(e[-1] for e in evals) if all(evals) else None,
            "live_routing_disagreement": _ci(np.mean([r["live_routing_disagreement"] for r in rs]) for rs in recs),
            "k3_kl": _ci(np.mean([r["k3_kl"] for r in rs]) for rs in recs)}
    comparisons = []
    for cell in cells:
        setting, arm = cell.rsplit("/", 1)
        base = f"{setting}/{BASE}"
        if arm == BASE or base not in runs:
            continue
        seeds = sorted(set(runs[cell]) & set(runs[base]), key=int)
        if len(seeds) < 2:
            continue
        d = [_quarter(runs[cell][s], "reward", True) - _quarter(runs[base][s], "reward", True) for s in seeds]
        m, h = mean_ci95(d)
        comparisons.append({"setting": setting, "comparison": f"{arm} - {BASE}", "seeds": len(seeds),
                            "reward_last_diff": [m, h],
                            "verdict": "higher" if m - h > 0 else "lower" if m + h < 0 else "no measurable difference"})
    return {"cells": cells, "comparisons": comparisons}


def tables(summary: dict) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v[0]:.3g} ± {v[1]:.2g}"
    lines = ["| setting | arm | seeds | reward first → last | gain | held-out (last) | live disagreement | k3 KL |",
             "|---|---|---|---|---|---|---|---|"]
    for cell, c in summary["cells"].items():
        setting, arm = cell.rsplit("/", 1)
        lines.append(f"| {setting} | {arm} | {c['seeds']}{'' if c['complete'] else ' (incomplete)'} | "
                     f"{fmt(c['reward_first'])} → {fmt(c['reward_last'])} | {fmt(c['reward_gain'])} | "
                     f"{fmt(c['eval_last'])} | {fmt(c['live_routing_disagreement'])} | {fmt(c['k3_kl'])} |")
    if summary["comparisons"]:
        lines += ["", "| setting | comparison | seeds | last-quarter reward diff (95% CI) | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {c['setting']} | {c['comparison']} | {c['seeds']} | {fmt(c['reward_last_diff'])} | {c['verdict']} |"
                  for c in summary["comparisons"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Per setting (rows): the training reward and the held-out greedy reward against the step, one line
    per arm, mean over seeds with a 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    settings = list(dict.fromkeys(cell.rsplit("/", 1)[0] for cell in runs))
    fig, axes = plt.subplots(len(settings), 2, figsize=(11, 3.6 * len(settings)), squeeze=False)
    for row, setting in zip(axes, settings):
        for arm in ARMS:
            per_seed = list(runs.get(f"{setting}/{arm}", {}).values())
            if not per_seed:
                continue
            for ax, key in zip(row, ("reward", "eval_reward")):
                steps = [r["step"] for r in per_seed[0] if key in r]
                y = np.array([[r[key] for r in rs if key in r] for rs in per_seed])  # [seeds, points]
                stats = np.array([mean_ci95(y[:, j]) for j in range(y.shape[1])])
                ax.plot(steps, stats[:, 0], marker="." if key == "eval_reward" else None, label=arm)
                ax.fill_between(steps, stats[:, 0] - np.nan_to_num(stats[:, 1]),
                                stats[:, 0] + np.nan_to_num(stats[:, 1]), alpha=0.12)
        row[0].set_title(f"{setting}: training reward (sampled)")
        row[1].set_title(f"{setting}: held-out reward (greedy)")
        for ax in row:
            ax.set_xlabel("step")
        row[0].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def demo_records(flags: list[str], seed: int) -> list[dict]:
    """One in-process demo run with ``flags`` (one ``--replay`` mode among them) and ``--seed seed``; its
    per-step records (``metrics.jsonl``)."""
    from r3jax.demo import main as demo_main

    mode = flags[flags.index("--replay") + 1]
    with tempfile.TemporaryDirectory(prefix="r3jax-demo-run-") as out:
        demo_main(["--in-process", "--seeds", "1", "--seed", str(seed), "--out", out, "--no-progress", *flags])
        path = Path(out) / mode / f"seed{seed}" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(testbed: list[str], setting: Setting, arm: str, seed: int) -> list[dict]:
    """One demo run of ``arm`` on ``setting`` with ``--seed seed``; its per-step records."""
    return demo_records([*testbed, *setting.flags, *ARMS[arm]], seed)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="bf16,noise0.25")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--summarize", action="store_true", help="re-derive the summary from the stored records")
    ap.add_argument("--quick", action="store_true", help="2 seeds, 2 steps, arms none and R3 (a smoke grid)")
    args = ap.parse_args(argv)
    args.testbed = TESTBED if not args.quick else ["--env", "echo", "--lr", "1e-3", "--steps", "2",
                                                   "--eval-every", "1", "--prompts", "4", "--samples", "2"]
    if args.quick:
        args.seeds, args.settings, args.arms = 2, "bf16", "none,R3"
    args.settings = [Setting(s) for s in args.settings.split(",")]
    for st in args.settings:
        st.flags  # refuse an unknown setting before anything runs
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: {unknown[0]!r}: expected one of {', '.join(ARMS)}")
    args.results = RESULTS / ("replay_learn_quick.json" if args.quick else "replay_learn.json")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    fixed = {"testbed": args.testbed}
    if args.summarize:  # under the grid's lock: a process still filling it may be writing a run
        with _locked(args.results):
            result = load(args.results, fixed)
            result.update(summarize(result["runs"], result.get("seeds_wanted", args.seeds),
                                    result.get("run_provenance")))
            args.results.write_text(json.dumps(result, indent=1))
        plot(result, args.results.with_suffix(".png"))
        print(tables(result))
        print(f"wrote {args.results.with_suffix('.png')}")
        return result
    command = "python -m experiments.replay_learn " + " ".join(argv if argv is not None else os.sys.argv[1:])
    result = run_grid(args.results, fixed, args.settings, args.arms, args.seeds,
                      lambda st, arm, seed: run_one(args.testbed, st, arm, seed), command=command.strip(),
                      on_done=lambda cell, seed, recs: print(f"{cell} seed {seed}: reward "
                                                             f"{recs[0]['reward']:.3f} -> {recs[-1]['reward']:.3f}",
                                                             flush=True),
                      summarize=summarize)
    plot(result, args.results.with_suffix(".png"))
    print(tables(result))
    print(f"{args.results} ({'complete' if result.get('complete') else 'incomplete'} grid), "
          f"{args.results.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
