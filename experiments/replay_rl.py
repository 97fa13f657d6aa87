"""Does routed-expert replay change an RL outcome? Seeds x {none, R2, R3} x {bf16, int8} rollouts.

    python -m experiments.replay_rl [--quick] [--seeds 5] [--steps 20] [--out runs/replay_rl]

One warm start (supervised steps on oracle demonstrations of the multi-turn echo task), then for
every arm and seed a GRPO run with PPO-style minibatch updates (``ppo_update``, 2 minibatches per
rollout batch, so R2's recorded routes are replayed in an update after the router moved):

- replay: ``none`` (live routing), ``trainer`` (R2: the trainer's own pre-update routes),
  ``rollout`` (R3: the routes the rollout engine used);
- rollout precision: ``bf16`` (bf16 compute of the fp32 weights) or ``int8`` (bf16 compute of
  int8 weight-only fake-quantized weights, ``models.quant.quantize_int8``, router kept exact: the
  CPU stand-in for FP8 rollouts). The trainer is fp32 in every arm.

Model: the tiny architecture with 4 MoE layers, no dense layer, E=64 (top-2) and expert outputs
x4, so that top-2 margins are narrow and a flipped expert moves the logprobs well above bf16's other
rounding (MoeConfig.tiny() flips ~0.5% of routes, too few to matter). The in-process engine serves
every arm (one compilation set). Seeds are paired across arms (same sampling seeds).

Per arm: final reward (mean of the last quarter of steps of a run) mean ± 95% CI over seeds, k3 KL
and mean |Δ logprob| (median and p99 over steps, measured in the first minibatch update of each
batch, i.e. the pure train-inference mismatch), clip fraction, grad norm (means over updates),
entropy, collapse count (reward below half its peak for >= 5 steps), and live routing
disagreement per MoE layer. Writes ``experiments/results/replay_rl[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import time
import types
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.common import run_provenance
from models import MoeConfig, MoeTransformer
from models.quant import quantize_int8
from r3jax import metrics as mm
from r3jax.batch import collate
from r3jax.demo.rollouts import make_loop
from r3jax.demo.run import adam, warm_start
from r3jax.params_io import weights_of
from r3jax.sharding import batch_multiple, make_mesh, shard_batch
from r3jax.train import LossConfig, group_advantages, init_train_state, ppo_update, push_to_engine

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"none": "none", "R2": "trainer", "R3": "rollout"}
PRECISIONS = ("bf16", "int8")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 seeds, 3 steps, small batches")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--summarize", action="store_true",
                    help="recompute the summary, comparisons and plot of the stored run (no training)")
    ap.add_argument("--steps", type=int, default=20, help="RL steps per run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--expert-scale", type=float, default=4.0, help="scales every expert's output")
    ap.add_argument("--quantize-router", action="store_true", help="int8 rollouts quantize the router too")
    ap.add_argument("--out", default="runs/replay_rl", help="warm-start cache directory")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.prompts = 2, 3, 4
    # fields the demo's loop/warm-start helpers read
    args.env, args.max_seq_len, args.temperature, args.warmup_batch, args.seed = "echo", 128, 1.0, 32, 0
    return args


def model_config(args) -> MoeConfig:
    return MoeConfig.tiny(num_experts=args.experts, top_k=args.top_k, num_layers=args.moe_layers,
                          first_dense_layers=0, moe_intermediate_size=32)


def build_model(args):
    model = MoeTransformer(model_config(args), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    scaled = jax.tree_util.tree_map_with_path(
        lambda p, x: x * args.expert_scale if "down_proj" in jax.tree_util.keystr(p) else x, params)
    nnx.update(model, scaled)
    return model


def _sync(engine, state, precision, quantize_router):
    params = weights_of(state)  # Params and router biases
    return push_to_engine(engine, quantize_int8(params, quantize_router=quantize_router)
                          if precision == "int8" else params)


def run_one(args, engine, warm, mesh, mode, precision, seed, bar) -> list[dict]:
    loop_args = types.SimpleNamespace(**{**vars(args), "seed": seed})
    state = init_train_state(warm, adam(args.lr), mesh=mesh, seed=seed)  # one optimizer: one compilation
    _sync(engine, state, precision, args.quantize_router)
    cfg = model_config(args)
    records = []
    for step in range(args.steps):
        with make_loop(loop_args, engine, step) as loop:
            trajs = loop.run(args.prompts, args.samples)
        rewards = np.array([t.reward for t in trajs])
        for t, a in zip(trajs, group_advantages(rewards, np.array([t.group for t in trajs]))):
            t.advantage = float(a)
        batch = collate(trajs, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers,
                        batch_multiple=batch_multiple(mesh) * args.minibatches)
        state, hist = ppo_update(state, shard_batch(batch, mesh), replay=MODES[mode], config=LossConfig(),
                                 num_minibatches=args.minibatches)
        hist = jax.device_get(hist)
        first = hist[0]  # before any update on this batch: the train-inference mismatch itself
        rec = {"step": step + 1, "reward": float(rewards.mean()),
               "k3_kl": float(first["k3_kl"]), "mean_abs_delta": float(first["mean_abs_delta"]),
               "live_routing_disagreement": float(first["live_routing_disagreement"]),
               "live_routing_disagreement_per_layer": np.asarray(first["live_routing_disagreement_per_layer"]).tolist(),
               # NaN in a minibatch without targets (nothing measured): left out of the mean
               "clip_fraction": float(np.nanmean([h["clip_fraction"] for h in hist])),
               "grad_norm": float(np.mean([h["grad_norm"] for h in hist])),
               "entropy": float(first["entropy"])}
        records.append(rec)
        _sync(engine, state, precision, args.quantize_router)
        bar.update(1)
        bar.set_postfix(arm=f"{mode}/{precision}", seed=seed, reward=f"{rec['reward']:.2f}",
                        k3=f"{rec['k3_kl']:.1e}")
    return records


def summarize(runs: dict, steps: int) -> dict:
    """Per arm: statistics over seeds (CI) and over steps (median, p99)."""
    tail = max(1, steps // 4)
    arms = {}
    for arm, per_seed in runs.items():
        recs = [r for rs in per_seed.values() for r in rs]
        finals = [np.mean([r["reward"] for r in rs[-tail:]]) for rs in per_seed.values()]
        m, h = mm.mean_ci95(finals)
        pooled = lambda k: np.array([r[k] for r in recs])
        collapses = [mm.collapse_step([r["reward"] for r in rs]) for rs in per_seed.values()]
        arms[arm] = {
            "seeds": len(per_seed), "final_reward_mean": m, "final_reward_ci95": h,
            "final_reward_per_seed": [float(x) for x in finals],
            "k3_kl_median": float(np.median(pooled("k3_kl"))), "k3_kl_p99": float(np.percentile(pooled("k3_kl"), 99)),
            "mean_abs_delta_median": float(np.median(pooled("mean_abs_delta"))),
            "mean_abs_delta_p99": float(np.percentile(pooled("mean_abs_delta"), 99)),
            "clip_fraction": float(pooled("clip_fraction").mean()), "grad_norm": float(pooled("grad_norm").mean()),
            "entropy": float(pooled("entropy").mean()),
            "live_routing_disagreement": float(np.nanmean(pooled("live_routing_disagreement"))),  # NaN: not measured
            "live_routing_disagreement_per_layer": np.nanmean([r["live_routing_disagreement_per_layer"] for r in recs],
                                                              axis=0).tolist(),
            "collapses": sum(c is not None for c in collapses),
            "collapse_steps": [c for c in collapses if c is not None],
        }
    return arms


def _verdict(mode: str, lo: float, hi: float, higher: str, lower: str,
             neutral: str = "no measurable difference (CI includes 0)") -> str:
    if np.isnan(lo) or np.isnan(hi):
        return "one seed: no conclusion"
    return higher if lo > 0 else lower if hi < 0 else neutral


def comparisons(runs: dict, steps: int) -> list[dict]:
    """Paired (same seed) comparisons, R2 vs none and R3 vs none, per precision, with a plain verdict
    (only a 95% CI that excludes no-effect counts as a measured difference):

    - ``final_reward_diff``: final reward (mean over the last quarter of steps), arm − none;
    - ``k3_ratio``: mean k3 KL over steps, arm ÷ none, as the geometric mean over seeds of the per-seed
      ratios with its CI (ratios of a heavy-tailed metric: averaged in log space);
    - ``abs_delta_diff``: mean |Δ logprob| over steps, arm − none.
    """
    tail = max(1, steps // 4)
    final = lambda rs: float(np.mean([r["reward"] for r in rs[-tail:]]))
    mean_of = lambda rs, k: float(np.mean([r[k] for r in rs]))
    out = []
    for prec in PRECISIONS:
        base = runs.get(f"none/{prec}", {})
        for mode in ("R2", "R3"):
            arm = runs.get(f"{mode}/{prec}", {})
            seeds = sorted(set(base) & set(arm))
            if not seeds:
                continue
            m, h = mm.mean_ci95([final(arm[s]) - final(base[s]) for s in seeds])
            lk, lh = mm.mean_ci95([np.log(mean_of(arm[s], "k3_kl") / mean_of(base[s], "k3_kl")) for s in seeds])
            dm, dh = mm.mean_ci95([mean_of(arm[s], "mean_abs_delta") - mean_of(base[s], "mean_abs_delta")
                                   for s in seeds])
            out.append({"precision": prec, "comparison": f"{mode} - none", "seeds": len(seeds),
                        "final_reward_diff": m, "ci95": h,
                        "verdict": _verdict(mode, m - h, m + h, f"{mode} higher", f"{mode} lower"),
                        "k3_ratio": float(np.exp(lk)), "k3_ratio_ci95": [float(np.exp(lk - lh)), float(np.exp(lk + lh))],
                        "k3_verdict": _verdict(mode, lk - lh, lk + lh, f"{mode} higher k3 KL", f"{mode} lower k3 KL",
                                               "no measurable difference (CI includes 1)"),
                        "abs_delta_diff": dm, "abs_delta_ci95": dh,
                        "abs_delta_verdict": _verdict(mode, dm - dh, dm + dh, f"{mode} higher mean abs Δ",
                                                      f"{mode} lower mean abs Δ")})
    return out


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, prec in enumerate(PRECISIONS):
        for row, (key, title) in enumerate((("reward", "mean episode reward"), ("k3_kl", "k3 KL(train ‖ rollout)"))):
            ax = axes[row, col]
            for mode in MODES:
                per_seed = runs.get(f"{mode}/{prec}")
                if not per_seed:
                    continue
                y = np.array([[r[key] for r in rs] for rs in per_seed.values()])  # [seeds, steps]
                x = np.arange(1, y.shape[1] + 1)
                stats = [mm.mean_ci95(y[:, t]) for t in range(y.shape[1])]
                mean, half = np.array([s[0] for s in stats]), np.nan_to_num(np.array([s[1] for s in stats]))
                ax.plot(x, mean, label=f"{mode} (n={y.shape[0]})")
                ax.fill_between(x, mean - half, mean + half, alpha=0.2)
            ax.set_title(f"{title}, {prec} rollouts"), ax.grid(alpha=0.3), ax.legend()
            if key == "k3_kl":
                ax.set_yscale("log")
            if row == 1:
                ax.set_xlabel("RL step")
    fig.suptitle("replay_rl: mean over seeds with 95% CI band")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = ["arm", "seeds", "final_reward", "k3_kl_median", "k3_kl_p99", "mean_abs_delta_median",
           "mean_abs_delta_p99", "clip_fraction", "grad_norm", "entropy", "live_routing_disagreement", "collapses"]


def table(arms: dict) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for arm, a in arms.items():
        row = {**a, "arm": arm, "final_reward": f"{a['final_reward_mean']:.3f} ± {a['final_reward_ci95']:.3f}"}
        lines.append("| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def write_results(args, cfg, runs, t0, *, seeds_done: int, quiet: bool) -> dict:
    arms = summarize(runs, args.steps)
    diffs = comparisons(runs, args.steps)
    name = "replay_rl_quick" if args.quick else "replay_rl"
    RESULTS.mkdir(exist_ok=True)
    result = {**run_provenance(),  # commit + dirty: only clean runs are quoted
              "command": "python -m experiments.replay_rl" + (" --quick" if args.quick else ""),
              "complete": seeds_done == args.seeds, "seeds_done": seeds_done,
              "settings": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
              "model": {"num_experts": cfg.num_experts, "top_k": cfg.top_k,
                        "moe_layer_ids": list(cfg.moe_layer_ids), "expert_scale": args.expert_scale,
                        "params": cfg.param_count()},
              "wall_s": time.time() - t0, "arms": arms, "comparisons": diffs,
              "runs": {arm: {str(s): rs for s, rs in per.items()} for arm, per in runs.items()}}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(runs, RESULTS / f"{name}.png")
    if not quiet:
        print(table(arms))
        for c in diffs:
            print(f"{c['precision']}: {c['comparison']} final reward {c['final_reward_diff']:+.4f} ± {c['ci95']:.4f} "
                  f"(95% CI, {c['seeds']} paired seeds): {c['verdict']}")
        print(f"wrote {RESULTS / name}.json, .png ({time.time() - t0:.0f} s)")
    return result


def resummarize(path: Path) -> dict:
    """Recompute ``arms``, ``comparisons`` and the plot from the per-step records a run stored (no
    training): for summary statistics added after the run."""
    result = json.loads(path.read_text())
    runs = {arm: {int(s): rs for s, rs in per.items()} for arm, per in result["runs"].items()}
    steps = result["settings"]["steps"]
    result["arms"], result["comparisons"] = summarize(runs, steps), comparisons(runs, steps)
    path.write_text(json.dumps(result, indent=1))
    plot(runs, path.with_suffix(".png"))
    print(table(result["arms"]))
    for c in result["comparisons"]:
        print(f"{c['precision']}: {c['comparison']}: final reward {c['final_reward_diff']:+.4f} ± {c['ci95']:.4f} "
              f"({c['verdict']}); k3 KL x{c['k3_ratio']:.2f} [{c['k3_ratio_ci95'][0]:.2f}, "
              f"{c['k3_ratio_ci95'][1]:.2f}] ({c['k3_verdict']}); |Δ| {c['abs_delta_diff']:+.2e} ± "
              f"{c['abs_delta_ci95']:.1e} ({c['abs_delta_verdict']})")
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.summarize:
        return resummarize(RESULTS / ("replay_rl_quick.json" if args.quick else "replay_rl.json"))
    from r3jax.engine import Engine
    import jax.numpy as jnp

    t0 = time.time()
    mesh = make_mesh(data=-1)
    model = build_model(args)
    cfg = model_config(args)
    engine = Engine(model, max_seq_len=args.max_seq_len, max_batch_size=args.prompts * args.samples,
                    dtype=jnp.bfloat16)
    # the warm start is shared by --quick and full runs of one model
    out = Path(args.out) / f"E{args.experts}k{args.top_k}L{args.moe_layers}x{args.expert_scale:g}w{args.warmup_steps}"
    out.mkdir(parents=True, exist_ok=True)
    warm, acc = warm_start(args, model, mesh, engine, out)
    print(f"replay_rl: E={cfg.num_experts} K={cfg.top_k} MoE layers {cfg.moe_layer_ids}, "
          f"{cfg.param_count():,} params; warm start {args.warmup_steps} SFT steps"
          + (f" (token accuracy {acc:.2f})" if acc is not None else " (cached)"), flush=True)
    runs: dict = {}
    total = len(MODES) * len(PRECISIONS) * args.seeds * args.steps
    with tqdm(total=total, desc="replay_rl", disable=args.no_progress) as bar:
        for seed in range(args.seeds):  # seeds outermost: a stopped run still has every arm
            for prec in PRECISIONS:
                for mode in MODES:
                    runs.setdefault(f"{mode}/{prec}", {})[seed] = run_one(
                        args, engine, warm, mesh, mode, prec, seed, bar)
            # results after every seed, so an interrupted run leaves its completed seeds on disk
            result = write_results(args, cfg, runs, t0, seeds_done=seed + 1, quiet=seed + 1 < args.seeds)
    return result


if __name__ == "__main__":
    main()
