"""``python -m r3jax demo``: flags, the top-level flow, and the errors a user sees.

    python -m r3jax demo [--replay both|rollout|none] [--in-process] [--resume]
        [--config tiny|PRESET|HF_DIR] [--steps N] [--seed S] [--seeds N] [--out runs/demo]

Starts the inference server as a subprocess on a free loopback port (``--in-process`` uses the
in-process engine instead), warms the policy up on a few oracle demonstrations, then for each step:
multi-turn rollouts through the ``RemoteInferenceClient`` (each turn sends
``routed_experts_prompt_start``, so routes cross the wire once), GRPO advantages, ``collate`` +
``shard_batch``, a jitted ``train_step`` that replays the rollout's routes (or routes live with
``--replay none``), weight sync to the server, and orbax checkpoints. Rollouts run in bf16
(``--rollout-dtype``) and the trainer in fp32: the mismatch that replay removes.
``--replay both`` runs the replay run and the baseline from the same warm start; each mode runs
``--seeds`` seeds (S, S+1, ...: sampling and trainer seeds; the model and warm start come from S),
and the report shows the mean over seeds with a 95% CI band and the paired difference
replay − no replay with its CI. Outputs under ``--out``: ``<mode>/seed<s>/metrics.jsonl``,
``<mode>/seed<s>/ckpt/``, ``demo.png``, ``summary.json``.

A checkpoint that does not match the run (``--resume`` after changing the model or optimizer) and a
checkpoint write that fails both stop the demo with exit status 1 and the error on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m r3jax demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="model preset or Hugging Face directory")
    ap.add_argument("--env", default="echo", help="built-in environment (echo, arithmetic, guess_number)")
    ap.add_argument("--replay", default="both", choices=["both", "rollout", "trainer", "none"],
                    help="rollout: R3 (the rollout's routes); trainer: R2 (the trainer's pre-update routes); "
                         "none: live routing; both: rollout and none, from one warm start")
    ap.add_argument("--tis-cap", type=float, default=None,
                    help="truncated importance sampling: weigh each token by min(pi_train / pi_rollout, C)")
    ap.add_argument("--icepop", type=float, nargs=2, default=None, metavar=("ALPHA", "BETA"),
                    help="IcePop: weigh each token by pi_train / pi_rollout inside [ALPHA, BETA], mask it outside")
    ap.add_argument("--in-process", action="store_true", help="in-process engine instead of the server")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--steps", type=int, default=20, help="RL steps per run")
    ap.add_argument("--seeds", type=int, default=3, help="runs per mode (seeds S, S+1, ...)")
    ap.add_argument("--prompts", type=int, default=16, help="environments per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per environment (GRPO group)")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per turn")
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--decode-buckets", type=int, default=3,
                    help="decode-row sizes the rollout engine compiles a program for (1: a third of the "
                         "programs, a faster warm-up; every step padded to the full batch)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=30, help="supervised steps on demonstrations")
    ap.add_argument("--warmup-batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=5,
                    help="score held-out prompts greedily after step 1, every N steps and the last (0: never)")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out environments (seeds apart from training's)")
    ap.add_argument("--rollout-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--async", dest="async_rl", action="store_true",
                    help="asynchronous RL: the next step's rollouts are sampled while the trainer steps; weights "
                         "are pushed with mode=keep, so a trajectory can span versions")
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="with --async: rollouts run at most this many steps ahead of the trainer, and tokens "
                         "sampled more than this many weight versions before the trained one are masked out of "
                         "the loss (counted in stale_masked); 0 samples each step on the previous step's weights")
    ap.add_argument("--router-noise", type=float, default=0.0,
                    help="simulated selection noise on the rollout engine's router logits (a mismatch knob)")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="also write each run's metrics as TensorBoard event files under DIR/<replay>-seed<n>")
    ap.add_argument("--wandb", default=None, metavar="PROJECT",
                    help="also log each run to Weights & Biases PROJECT (needs the wandb package)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for name in ("steps", "seeds", "prompts", "samples", "max_turns", "max_tokens", "save_every", "warmup_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.warmup_steps < 0:
        ap.error(f"--warmup-steps={args.warmup_steps}: expected >= 0")
    for name in ("max_staleness", "eval_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 0")
    if args.router_noise < 0:
        ap.error(f"--router-noise={args.router_noise}: expected >= 0")
    try:
        loss_config(args)
    except ValueError as e:  # LossConfig names the field, the value and the expectation
        ap.error(f"{e} (from --tis-cap / --icepop)")
    return args


def loss_config(args):
    """The demo's LossConfig: the defaults, with --tis-cap or --icepop."""
    from r3jax.train import LossConfig

    return LossConfig(tis_cap=args.tis_cap, icepop=None if args.icepop is None else tuple(args.icepop))


def main(argv=None) -> dict:
    """Runs the demo; returns the summary. A mismatching checkpoint or a failed checkpoint write
    raises SystemExit with the error (exit status 1)."""
    started = time.perf_counter()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from r3jax.train import CheckpointMismatchError, CheckpointReadError, CheckpointWriteError

    try:
        return _main(args, started)
    except (CheckpointMismatchError, CheckpointReadError, CheckpointWriteError) as e:
        raise SystemExit(f"r3jax demo: error: {e}") from e


def _main(args, started: float) -> dict:
    import jax

    from r3jax.demo.report import report
    from r3jax.demo.rollouts import Rollouts, transfer_per_turn
    from r3jax.demo.run import build_model, run, warm_start
    from r3jax.sharding import make_mesh

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = ["rollout", "none"] if args.replay == "both" else [args.replay]
    mesh = make_mesh(data=-1)
    model = build_model(args)
    print(f"r3jax demo: {args.config} ({model.config.param_count():,} params, MoE layers "
          f"{model.config.moe_layer_ids}, E={model.config.num_experts}, K={model.config.top_k}) on "
          f"{jax.device_count()} {jax.default_backend()} device(s); env={args.env}; "
          f"rollouts {args.rollout_dtype} via {'in-process engine' if args.in_process else 'HTTP server'}",
          flush=True)
    with contextlib.ExitStack() as stack:
        rollouts = Rollouts(args, model, out, stack)
        model, acc = warm_start(args, model, mesh, rollouts.generator, out)
        if acc is not None:
            print(f"warm-up: {args.warmup_steps} supervised steps, token accuracy {acc:.2f}", flush=True)
        seeds = [args.seed + i for i in range(args.seeds)]
        for seed in seeds:  # seeds outermost: an interrupted demo still has both modes
            for mode in modes:
                run(argparse.Namespace(**{**vars(args), "seed": seed}), mode, model, mesh, rollouts,
                    out / mode / f"seed{seed}")
        transfer = transfer_per_turn(args, rollouts)
    return report(modes, seeds, transfer, out, started=started)
