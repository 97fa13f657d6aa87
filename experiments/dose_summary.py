"""Summaries of a replay_dose grid, derived only from its stored per-step records.

Everything here is a pure function of ``result["runs"]`` (``runs["<setting>/<arm>"][seed]`` = the
per-step records of one run) and the grid's declared seeds, so ``--summarize`` reproduces the
stored summary exactly and a new statistic can be added without re-running anything.

Verdicts: only a 95% CI that excludes no-effect counts as a measured difference; the CI's bounds
are stored beside each verdict (``ci95 = [lo, hi]``) so a reader, or a test, can check the rule.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from r3jax import metrics as mm

BASE = "none"
NEUTRAL = "no measurable difference (CI includes 0)"
NEUTRAL_RATIO = "no measurable difference (CI includes 1)"


def final_reward(records: list[dict]) -> float:
    """Mean reward over the last quarter of a run's steps (at least one step)."""
    tail = max(1, len(records) // 4)
    return float(np.mean([r["reward"] for r in records[-tail:]]))


def first_reward(records: list[dict]) -> float:
    """Mean reward over the first quarter of a run's steps: with ``final_reward``, whether it learned."""
    head = max(1, len(records) // 4)
    return float(np.mean([r["reward"] for r in records[:head]]))


def _mean(records, key) -> float:
    return float(np.nanmean([r[key] for r in records]))


def wilson95(k: int, n: int) -> list[float]:
    """95% Wilson score interval of a rate k/n (n >= 1): honest at 0/n and n/n, unlike the Wald one."""
    z = 1.959963984540054
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def verdict(lo: float, hi: float, higher: str, lower: str, neutral: str = NEUTRAL, null: float = 0.0) -> str:
    """The plain reading of a CI [lo, hi] around ``null``: higher, lower, or no measurable difference."""
    if math.isnan(lo) or math.isnan(hi):
        return "one seed: no conclusion"
    return higher if lo > null else lower if hi < null else neutral


def cell_summary(per_seed: dict[int, list[dict]], seeds_wanted: int) -> dict:
    """Statistics of one (setting, arm) cell over its seeds; ``complete`` when every wanted seed ran."""
    runs = list(per_seed.values())
    recs = [r for rs in runs for r in rs]
    finals = [final_reward(rs) for rs in runs]
    m, h = mm.mean_ci95(finals)
    collapses = [mm.collapse_step([r["reward"] for r in rs]) for rs in runs]
    k = sum(c is not None for c in collapses)
    pooled = lambda key: np.array([r[key] for r in recs], np.float64)
    return {
        "seeds": len(runs), "complete": len(runs) >= seeds_wanted,
        "final_reward_mean": m, "final_reward_ci95": h, "final_reward_per_seed": finals,
        "first_reward_mean": float(np.mean([first_reward(rs) for rs in runs])),
        "collapses": k, "collapse_rate": k / len(runs), "collapse_rate_ci95": wilson95(k, len(runs)),
        "live_routing_disagreement": float(np.nanmean(pooled("live_routing_disagreement"))),
        "k3_kl_mean": float(np.nanmean(pooled("k3_kl"))), "k3_kl_median": float(np.nanmedian(pooled("k3_kl"))),
        "mean_abs_delta": float(np.nanmean(pooled("mean_abs_delta"))),
        "abs_delta_p99": float(np.nanmedian(pooled("abs_delta_p99"))),  # median over steps of each step's p99
        "abs_delta_max": float(np.nanmax(pooled("abs_delta_max"))),
        "importance_weight": float(np.nanmean(pooled("importance_weight"))),
        "clip_fraction": float(np.nanmean(pooled("clip_fraction"))),
        "grad_norm": float(np.nanmean(pooled("grad_norm"))), "entropy": float(np.nanmean(pooled("entropy"))),
        "train_s": float(np.mean(pooled("train_s"))), "rollout_s": float(np.mean(pooled("rollout_s"))),
    }


def _time_ratio(a: dict, b: dict, seeds: list, key: str) -> float | None:
    """Mean ``key`` seconds per step of the arm's runs ÷ none's, over ``seeds`` (None without any)."""
    if not seeds:
        return None
    return float(np.mean([_mean(a[s], key) for s in seeds]) / np.mean([_mean(b[s], key) for s in seeds]))


def comparisons(runs: dict, cells: dict, provenance: dict | None = None) -> list[dict]:
    """Paired (same seed) arm − none per setting, over complete cells only:

    - ``final_reward_diff`` (mean, half-width, ``ci95`` = [lo, hi], verdict);
    - ``collapse_diff``: collapses in the arm minus collapses in none (counts over the same seeds);
    - ``k3_ratio``: mean k3 KL arm ÷ none, geometric mean over seeds of the per-seed ratios with its CI
      (a heavy-tailed metric: averaged in log space); ``p99_diff``: per-seed median p99 |log ratio|;
    - cost: ``train_s_ratio`` and ``rollout_s_ratio``, arm ÷ none, mean seconds per RL step, over the
      seeds whose two runs ran on the same commit (``provenance[cell][seed]["commit"]``; all seeds
      without provenance): runs of different invocations ran beside different loads, so their
      seconds do not compare. ``cost_seeds`` counts them; the ratios are None at 0.
    """
    out = []
    for cell, c in cells.items():
        setting, arm = cell.rsplit("/", 1)
        base = f"{setting}/{BASE}"
        if arm == BASE or base not in cells or not (c["complete"] and cells[base]["complete"]):
            continue
        a, b = runs[cell], runs[base]
        seeds = sorted(set(a) & set(b))
        m, h = mm.mean_ci95([final_reward(a[s]) - final_reward(b[s]) for s in seeds])
        lk, lh = mm.mean_ci95([math.log(_mean(a[s], "k3_kl") / _mean(b[s], "k3_kl")) for s in seeds])
        pm, ph = mm.mean_ci95([float(np.nanmedian([r["abs_delta_p99"] for r in a[s]]))
                               - float(np.nanmedian([r["abs_delta_p99"] for r in b[s]])) for s in seeds])
        collapse = lambda rs: mm.collapse_step([r["reward"] for r in rs]) is not None
        commit = lambda c, sd: ((provenance or {}).get(c, {}).get(str(sd)) or {}).get("commit")
        same = [sd for sd in seeds if commit(cell, sd) == commit(base, sd)]
        out.append({
            "setting": setting, "arm": arm, "comparison": f"{arm} - {BASE}", "seeds": len(seeds),
            "disagreement": cells[base]["live_routing_disagreement"],
            "final_reward_diff": m, "final_reward_half": h, "ci95": [m - h, m + h],
            "verdict": verdict(m - h, m + h, f"{arm} higher reward", f"{arm} lower reward"),
            "collapse_diff": sum(collapse(a[s]) for s in seeds) - sum(collapse(b[s]) for s in seeds),
            "k3_ratio": math.exp(lk), "k3_ratio_ci95": [math.exp(lk - lh), math.exp(lk + lh)],
            "k3_verdict": verdict(math.exp(lk - lh), math.exp(lk + lh), f"{arm} higher k3 KL", f"{arm} lower k3 KL",
                                  NEUTRAL_RATIO, null=1.0),
            "p99_diff": pm, "p99_ci95": [pm - ph, pm + ph],
            "p99_verdict": verdict(pm - ph, pm + ph, f"{arm} higher p99 |log ratio|", f"{arm} lower p99 |log ratio|"),
            "cost_seeds": len(same), "train_s_ratio": _time_ratio(a, b, same, "train_s"),
            "rollout_s_ratio": _time_ratio(a, b, same, "rollout_s"),
        })
    return out


def _ordered(cells: list[str]) -> list[str]:
    """``"<setting>/<arm>"`` names grouped by setting (first stored first), none first within each, then
    the other arms in the order they first appear: the tables read the same whichever process stored
    a run first."""
    settings = list(dict.fromkeys(c.rsplit("/", 1)[0] for c in cells))
    arms = list(dict.fromkeys([BASE] + [c.rsplit("/", 1)[1] for c in cells]))
    return sorted(cells, key=lambda c: (settings.index(c.rsplit("/", 1)[0]), arms.index(c.rsplit("/", 1)[1])))


def summarize(runs: dict, seeds_wanted: int, provenance: dict | None = None) -> dict:
    """``{"cells", "comparisons"}`` from the stored runs (cells grouped by setting, none first) and,
    for the cost ratios, the runs' ``provenance[cell][seed]``."""
    cells = {cell: cell_summary({int(s): rs for s, rs in runs[cell].items()}, seeds_wanted)
             for cell in _ordered([c for c, per in runs.items() if per])}
    norm = {cell: {int(s): rs for s, rs in per.items()} for cell, per in runs.items()}
    return {"cells": cells, "comparisons": comparisons(norm, cells, provenance)}


def tables(summary: dict, complete_only: bool = True) -> str:
    """Markdown: one table of cells and one of paired comparisons (complete cells only by default)."""
    f = lambda v, d=3: "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}g}"
    ratio = lambda v: "n/a (other invocations)" if v is None else f"{v:.2f}"
    lines = ["| setting | arm | seeds | live disagreement | first → final reward | collapses | k3 KL (mean) | "
             "p99 \\|log ratio\\| | clip fraction | train s/step | rollout s/step |", "|" + "---|" * 11]
    for cell, c in summary["cells"].items():
        if complete_only and not c["complete"]:
            continue
        setting, arm = cell.rsplit("/", 1)
        lines.append(f"| {setting} | {arm} | {c['seeds']} | {c['live_routing_disagreement']:.2%} | "
                     f"{c['first_reward_mean']:.3f} → {c['final_reward_mean']:.3f} ± {f(c['final_reward_ci95'])} | "
                     f"{c['collapses']}/{c['seeds']} | "
                     f"{f(c['k3_kl_mean'])} | {f(c['abs_delta_p99'])} | {f(c['clip_fraction'])} | "
                     f"{c['train_s']:.2f} | {c['rollout_s']:.2f} |")
    lines += ["", "| setting | comparison | seeds | final reward diff (95% CI) | verdict | collapses diff | "
              "k3 KL ratio (95% CI) | p99 diff (95% CI) | train time ratio | rollout time ratio |", "|" + "---|" * 10]
    for c in summary["comparisons"]:
        lo, hi = c["ci95"]
        klo, khi = c["k3_ratio_ci95"]
        plo, phi = c["p99_ci95"]
        lines.append(f"| {c['setting']} | {c['comparison']} | {c['seeds']} | {c['final_reward_diff']:+.3f} "
                     f"[{lo:+.3f}, {hi:+.3f}] | {c['verdict']} | {c['collapse_diff']:+d} | "
                     f"×{c['k3_ratio']:.2f} [{klo:.2f}, {khi:.2f}] | {c['p99_diff']:+.3f} [{plo:+.3f}, {phi:+.3f}] | "
                     f"{ratio(c['train_s_ratio'])} | {ratio(c['rollout_s_ratio'])} |")
    if summary["comparisons"]:
        lines += ["", chance_line(summary["comparisons"])]
    return "\n".join(lines)


def chance_line(comps: list[dict]) -> str:
    """How many reward verdicts are measured differences, beside what chance alone gives: each CI is
    95%, so about one comparison in twenty excludes 0 with no effect anywhere."""
    n = len(comps)
    hits = [f"{c['setting']} {c['comparison']}" for c in comps if c["verdict"] != NEUTRAL]
    return (f"{len(hits)} of {n} final-reward CIs exclude 0" + (f" ({', '.join(hits)})" if hits else "")
            + f"; with no effect anywhere, about {n / 20:.1f} of {n} would by chance alone (each CI is 95%).")


def plot(summary: dict, settings: dict, path: Path) -> None:
    """Dose-response figure over complete cells: x = the live disagreement the setting causes without
    replay (its ``none`` cell, log scale), one colour per arm, nudged apart sideways so that the CIs
    stay readable; settings that differ only in the simulated router noise (a σ sweep at one precision,
    router and off-policy degree) are joined by a line, one line style and marker per router and
    off-policy family, another precision a point of its own; the ``none`` points of
    the k3 panel carry their setting's name. Panels: final reward and collapse rate (95% CIs over
    seeds), k3 KL and median p99 |log ratio|; the legends sit below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    cells = {k: v for k, v in summary["cells"].items() if v["complete"]}
    arms = list(dict.fromkeys(k.rsplit("/", 1)[1] for k in cells))
    families = list(dict.fromkeys(settings[s]["family"] for s in settings if f"{s}/{BASE}" in cells))
    styles, markers = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))], ["o", "s", "^", "D", "v", "P"]
    # a line joins settings that differ only in the simulated noise (a sweep); another precision of
    # the same family is a point of its own
    sweeps = list(dict.fromkeys((settings[s]["family"], settings[s].get("precision")) for s in settings))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = [("final_reward_mean", "final reward (mean of last quarter)", False),
              ("collapse_rate", "collapse rate (reward < ½ peak for ≥ 5 steps)", False),
              ("k3_kl_mean", "k3 KL(rollout ‖ train), mean over steps", True),
              ("abs_delta_p99", "p99 |log importance ratio| (median over steps)", True)]
    for ax, (key, title, logy) in zip(axes.flat, panels):
        for ai, arm in enumerate(arms):
            nudge = 1.0 + 0.025 * (ai - (len(arms) - 1) / 2)  # multiplicative: the x axis is logarithmic
            for fam, precision in sweeps:
                fi = families.index(fam) if fam in families else 0
                pts = []
                for s, meta in settings.items():
                    c, base = cells.get(f"{s}/{arm}"), cells.get(f"{s}/{BASE}")
                    if (meta["family"], meta.get("precision")) == (fam, precision) and c and base:
                        pts.append((base["live_routing_disagreement"], c, s))
                if not pts:
                    continue
                pts.sort(key=lambda p: p[0])
                x = np.array([p[0] for p in pts]) * 100 * nudge
                y = np.array([p[1][key] for p in pts])
                if key == "final_reward_mean":
                    err = np.nan_to_num([p[1]["final_reward_ci95"] for p in pts])
                elif key == "collapse_rate":
                    err = np.clip([[yy - p[1]["collapse_rate_ci95"][0], p[1]["collapse_rate_ci95"][1] - yy]
                                   for yy, p in zip(y, pts)], 0, None).T  # float noise at 0/n
                else:
                    err = None
                ax.errorbar(x, y, yerr=err, color=f"C{ai}", ls=styles[fi % len(styles)],
                            alpha=0.35 if key == "collapse_rate" else 1.0,
                            marker=markers[fi % len(markers)], ms=5, capsize=2, lw=1.2, elinewidth=0.8)
                if key == "k3_kl_mean" and arm == BASE:
                    for xx, yy, p in zip(x, y, pts):
                        ax.annotate(p[2], (xx, yy), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_title(title), ax.grid(alpha=0.3), ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([0.5, 1, 2, 5, 10, 20, 50, 100]))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g")), ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("live routing disagreement without replay (%)")
        if logy:
            ax.set_yscale("log")
    handles = [Line2D([], [], color=f"C{i}", lw=2, label=arm) for i, arm in enumerate(arms)]
    handles += [Line2D([], [], color="0.3", ls=styles[i % len(styles)], marker=markers[i % len(markers)],
                       label=fam) for i, fam in enumerate(families)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.suptitle("replay_dose: outcome vs train–rollout mismatch per arm (95% CIs over seeds)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
