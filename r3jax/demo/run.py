"""One demo run: the supervised warm start, then RL steps with ``train_step(replay=mode)``, orbax
checkpoints and ``metrics.jsonl``.

Resume rules: ``--resume`` restores the newest readable checkpoint and keeps the log lines up to its
step (the steps after it are re-run). With nothing to resume it says so and starts fresh. A fresh
start never truncates an existing log nor writes among an earlier run's checkpoints: they are kept
as ``metrics.jsonl.<n>`` and ``ckpt.<n>``. A checkpoint of
a different training state raises (CheckpointMismatchError) before any file is touched; a failed
checkpoint write raises (CheckpointWriteError) at the next step.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from models import MoeConfig, MoeTransformer
from models.hf import load_pretrained
from r3jax.batch import collate, mask_stale, version_lag
from r3jax import run_log
from r3jax.writers import MetricWriters
from r3jax.demo.cli import loss_config
from r3jax.demo.rollouts import Rollouts, evaluate, make_loop
from r3jax.sharding import batch_multiple, shard_batch
from r3jax.train import (Checkpointer, export_params, group_advantages, init_train_state, load_params,
                         record_trainer_routes, train_step)
from r3jax.train.sft import sft_step

# Settings stored with every checkpoint; resuming under other values is allowed and reported.
HPARAMS = ("config", "env", "lr", "temperature", "prompts", "samples", "max_turns", "max_tokens",
           "max_seq_len", "rollout_dtype", "seed", "warmup_steps", "warmup_batch", "router_noise", "async_rl",
           "max_staleness", "tis_cap", "icepop")


@functools.lru_cache(maxsize=None)
def adam(lr: float) -> optax.GradientTransformation:
    """One optimizer object per learning rate: the compiled train step is cached per optimizer
    (part of the state's tree structure), so every seed of a demo reuses one compilation."""
    return optax.adam(lr)


def build_model(args):
    if Path(args.config).is_dir():
        return load_pretrained(args.config)[1]
    return MoeTransformer(MoeConfig.preset(args.config), rngs=nnx.Rngs(args.seed))


def warm_start(args, model, mesh, generator, out: Path):
    """Supervised warm-up on oracle demonstrations; cached in ``out/warmup`` so runs share it.
    Returns ``(model, token accuracy or None when loaded from the cache)``."""
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


def _start(args, mode: str, ckpt, state, out: Path):
    """Restore (``--resume``) or start fresh; prepare the log. Returns ``(state, first step)``."""
    log_path = out / "metrics.jsonl"
    if args.resume:
        restored = ckpt.restore_latest(state)  # raises CheckpointMismatchError; files untouched
        if restored is not None:
            state, cursor = restored
            start = int(cursor["step"])
            changes = ", ".join(f"--{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in ckpt.config_changes.items())
            print(f"replay={mode} seed={args.seed}: resuming from the step-{start} checkpoint in {ckpt.directory}"
                  + (f" with changed settings: {changes}" if changes else ""), flush=True)
            # steps logged after the checkpoint are re-run: keep only what the checkpoint contains
            run_log.keep_until(log_path, start)
            return state, start
        print(f"replay={mode} seed={args.seed}: --resume found no checkpoint in {ckpt.directory}; starting fresh at step 0",
              flush=True)
    old = run_log.keep_aside(log_path)
    if old is not None:
        print(f"replay={mode} seed={args.seed}: starting fresh; the previous log is kept as {old}", flush=True)
    return state, 0


def _rollout(args, step: int, rollouts: Rollouts):
    """One step's trajectories and the seconds they took."""
    t0 = time.perf_counter()
    with make_loop(args, rollouts.generator, step) as loop:  # closes its event loop/connections
        trajs = loop.run(args.prompts, args.samples)
    return trajs, time.perf_counter() - t0


def _step(args, mode: str, step: int, state, mesh, rollouts: Rollouts, ckpt: Checkpointer, *, ready=None,
          version: int | None = None):
    """Rollouts (or ``ready``: ``(trajectories, seconds)`` sampled meanwhile), GRPO advantages, one
    train_step, weight sync, checkpoint. Returns (record, state). ``version``: the weight version the
    state being trained has (asynchronous runs): tokens sampled more than ``args.max_staleness``
    versions before it are masked out of the loss and counted; the sync then keeps running requests."""
    cfg = rollouts.model_config
    t0 = time.perf_counter()
    trajs, t_roll = _rollout(args, step, rollouts) if ready is None else ready
    rewards = np.array([t.reward for t in trajs])
    adv = group_advantages(rewards, np.array([t.group for t in trajs]))
    for t, a in zip(trajs, adv):
        t.advantage = float(a)
    batch = collate(trajs, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    num_layers=cfg.num_moe_layers, batch_multiple=batch_multiple(mesh))
    lag = {}
    if version is not None:
        lag = version_lag(batch, version)
        batch, lag["stale_masked"] = mask_stale(batch, version, args.max_staleness)
    batch = shard_batch(batch, mesh)
    routes = record_trainer_routes(state, batch) if mode == "trainer" else None  # R2: the pre-update routes
    state, metrics = train_step(state, batch, replay=mode, config=loss_config(args), trainer_routes=routes)
    metrics = jax.device_get(metrics)
    version = rollouts.sync(state, mode=None if version is None else "keep")
    ckpt.save(state, data_cursor={"step": step + 1})  # raises if this or an earlier save failed
    rec = {"step": step + 1, "replay": mode, "seed": args.seed, "reward": float(rewards.mean()),
           "route_bytes": int(sum(t.route_bytes for t in trajs)),
           "route_rows": int(sum(t.route_rows for t in trajs)),
           "tokens": int(sum(t.num_tokens for t in trajs)), "samples": len(trajs), "weight_version": version,
           "rollout_s": t_roll, "step_s": time.perf_counter() - t0, **lag}
    rec.update({k: np.asarray(v).tolist() for k, v in metrics.items()})
    every = getattr(args, "eval_every", 0)
    if every and (step == 0 or (step + 1) % every == 0 or step + 1 == args.steps):
        t1 = time.perf_counter()
        rec["eval_reward"] = evaluate(args, rollouts.generator)  # the weights after this step (synced above)
        rec["eval_s"] = time.perf_counter() - t1
    return rec, state


class Sampler:
    """Asynchronous RL's rollout side: a thread samples step after step (from ``start``) while the
    trainer steps, on the weights pushed so far (mode "keep": a trajectory can span versions). It runs
    at most ``args.max_staleness`` steps ahead: step s's rollouts start once version ``s + 1 -
    max_staleness`` is pushed (the trainer trains step s at version s + 1), so no token is older than the
    bound when trained on (0: each step waits for the previous one's weights, as synchronous RL does).
    ``pushed(version)`` tells it of each push; ``take()`` returns the next ``(trajectories, seconds)``
    or raises what the thread raised."""

    def __init__(self, args, rollouts: Rollouts, start: int, version: int):
        self.args, self.rollouts, self.next = args, rollouts, start
        self.queue: queue.Queue = queue.Queue(maxsize=args.max_staleness + 1)
        self.stop = threading.Event()
        self.cond, self.version = threading.Condition(), version
        self.thread = threading.Thread(target=self._run, name="r3jax-demo-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self.thread.start()
        return self

    def pushed(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def __exit__(self, *exc) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        while self.thread.is_alive():  # unblock a put waiting for room
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
            self.thread.join(timeout=0.1)

    def _run(self) -> None:
        try:
            for step in range(self.next, self.args.steps):
                with self.cond:  # the staleness bound: not more than max_staleness steps ahead
                    while self.version < step + 1 - self.args.max_staleness and not self.stop.is_set():
                        self.cond.wait()
                if self.stop.is_set():
                    return
                item = _rollout(self.args, step, self.rollouts)
                while not self.stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # handed to the trainer, which raises it
            self.queue.put(e)

    def take(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


def run(args, mode: str, warm_model, mesh, rollouts: Rollouts, out: Path) -> list[dict]:
    """RL steps with ``replay=mode``; appends to ``out/metrics.jsonl``; returns this run's records."""
    out.mkdir(parents=True, exist_ok=True)
    state = init_train_state(warm_model, adam(args.lr), mesh=mesh, seed=args.seed)
    if not args.resume:  # a fresh run never mixes its steps with an earlier run's checkpoints
        old = run_log.keep_aside(out / "ckpt")
        if old is not None:
            print(f"replay={mode} seed={args.seed}: starting fresh; the previous checkpoints are kept in {old}", flush=True)
    ckpt = Checkpointer(out / "ckpt", save_every=args.save_every, keep=2,
                        config={k: getattr(args, k) for k in HPARAMS})
    records = []
    with ckpt:
        state, start = _start(args, mode, ckpt, state, out)
        tb, wandb = getattr(args, "tensorboard", None), getattr(args, "wandb", None)
        name = f"{mode}-seed{args.seed}"  # one TensorBoard / W&B run per replay mode and seed
        with MetricWriters(out / "metrics.jsonl", tensorboard=None if tb is None else Path(tb) / name, wandb=wandb,
                           run_name=name, config={k: getattr(args, k) for k in HPARAMS}) as log:
            version = rollouts.begin(state)
            t_loop = time.perf_counter()
            bar = tqdm(range(start, args.steps), desc=f"replay={mode} seed={args.seed}", disable=args.no_progress,
                       initial=start, total=args.steps)
            # the sampler counts in steps: version - offset is the optimizer steps + 1 of the weights pushed
            sampler = Sampler(args, rollouts, start, version - rollouts.offset) if getattr(args, "async_rl", False) else None
            with sampler if sampler is not None else contextlib.nullcontext() as ahead:
                for step in bar:
                    if ahead is None:
                        rec, state = _step(args, mode, step, state, mesh, rollouts, ckpt)
                    else:  # the next step's rollouts are sampled while this one trains
                        rec, state = _step(args, mode, step, state, mesh, rollouts, ckpt, ready=ahead.take(),
                                           version=version)
                        version = rec["weight_version"]
                        ahead.pushed(version - rollouts.offset)
                    rec["elapsed_s"] = time.perf_counter() - t_loop  # since the loop began (throughput)
                    log.write(rec)
                    records.append(rec)
                    bar.set_postfix(reward=f"{rec['reward']:.3f}", k3=f"{rec['k3_kl']:.1e}",
                                    dis=f"{rec['live_routing_disagreement']:.3f}", bytes=rec["route_bytes"])
        if records and not ckpt.should_save(records[-1]["step"]):
            ckpt.save(state, data_cursor={"step": records[-1]["step"]}, force=True)  # resume from the end
        ckpt.wait()  # raises CheckpointWriteError if the last save failed
    return records
