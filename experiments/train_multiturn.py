"""The main job: multi-turn RL with routed-expert replay, end to end (``make demo``).

    python -m experiments.train_multiturn [--replay both|rollout|none] [--in-process] [--resume]
        [--config tiny|PRESET|HF_DIR] [--steps N] [--seed S] [--out runs/demo]

Starts the inference server as a subprocess on a free loopback port (``--in-process`` uses the
in-process engine instead), warms the policy up on a few oracle demonstrations, then for each step:
multi-turn rollouts through the ``RemoteInferenceClient`` (each turn sends
``routed_experts_prompt_start``, so routes cross the wire once), GRPO advantages, ``collate`` +
``shard_batch``, a jitted ``train_step`` that replays the rollout's routes (or routes live with
``--replay none``), weight sync to the server, and orbax checkpoints. Rollouts run in bf16
(``--rollout-dtype``) and the trainer in fp32: the mismatch that replay removes.
``--replay both`` runs the replay run and the baseline from the same warm start and plots them
side by side. Outputs under ``--out``: ``<mode>/metrics.jsonl``, ``<mode>/ckpt/``, ``demo.png``,
``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m r3jax demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="model preset or Hugging Face directory")
    ap.add_argument("--env", default="echo", help="built-in environment (echo, arithmetic, guess_number)")
    ap.add_argument("--replay", default="both", choices=["both", "rollout", "none"])
    ap.add_argument("--in-process", action="store_true", help="in-process engine instead of the server")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--steps", type=int, default=40, help="RL steps per run")
    ap.add_argument("--prompts", type=int, default=16, help="environments per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per environment (GRPO group)")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per turn")
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=30, help="supervised steps on demonstrations")
    ap.add_argument("--warmup-batch", type=int, default=32)
    ap.add_argument("--rollout-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for name in ("steps", "prompts", "samples", "max_turns", "max_tokens", "save_every", "warmup_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.warmup_steps < 0:
        ap.error(f"--warmup-steps={args.warmup_steps}: expected >= 0")
    return args


# ---- the rollout side ------------------------------------------------------------------------
class ServerProcess:
    """``python -m r3jax serve`` as a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(self, args, log_path: Path):
        cmd = [sys.executable, "-m", "r3jax", "serve", "--model", args.config, "--host", "127.0.0.1",
               "--port", "0", "--max-seq-len", str(args.max_seq_len),
               "--max-batch-size", str(args.prompts * args.samples), "--seed", str(args.seed),
               "--dtype", args.rollout_dtype, "--batch-wait-ms", "20"]  # gather a turn's requests
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()  # the server prints its address once bound
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"server did not start (see {log_path}): {line!r}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        # keep draining stdout so a chatty server can never block on a full pipe
        self._drain = threading.Thread(target=lambda: [self.log.write(x) for x in self.proc.stdout], daemon=True)
        self._drain.start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_drain", None) is not None:
            self._drain.join(timeout=5)  # stdout is at EOF once the process has exited
        self.log.close()


class Rollouts:
    """The generator (client or engine) plus the weight-sync call that matches it."""

    def __init__(self, args, model, out: Path, stack: contextlib.ExitStack):
        import jax.numpy as jnp

        from r3jax.engine import Engine
        from r3jax.serve.client import RemoteInferenceClient

        self.sync_dir = out / "weights"
        if args.in_process:
            self.url = None
            self.generator = Engine(model, max_seq_len=args.max_seq_len,
                                    max_batch_size=args.prompts * args.samples,
                                    dtype=getattr(jnp, args.rollout_dtype))
        else:
            server = ServerProcess(args, out / "server.log")
            stack.callback(server.stop)
            self.url = server.url
            self.generator = RemoteInferenceClient([self.url], timeout=120.0)
            stack.callback(self.generator.close)

    def sync(self, state) -> int:
        from r3jax.train import push_to_engine, push_to_server

        if self.url is None:
            return push_to_engine(self.generator, state)
        return push_to_server(self.url, self.sync_dir, state)


def _read_lines(path: Path) -> list[str]:
    return [line if line.endswith("\n") else line + "\n"
            for line in (path.read_text().splitlines() if path.exists() else []) if line.strip()]


# ---- one run ---------------------------------------------------------------------------------
def build_model(args):
    from flax import nnx

    from models import MoeConfig, MoeTransformer
    from models.hf import load_pretrained

    if Path(args.config).is_dir():
        return load_pretrained(args.config)[1]
    return MoeTransformer(MoeConfig.preset(args.config), rngs=nnx.Rngs(args.seed))


def make_loop(args, generator, step: int):
    from r3jax.rollout import AgentLoop, make_env

    return AgentLoop(generator, lambda: make_env(args.env), max_turns=args.max_turns,
                     max_seq_len=args.max_seq_len, seed=args.seed * 100_003 + step + 1,
                     sampling=dict(max_tokens=args.max_tokens, temperature=args.temperature))


def warm_start(args, model, mesh, generator, out: Path):
    """Supervised warm-up on oracle demonstrations; cached in ``out/warmup`` so runs share it."""
    import jax
    import optax

    from r3jax.batch import collate
    from r3jax.sharding import batch_multiple, shard_batch
    from r3jax.train import export_params, init_train_state, load_params
    from r3jax.train.sft import sft_step

    cfg, path = model.config, out / "warmup"
    if (path / "_CHECKPOINT_METADATA").exists() or (path / "_METADATA").exists():
        return load_params(path, model), None
    state = init_train_state(model, optax.adam(3e-3), mesh=mesh, seed=args.seed)
    acc = None
    with make_loop(args, generator, step=-1) as loop:
        for _ in range(args.warmup_steps):
            demos = loop.demonstrations(args.warmup_batch)
            batch = collate(demos, num_experts=cfg.num_experts, top_k=cfg.top_k,
                            num_layers=cfg.num_moe_layers, batch_multiple=batch_multiple(mesh))
            state, m = sft_step(state, shard_batch(batch, mesh))
            acc = float(jax.device_get(m["accuracy"]))
    model = state.model()
    export_params(path, model)
    return model, acc


def run(args, mode: str, warm_model, mesh, rollouts: Rollouts, out: Path) -> list[dict]:
    """RL steps with ``replay=mode``; appends to ``out/metrics.jsonl``; returns this run's records."""
    import jax
    import optax
    from tqdm import tqdm

    from r3jax.batch import collate
    from r3jax.sharding import batch_multiple, shard_batch
    from r3jax.train import Checkpointer, LossConfig, group_advantages, init_train_state, train_step

    cfg = warm_model.config
    out.mkdir(parents=True, exist_ok=True)
    state = init_train_state(warm_model, optax.adam(args.lr), mesh=mesh, seed=args.seed)
    ckpt = Checkpointer(out / "ckpt", save_every=args.save_every, keep=2)
    start, kept = 0, []
    if args.resume:
        restored = ckpt.restore_latest(state)
        if restored is not None:
            state, cursor = restored
            start = int(cursor["step"])
            # steps logged after the checkpoint are re-run: keep only what the checkpoint contains
            kept = [line for line in _read_lines(out / "metrics.jsonl") if json.loads(line)["step"] <= start]
    records = []
    with ckpt, open(out / "metrics.jsonl", "w") as log:
        log.writelines(kept)
        version = rollouts.sync(state)
        bar = tqdm(range(start, args.steps), desc=f"replay={mode}", disable=args.no_progress,
                   initial=start, total=args.steps)
        for step in bar:
            t0 = time.perf_counter()
            with make_loop(args, rollouts.generator, step) as loop:  # closes its event loop/connections
                trajs = loop.run(args.prompts, args.samples)
            t_roll = time.perf_counter() - t0
            rewards = np.array([t.reward for t in trajs])
            adv = group_advantages(rewards, np.array([t.group for t in trajs]))
            for t, a in zip(trajs, adv):
                t.advantage = float(a)
            batch = collate(trajs, num_experts=cfg.num_experts, top_k=cfg.top_k,
                            num_layers=cfg.num_moe_layers, batch_multiple=batch_multiple(mesh))
            state, metrics = train_step(state, shard_batch(batch, mesh), replay=mode, config=LossConfig())
            metrics = jax.device_get(metrics)
            version = rollouts.sync(state)
            ckpt.save(state, data_cursor={"step": step + 1})
            rec = {"step": step + 1, "replay": mode, "reward": float(rewards.mean()),
                   "route_bytes": int(sum(t.route_bytes for t in trajs)),
                   "route_rows": int(sum(t.route_rows for t in trajs)),
                   "tokens": int(sum(t.num_tokens for t in trajs)), "weight_version": version,
                   "rollout_s": t_roll, "step_s": time.perf_counter() - t0}
            rec.update({k: np.asarray(v).tolist() for k, v in metrics.items()})
            log.write(json.dumps(rec) + "\n")
            log.flush()
            records.append(rec)
            bar.set_postfix(reward=f"{rec['reward']:.3f}", k3=f"{rec['k3_kl']:.1e}",
                            dis=f"{rec['routing_disagreement']:.3f}", bytes=rec["route_bytes"])
        if records and not ckpt.should_save(records[-1]["step"]):
            ckpt.save(state, data_cursor={"step": records[-1]["step"]}, force=True)  # resume from the end
        ckpt.wait()
    return records


def transfer_per_turn(args, rollouts: Rollouts) -> dict:
    """Route bytes received per turn index, incremental vs full re-gather (one batch each)."""
    from r3jax.rollout import AgentLoop, make_env

    result = {}
    for name, full in (("incremental", False), ("full_regather", True)):
        with AgentLoop(rollouts.generator, lambda: make_env(args.env), max_turns=args.max_turns,
                       max_seq_len=args.max_seq_len, seed=args.seed, full_regather=full,
                       sampling=dict(max_tokens=args.max_tokens, temperature=args.temperature)) as loop:
            trajs = loop.run(args.prompts, args.samples)
        per_turn = np.zeros(args.max_turns)
        for t in trajs:
            for i, turn in enumerate(t.turns):
                per_turn[i] += turn.route_bytes
        result[name] = per_turn.tolist()
    return result


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax

    from experiments.demo_report import report
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
    runs = {}
    with contextlib.ExitStack() as stack:
        rollouts = Rollouts(args, model, out, stack)
        model, acc = warm_start(args, model, mesh, rollouts.generator, out)
        if acc is not None:
            print(f"warm-up: {args.warmup_steps} supervised steps, token accuracy {acc:.2f}", flush=True)
        for mode in modes:
            runs[mode] = run(args, mode, model, mesh, rollouts, out / mode)
        transfer = transfer_per_turn(args, rollouts)
    summary = report(runs, transfer, out)
    return summary


if __name__ == "__main__":
    main()
