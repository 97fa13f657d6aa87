"""The demo's summary table and plots over seeds, read back from every run's full ``metrics.jsonl``
(so a resumed run is reported whole). Each mode's numbers are means over seeds with a 95% Student-t
confidence interval; the replay effect is the paired difference (replay − no replay, same seed).
A metric a step could not measure (NaN: e.g. routing disagreement with no captured route) is left
out of the means; one no step measured is None in summary.json and prints "n/a"."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from r3jax.metrics import collapse_step, mean_ci95

LABEL = {"rollout": "with replay (R3)", "trainer": "trainer routes (R2)", "none": "without replay"}
COLUMNS = ["run", "seeds", "steps", "reward_first", "reward_last", "reward_gain", "eval_first", "eval_last",
           "collapses", "k3_kl", "mean_abs_delta",
           "live_routing_disagreement", "fallback_fraction", "clip_fraction", "grad_norm", "entropy", "route_MiB"]
PER_RUN = ("k3_kl", "mean_abs_delta", "live_routing_disagreement", "live_token_any_disagreement",
           "fallback_fraction", "clip_fraction", "grad_norm", "entropy")


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``; a ``(mean, ci)`` pair prints as
    "mean ± ci", floats to 4 significant figures, None and NaN (not measured) as "n/a"."""
    def missing(v):
        return v is None or (isinstance(v, float) and math.isnan(v))

    def fmt(v, spec=".4g"):
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(x is None or isinstance(x, float) for x in v):
            return "n/a" if missing(v[0]) else f"{fmt(v[0])} ± {fmt(v[1], '.2g')}"
        if missing(v):
            return "n/a"
        return f"{v:{spec}}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def load_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _part(recs, key, part):
    """Mean of ``key`` over the first / last quarter of the steps or all of them; steps where it is
    NaN (not measured) are left out, and NaN when no step measured it."""
    vals = [r[key] for r in recs]
    n = max(1, len(vals) // 4)
    vals = np.asarray(vals[:n] if part == "first" else vals[-n:] if part == "last" else vals, np.float64)
    vals = vals[~np.isnan(vals)]
    return float(vals.mean()) if vals.size else float("nan")


def _ci(values) -> list[float]:
    m, h = mean_ci95(values)
    return [m, h]


def summarize(runs: dict[str, dict[int, list[dict]]]) -> list[dict]:
    """One row per mode: reward over the first / last quarter of steps and the per-run means of
    the mismatch and optimizer metrics, each as [mean, 95% CI half-width] over seeds."""
    rows = []
    for mode, per_seed in runs.items():
        per_seed = {s: r for s, r in per_seed.items() if r}
        row = {"run": LABEL.get(mode, mode), "mode": mode, "seeds": sorted(per_seed)}
        if not per_seed:
            rows.append({**row, "steps": 0})
            continue
        recs = list(per_seed.values())
        row.update(steps=min(len(r) for r in recs),
                   reward_first=_ci([_part(r, "reward", "first") for r in recs]),
                   reward_last=_ci([_part(r, "reward", "last") for r in recs]),
                   reward_last_per_seed=[_part(r, "reward", "last") for r in recs],
                   # what training achieved: per seed, last-quarter minus first-quarter reward (paired)
                   reward_gain=_ci([_part(r, "reward", "last") - _part(r, "reward", "first") for r in recs]),
                   collapses=sum(collapse_step([x["reward"] for x in r]) is not None for r in recs),
                   route_MiB=float(np.mean([sum(x["route_bytes"] for x in r) for r in recs]) / 2**20))
        evals = [[x["eval_reward"] for x in r if "eval_reward" in x] for r in recs]
        if all(len(e) >= 2 for e in evals):  # held-out greedy reward after step 1 and after the last
            row.update(eval_first=_ci([e[0] for e in evals]), eval_last=_ci([e[-1] for e in evals]),
                       eval_gain=_ci([e[-1] - e[0] for e in evals]))
        for key in PER_RUN:
            if all(key in x for r in recs for x in r):
                per_seed_means = [v for v in (_part(r, key, "all") for r in recs) if not math.isnan(v)]
                row[key] = _ci(per_seed_means) if per_seed_means else None
        rows.append(row)
    return rows


def difference(runs: dict[str, dict[int, list[dict]]]) -> dict | None:
    """Paired replay − no-replay difference of the last-quarter reward over the seeds both ran."""
    if "rollout" not in runs or "none" not in runs:
        return None
    seeds = sorted(s for s in runs["rollout"] if runs["rollout"][s] and runs["none"].get(s))
    if not seeds:
        return None
    d = [_part(runs["rollout"][s], "reward", "last") - _part(runs["none"][s], "reward", "last") for s in seeds]
    m, h = mean_ci95(d)
    if np.isnan(h):
        verdict = "one seed: no uncertainty estimate, so no conclusion"
    elif m - h > 0:
        verdict = "replay ended higher (the 95% CI excludes 0)"
    elif m + h < 0:
        verdict = "replay ended lower (the 95% CI excludes 0)"
    else:
        verdict = "no measurable difference (the 95% CI includes 0)"
    return {"metric": "reward_last (mean over the last quarter of steps)", "replay_minus_none": m,
            "ci95": h, "seeds": seeds, "per_seed": d, "verdict": verdict}


def _band(ax, per_seed: dict[int, list[dict]], key: str, label: str):
    recs = [r for r in per_seed.values() if r]
    n = min(len(r) for r in recs)
    y = np.array([[x[key] for x in r[:n]] for r in recs])  # [seeds, steps]
    stats = np.array([mean_ci95(y[:, t]) for t in range(n)])
    mean, half = stats[:, 0], np.nan_to_num(stats[:, 1])
    steps = np.arange(1, n + 1)
    ax.plot(steps, mean, marker=".", label=f"{label} (mean of {len(recs)} seeds)")
    ax.fill_between(steps, mean - half, mean + half, alpha=0.2)


def plot(runs: dict[str, dict[int, list[dict]]], transfer: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [("reward", "mean episode reward"), ("k3_kl", "k3 KL(train ‖ rollout)"),
              ("live_routing_disagreement", "live routing disagreement (trainer vs rollout)")]
    for ax, (key, title) in zip(axes.flat, panels):
        for mode, per_seed in runs.items():
            if any(per_seed.values()):
                _band(ax, per_seed, key, LABEL.get(mode, mode))
        ax.set_title(title + "; band: 95% CI"), ax.set_xlabel("RL step"), ax.grid(alpha=0.3), ax.legend()
        if key == "k3_kl":
            ax.set_yscale("log")  # replay's effect is an order of magnitude
    ax = axes.flat[3]
    for name, per_turn in transfer.items():
        ax.plot(np.arange(1, len(per_turn) + 1), np.asarray(per_turn) / 1024, marker="o", label=name)
    ax.set_title("route KiB received per turn (one batch)"), ax.set_xlabel("turn"), ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(modes, seeds, transfer: dict, out: Path, started: float | None = None) -> dict:
    """Reads every run's full metrics.jsonl (a resumed run included), writes demo.png and
    summary.json, prints the summary table and the measured replay effect; returns the summary.
    ``started``: the demo's ``time.perf_counter()`` at start; its total wall time ends the output and
    is stored as ``wall_s``."""
    runs = {m: {s: load_metrics(out / m / f"seed{s}") for s in seeds} for m in modes}
    rows = summarize(runs)
    diff = difference(runs)
    plot(runs, transfer, out / "demo.png")
    print(table(rows, COLUMNS))
    print("(mean ± 95% CI half-width over seeds; reward_first/last: first/last quarter of the steps)")
    if diff is not None:
        print(f"replay − no replay, reward over the last quarter: {diff['replay_minus_none']:+.4f} ± "
              f"{diff['ci95']:.4f} (95% CI, {len(diff['seeds'])} paired seeds): {diff['verdict']}")
    wall = None if started is None else round(time.perf_counter() - started, 1)
    summary = {"runs": rows, "replay_effect": diff, "transfer_bytes_per_turn": transfer, "wall_s": wall}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'demo.png'}, {out / 'summary.json'}, <mode>/seed<s>/metrics.jsonl, <mode>/seed<s>/ckpt/")
    if wall is not None:
        print(f"r3jax demo: done in {wall:.0f} s ({wall / 60:.1f} min) of wall time")
    return summary
