"""The demo's summary table and plots, read back from every mode's full ``metrics.jsonl`` (so a
resumed run is reported whole)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LABEL = {"rollout": "with replay (R3)", "none": "without replay"}
COLUMNS = ["run", "steps", "reward_first", "reward_last", "k3_kl", "mean_abs_delta",
           "routing_disagreement", "token_any_disagreement", "route_MiB"]


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns`` (floats to 4 significant figures)."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def load_metrics(out: Path, mode: str) -> list[dict]:
    path = out / mode / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(records, key, part):
    vals = [r[key] for r in records]
    n = max(1, len(vals) // 4)
    return float(np.mean(vals[:n] if part == "first" else vals[-n:] if part == "last" else vals))


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for mode, recs in runs.items():
        if not recs:
            rows.append({"run": LABEL.get(mode, mode), "steps": 0})
            continue
        rows.append({"run": LABEL.get(mode, mode), "steps": len(recs),
                     "reward_first": _mean(recs, "reward", "first"), "reward_last": _mean(recs, "reward", "last"),
                     "k3_kl": _mean(recs, "k3_kl", "all"), "mean_abs_delta": _mean(recs, "mean_abs_delta", "all"),
                     "routing_disagreement": _mean(recs, "routing_disagreement", "all"),
                     "token_any_disagreement": _mean(recs, "token_any_disagreement", "all"),
                     "route_MiB": sum(r["route_bytes"] for r in recs) / 2**20})
    return rows


def plot(runs: dict[str, list[dict]], transfer: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [("reward", "mean episode reward"), ("k3_kl", "k3 KL(train ‖ rollout)"),
              ("routing_disagreement", "routing disagreement (used vs rollout)")]
    for ax, (key, title) in zip(axes.flat, panels):
        for mode, recs in runs.items():
            ax.plot([r["step"] for r in recs], [r[key] for r in recs], marker=".", label=LABEL.get(mode, mode))
        ax.set_title(title), ax.set_xlabel("RL step"), ax.grid(alpha=0.3), ax.legend()
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


def report(modes, transfer: dict, out: Path) -> dict:
    """Reads every mode's full metrics.jsonl (a resumed run included), writes demo.png and
    summary.json, prints the summary table; returns the summary."""
    runs = {m: load_metrics(out, m) for m in modes}
    rows = summarize(runs)
    plot(runs, transfer, out / "demo.png")
    print(table(rows, COLUMNS))
    summary = {"runs": rows, "transfer_bytes_per_turn": transfer}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'demo.png'}, {out / 'summary.json'}, <mode>/metrics.jsonl, <mode>/ckpt/")
    return summary
