"""The R3 paper's core measurement, small: train–inference mismatch with and without routed-expert replay.

    python -m experiments.replay_mismatch [--quick] [--configs tiny,small_100m]

For each model config (random init, fp32 parameters), the in-process engine samples rollouts
(temperature 1, routes captured) in bf16 compute with the LM head in fp32 (the engine's default,
``logits_dot_in_fp32``), in bf16 with the head in bf16 too ("bf16 head"), and in fp32 (the same-dtype
control); the same seeds, so the two bf16 arms mostly sample the same tokens (``same_tokens`` says how
many) and their mean |Δ| under replay shows what the head's own rounding adds.
An fp32 trainer then scores the same tokens with ``eval_step`` twice: ``replay="none"`` (live
routing) and ``replay="rollout"`` (R3). Reported over loss-active tokens (r3jax.metrics): the
trainer router's own routing disagreement with the rollout (``live_``: what replay overrides; under
replay the experts used are the rollout's by construction, so that is not a result), tokens with any
differing layer, mean |Δ|, k3 KL, F(2) and the fallback fraction.
Last, the fp32 train step with replay ÷ without on the bf16 batch (target <= 1.03): wall time in
interleaved pairs, plus XLA's cost analysis of the two compiled programs (deterministic flops and
bytes, immune to a busy machine). Writes experiments/results/replay_mismatch.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.common import RESULTS, table, write_json
from models import MoeConfig, MoeTransformer
from r3jax.batch import collate
from r3jax.engine import Engine, GenerateRequest
from r3jax.sharding import shard_batch
from r3jax.trace import RoutedExpertTrace
from r3jax.train import LossConfig, eval_step, init_train_state, make_train_step

COLUMNS = ["config", "rollout", "replay", "live_routing_disagreement", "live_token_any_disagreement",
           "mean_abs_delta", "k3_kl", "f2", "fallback_fraction"]
BF16_HEAD = "bf16, bf16 head"  # the rollout arm whose LM head runs in bf16 too (logits_dot_in_fp32=False)


def rollouts(engine: Engine, cfg: MoeConfig, *, n: int, prompt_len: int, max_tokens: int, seed: int):
    """``n`` sampled single-turn trajectories (collate-ready dicts); routes assembled by the trace."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(n)]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=max_tokens, temperature=1.0, seed=seed + i,
                            return_routed_experts=True) for i, p in enumerate(prompts)]
    trajs = []
    for p, out in zip(prompts, engine.generate(reqs)):
        g = len(out.output_ids)
        loss_mask = np.array([0.0] * len(p) + [1.0] * g, np.float32)
        trace = RoutedExpertTrace().record(prompt_len=len(p), generated_len=g, routes=out.routed_experts)
        routes, captured = trace.finalize(token_count=len(p) + g, loss_mask=loss_mask)
        trajs.append(dict(tokens=np.array(p + list(out.output_ids), np.int32), loss_mask=loss_mask,
                          rollout_logprobs=np.array([0.0] * len(p) + list(out.logprobs), np.float32),
                          advantage=float(rng.normal()), routes=routes, captured=captured))
    return trajs


def step_time_ratio(model, batch, *, reps: int) -> dict:
    """fp32 train-step cost with replay ÷ without, on the same batch.

    Each mode's step (``make_train_step``: the jitted program ``train_step`` runs) is compiled once
    ahead of time; its XLA cost analysis gives a deterministic flops / bytes ratio, and its wall time
    is taken in interleaved pairs (order alternating) so machine drift hits both modes. The wall
    ratio is the median of the per-pair ratios.
    """
    tx = optax.adam(1e-4)
    states = {mode: init_train_state(model, tx) for mode in ("rollout", "none")}
    batch = shard_batch(batch, states["none"].mesh)  # on device up front: time the step alone
    steps, cost = {}, {}
    for mode, st in states.items():
        steps[mode] = make_train_step(st, replay=mode, config=LossConfig()).lower(st, batch).compile()
        ca = steps[mode].cost_analysis()
        cost[mode] = ca[0] if isinstance(ca, (list, tuple)) else ca
    times = {"rollout": [], "none": []}
    for i in range(reps + 1):  # the first round warms up and is discarded
        for mode in ("none", "rollout") if i % 2 else ("rollout", "none"):
            t0 = time.perf_counter()
            states[mode], m = steps[mode](states[mode], batch)
            jax.block_until_ready((states[mode], m))
            if i:
                times[mode].append(time.perf_counter() - t0)
    pairs = [r / n for r, n in zip(times["rollout"], times["none"])]
    ratio = lambda key: float(cost["rollout"].get(key, np.nan) / cost["none"].get(key, np.nan))
    return {"step_s_live": statistics.median(times["none"]), "step_s_replay": statistics.median(times["rollout"]),
            "replay_step_ratio": statistics.median(pairs),
            "ratio_of_min": min(times["rollout"]) / min(times["none"]),
            "xla_flops_ratio": ratio("flops"), "xla_bytes_ratio": ratio("bytes accessed"), "reps": reps}


def measure(name: str, cfg: MoeConfig, *, n: int, prompt_len: int, max_tokens: int, reps: int,
            seed: int) -> tuple[list[dict], dict]:
    model = MoeTransformer(cfg, rngs=nnx.Rngs(seed))
    state = init_train_state(model, optax.adam(1e-4))
    seq_len = 1 << (prompt_len + max_tokens - 1).bit_length()
    rows, batches = [], {}
    tokens = {}
    for label, dtype, head32 in (("bf16", jnp.bfloat16, True), (BF16_HEAD, jnp.bfloat16, False),
                                 ("fp32", None, True)):
        engine = Engine(model, max_seq_len=seq_len, max_batch_size=n, dtype=dtype, prefix_cache_bytes=0,
                        logits_dot_in_fp32=head32)
        trajs = rollouts(engine, cfg, n=n, prompt_len=prompt_len, max_tokens=max_tokens, seed=seed)
        engine.close()
        tokens[label] = [t["tokens"] for t in trajs]
        batches[label] = collate(trajs, seq_len=seq_len, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                 num_layers=cfg.num_moe_layers)
        for replay in ("none", "rollout"):
            m = jax.device_get(eval_step(state, batches[label], replay=replay))
            rows.append({"config": name, "rollout": label, "replay": replay,
                         **{k: float(v) for k, v in m.items() if np.ndim(v) == 0},
                         "live_routing_disagreement_per_layer":
                             np.asarray(m["live_routing_disagreement_per_layer"]).tolist()})
            print(table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    same = [np.array_equal(a, b) for a, b in zip(tokens["bf16"], tokens[BF16_HEAD])]
    for r in rows:
        if r["rollout"] in ("bf16", BF16_HEAD):
            r["same_tokens"] = float(np.mean(same))  # trajectories the two bf16 arms sampled alike
    timing = {"config": name, "tokens": int(np.asarray(batches["bf16"].attention_mask).sum()),
              **step_time_ratio(model, batches["bf16"], reps=reps)}
    return rows, timing


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("live_routing_disagreement", "trainer router's disagreement"),
               ("live_token_any_disagreement", "tokens, any layer differs"),
               ("k3_kl", "k3 KL"), ("mean_abs_delta", "mean |Δ logprob|")]
    groups = sorted({(r["config"], r["rollout"]) for r in rows}, key=lambda g: (g[0] != "tiny", g))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6))
    x = np.arange(len(groups))
    for ax, (key, title) in zip(axes, metrics):
        for j, (replay, color) in enumerate((("none", "tab:red"), ("rollout", "tab:blue"))):
            vals = [next(r[key] for r in rows if (r["config"], r["rollout"], r["replay"]) == (*g, replay))
                    for g in groups]
            if key in ("k3_kl", "mean_abs_delta"):
                vals = [max(v, 1e-16) for v in vals]  # log axis: exact zeros drawn at the floor
            ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, color=color,
                   label="no replay" if replay == "none" else "replay (R3)")
        ax.set_xticks(x, [f"{c}\n{d} rollout" for c, d in groups], fontsize=8)
        ax.set_title(title)
        if key in ("k3_kl", "mean_abs_delta"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("fp32 trainer vs engine rollouts (bf16 with an fp32 or a bf16 head, and fp32 control)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rollouts and timing repeats")
    ap.add_argument("--configs", default="tiny,small_100m")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plan = {"tiny": dict(n=8, prompt_len=16, max_tokens=48, reps=41),
            "small_100m": dict(n=8, prompt_len=16, max_tokens=48, reps=9)}
    if args.quick:
        plan = {"tiny": dict(n=8, prompt_len=8, max_tokens=24, reps=21),
                "small_100m": dict(n=4, prompt_len=8, max_tokens=8, reps=5)}
    rows, timings = [], []
    print(table([], COLUMNS))
    for name in args.configs.split(","):
        r, t = measure(name, MoeConfig.preset(name), seed=args.seed, **plan[name])
        rows += r
        timings.append(t)
    print()
    print(table(rows, COLUMNS))
    print()
    print(table(timings, ["config", "tokens", "step_s_live", "step_s_replay", "replay_step_ratio", "ratio_of_min",
                       "xla_flops_ratio", "xla_bytes_ratio", "reps"]))
    summary = []
    for name in args.configs.split(","):
        get = lambda rollout, replay, k: next(x[k] for x in rows if (x["config"], x["rollout"], x["replay"]) == (name, rollout, replay))
        summary.append({"config": name,
                        "k3_kl_none": get("bf16", "none", "k3_kl"), "k3_kl_replay": get("bf16", "rollout", "k3_kl"),
                        "k3_reduction": get("bf16", "none", "k3_kl") / max(get("bf16", "rollout", "k3_kl"), 1e-30),
                        "live_disagreement_none": get("bf16", "none", "live_routing_disagreement"),
                        "live_disagreement_replay": get("bf16", "rollout", "live_routing_disagreement"),
                        # what the head's bf16 rounding adds to the logprob mismatch left under replay
                        "mean_abs_delta_replay_fp32_head": get("bf16", "rollout", "mean_abs_delta"),
                        "mean_abs_delta_replay_bf16_head": get(BF16_HEAD, "rollout", "mean_abs_delta"),
                        "head_fp32_over_bf16": get("bf16", "rollout", "mean_abs_delta")
                        / max(get(BF16_HEAD, "rollout", "mean_abs_delta"), 1e-30),
                        "same_tokens": get("bf16", "rollout", "same_tokens")})
    print()
    print(table(summary, list(summary[0])))
    path = write_json("replay_mismatch", {"args": vars(args), "plan": plan, "rows": rows, "timing": timings,
                                          "summary": summary})
    png = RESULTS / "replay_mismatch.png"
    plot(rows, png)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
