"""``python -m r3jax train``: replaying policy-gradient steps on saved rollout rows, on one process or
many (one per host), with orbax checkpoints.

    python -m r3jax train --data ROWS_DIR --out RUN_DIR [--config tiny|PRESET|HF_DIR] [--steps N]
        [--batch-size B] [--replay rollout|trainer|none] [--lr LR] [--mesh DATA,FSDP,EXPERT]
        [--save-every N] [--keep K] [--seed S] [--compilation-cache DIR]
        [--num-processes N|auto --process-id I --coordinator HOST:PORT] [--local-devices N]
    python -m r3jax train --async --data SPOOL_DIR --out RUN_DIR [--max-staleness K] [--push URL ...]
        [--wait-timeout S] [... the flags above]
    python -m r3jax train --write-example-data ROWS_DIR [--config tiny] [--rows N] [--seed S]

Every process runs the same command (its own ``--process-id``). The mesh spans all processes'
devices; step s trains on global rows ``[(s mod N/B) * B, ... + B)`` of ``--data`` (a directory from
``r3jax.train.batch_file.write_rows``), and each process reads only its own block of them
(``r3jax.sharding.process_rows``). The run resumes from the newest readable checkpoint in
``RUN_DIR/ckpt`` if there is one; process 0 appends one JSON line per step to ``RUN_DIR/metrics.jsonl``.
``--num-processes auto`` leaves the rest to JAX's cluster detection (TPU pods, SLURM, Open MPI);
without these flags ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` are read.
``--local-devices N`` simulates N CPU devices per process (a multi-host rehearsal on one machine).

``--async``: asynchronous RL. ``--data`` is a spool (:class:`r3jax.train.spool.Spool`) that rollout
workers keep filling while the trainer steps; step n trains on batch n (waiting up to ``--wait-timeout``
seconds for it). The weights after k optimizer steps are version k + 1: tokens sampled more than
``--max-staleness`` versions before the version being trained are masked out of the loss and counted
(``stale_masked``; ``version_lag_mean`` / ``version_lag_max`` say how old the rest were), and after
each step the weights are pushed to every ``--push`` server (``POST /v1/weights``, mode ``keep``, that
version), so their running requests go on with them. A resumed run goes on with the batch and the
version after its checkpoint's step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HPARAMS = ("config", "lr", "batch_size", "replay", "seed", "mesh")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m r3jax train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="rows directory (r3jax.train.batch_file)")
    ap.add_argument("--out", help="run directory: ckpt/ and metrics.jsonl")
    ap.add_argument("--config", default="tiny", help="model preset or Hugging Face directory")
    ap.add_argument("--steps", type=int, default=10, help="train until this many optimizer steps")
    ap.add_argument("--batch-size", type=int, default=None, help="global rows per step (default: all)")
    ap.add_argument("--replay", default="rollout", choices=["rollout", "trainer", "none"])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mesh", default="-1,1,1", help="DATA,FSDP,EXPERT sizes (one may be -1)")
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compilation-cache", default=None, metavar="DIR")
    ap.add_argument("--tensorboard", default=None, metavar="DIR", help="also write metrics as TensorBoard event files")
    ap.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to Weights & Biases (needs wandb)")
    ap.add_argument("--num-processes", default=None, help="processes in the job, or 'auto'")
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
    ap.add_argument("--local-devices", type=int, default=None, help="simulated CPU devices per process")
    ap.add_argument("--write-example-data", default=None, metavar="DIR",
                    help="sample rollouts of the --config model with the engine into DIR and exit")
    ap.add_argument("--rows", type=int, default=16, help="rows for --write-example-data")
    ap.add_argument("--async", dest="async_rl", action="store_true",
                    help="train on a spool that rollout workers fill meanwhile (--data: the spool directory)")
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="with --async: mask tokens sampled more than this many versions before the trained one")
    ap.add_argument("--push", action="append", default=[], metavar="URL",
                    help="with --async: push the weights to this server after every step (repeatable)")
    ap.add_argument("--wait-timeout", type=float, default=600.0,
                    help="with --async: seconds to wait for the next batch")
    args = ap.parse_args(argv)
    if args.write_example_data is None and (args.data is None or args.out is None):
        ap.error("--data and --out are required (or --write-example-data DIR)")
    for name in ("steps", "save_every", "keep", "rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.max_staleness < 0:
        ap.error(f"--max-staleness={args.max_staleness}: expected >= 0")
    if not args.wait_timeout > 0:
        ap.error(f"--wait-timeout={args.wait_timeout}: expected > 0")
    if args.push and not args.async_rl:
        ap.error("--push: expected with --async (a synchronous run reads saved rows and serves no rollouts)")
    try:
        args.mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    except ValueError:
        args.mesh_shape = ()
    if len(args.mesh_shape) != 3:
        ap.error(f"--mesh={args.mesh!r}: expected three comma-separated ints DATA,FSDP,EXPERT")
    return args


def build_state(args, mesh):
    """The run's initial TrainState: the ``--config`` model from ``--seed`` (initialised by one
    jitted program, not op by op), adam(``--lr``), placed on ``mesh``."""
    import optax
    from flax import nnx

    from models import MoeConfig, MoeTransformer
    from models.hf import load_pretrained
    from r3jax.train import init_train_state

    if Path(args.config).is_dir():
        model = load_pretrained(args.config)[1]
    else:
        cfg = MoeConfig.preset(args.config)
        model = nnx.jit(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(args.seed)))()
    return init_train_state(model, optax.adam(args.lr), mesh=mesh, seed=args.seed)


def write_example_data(args) -> Path:
    """``--rows`` sampled single-turn rollouts of the untrained model, 4 per prompt, with a toy reward
    (the fraction of generated ids in the lower half of the vocabulary) and GRPO advantages."""
    import numpy as np
    from flax import nnx

    from models import MoeConfig, MoeTransformer
    from r3jax.batch import collate
    from r3jax.engine import Engine, GenerateRequest
    from r3jax.trace import RoutedExpertTrace
    from r3jax.train import group_advantages
    from r3jax.train.batch_file import write_rows

    cfg = MoeConfig.preset(args.config)
    engine = Engine(MoeTransformer(cfg, rngs=nnx.Rngs(args.seed)), max_seq_len=32, max_batch_size=8)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, cfg.vocab_size, int(rng.integers(4, 9))).tolist() for _ in range(-(-args.rows // 4))]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=8, seed=args.seed * 100_003 + i, return_routed_experts=True)
            for i, p in enumerate(p for p in prompts for _ in range(4))][:args.rows]
    outs = engine.generate(reqs)
    rewards = [float(np.mean(np.array(o.output_ids) < cfg.vocab_size // 2)) for o in outs]
    adv = group_advantages(np.array(rewards), np.arange(len(reqs)) // 4)
    trajs = []
    for r, o, a in zip(reqs, outs, adv):
        p, g = len(r.prompt_ids), len(o.output_ids)
        mask = np.r_[np.zeros(p), np.ones(g)].astype(np.float32)
        routes, captured = RoutedExpertTrace().record(prompt_len=p, generated_len=g, routes=o.routed_experts) \
            .finalize(token_count=p + g, loss_mask=mask)
        trajs.append(dict(tokens=np.array(list(r.prompt_ids) + list(o.output_ids)), loss_mask=mask,
                          rollout_logprobs=np.r_[np.zeros(p), o.logprobs].astype(np.float32), advantage=float(a),
                          routes=routes, captured=captured))
    batch = collate(trajs, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers)
    return write_rows(args.write_example_data, batch)


def _metrics_log(path: Path, start: int, primary: bool, args):
    """Process 0's writers (:class:`r3jax.writers.MetricWriters`: metrics.jsonl, and TensorBoard /
    W&B when asked). Resuming keeps the lines of the steps the restored state contains (later ones
    are re-run); a fresh start keeps an earlier log aside as ``metrics.jsonl.<n>``."""
    from r3jax import run_log
    from r3jax.writers import MetricWriters

    if not primary:
        return None
    if start == 0:
        run_log.keep_aside(path)
    run_log.keep_until(path, start)
    config = {k: getattr(args, k) for k in ("config", "replay", "lr", "batch_size", "steps", "seed")}
    return MetricWriters(path, tensorboard=args.tensorboard, wandb=args.wandb, run_name=path.parent.name,
                         config=config)


def _pusher(args, out: Path):
    """``push(state, first=False) -> version``: the weights to every ``--push`` server as version
    ``state.step + 1`` (mode keep), or None without servers. Process 0 only; a server's 4xx / 5xx stops
    the run. ``first`` (a run's start): a server that already holds that version got it from this run
    before a restart (the push precedes the checkpoint) and is left alone; one ahead of it holds weights
    the restored run does not have, which is an error to resolve by restarting that server."""
    import httpx
    import jax

    from r3jax.train.weight_sync import export_params, post_weights

    if not args.push or jax.process_index() != 0:
        return None

    def push(state, first: bool = False) -> int:
        version = int(jax.device_get(state.step)) + 1
        urls = list(args.push)
        if first:
            urls = []
            for url in args.push:
                held = int(httpx.get(url.rstrip("/") + "/v1/model", timeout=60).json()["weight_version"])
                if held > version:
                    raise ValueError(f"--push {url}: the server holds weight version {held}, ahead of this run's "
                                     f"{version} (weights pushed after the last checkpoint); restart that server")
                if held < version:
                    urls.append(url)
        if urls:
            path = export_params(out / "weights", state)  # once for every server
            for url in urls:
                post_weights(url, path, mode="keep", version=version)
        return version

    return push


def train(args) -> dict:
    """Run the job; returns ``{"start": first step, "last": final metrics record or None}``."""
    import jax
    import numpy as np

    from r3jax.batch import mask_stale, version_lag
    from r3jax.sharding import make_mesh, process_rows, shard_batch
    from r3jax.train import Checkpointer, record_trainer_routes, train_step
    from r3jax.train.batch_file import num_rows, read_rows
    from r3jax.train.spool import Spool

    mesh = make_mesh(*args.mesh_shape)
    spool = Spool(args.data) if args.async_rl else None
    if spool is not None and args.push and jax.process_count() > 1:
        raise ValueError("--push: expected one process (each server loads the exported weights itself; "
                         "push from a one-process trainer, or push_to_server from your own loop)")
    total = num_rows(spool.wait(0, args.wait_timeout) if spool is not None else args.data)
    b = total if args.batch_size is None else args.batch_size
    if not 0 < b <= total:
        raise ValueError(f"--batch-size={b}: expected 1..{total} (the rows in {args.data})")
    mine = process_rows(mesh, b)  # raises unless B is a multiple of the batch shards
    primary = jax.process_index() == 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = build_state(args, mesh)
    ckpt = Checkpointer(out / "ckpt", save_every=args.save_every, keep=args.keep,
                        config={k: getattr(args, k) for k in HPARAMS})
    last = None
    with ckpt:
        restored = ckpt.restore_latest(state)
        if restored is not None:
            state = restored[0]
        start = int(jax.device_get(state.step))
        if primary:
            print(f"r3jax train: {jax.process_count()} process(es), {jax.device_count()} {jax.default_backend()} "
                  f"devices, mesh {dict(mesh.shape)}, {b} rows/step ({mine.stop - mine.start} from each process), "
                  + (f"resuming at step {start}" if restored else "fresh start"), flush=True)
        log = _metrics_log(out / "metrics.jsonl", start, primary, args)
        push = _pusher(args, out) if spool is not None else None
        try:
            if push is not None:
                push(state, first=True)  # the servers sample with the trainer's weights from the first batch on
            for step in range(start, args.steps):
                t0 = time.perf_counter()
                extra = {}
                if spool is None:
                    first = (step % (total // b)) * b
                    rows = read_rows(args.data, slice(first + mine.start, first + mine.stop))
                else:  # batch n, sampled meanwhile; version step + 1 is being trained
                    path = spool.wait(step, args.wait_timeout)
                    if num_rows(path) != b:
                        raise ValueError(f"{path}: {num_rows(path)} rows: expected {b} (every batch of the spool "
                                         "the same size, --batch-size or the first batch's)")
                    rows = read_rows(path, slice(mine.start, mine.stop))
                    if rows.token_versions is None:
                        raise ValueError(f"{path}: no token_versions.npy: expected batches from collate (their "
                                         "trajectories' versions), which --async needs for its staleness bound")
                    extra = version_lag(rows, step + 1)
                    rows, extra["stale_masked"] = mask_stale(rows, step + 1, args.max_staleness)
                    extra["wait_s"] = time.perf_counter() - t0
                batch = shard_batch(rows, mesh)
                routes = record_trainer_routes(state, batch) if args.replay == "trainer" else None
                state, m = train_step(state, batch, replay=args.replay, trainer_routes=routes)
                m = jax.device_get(m)
                if push is not None:
                    extra["weight_version"] = push(state)
                last = {"step": step + 1, "step_s": time.perf_counter() - t0, **extra,
                        **{k: np.asarray(v).tolist() for k, v in m.items()}}
                ckpt.save(state, data_cursor={"step": step + 1})  # raises if this or an earlier save failed
                if log is not None:
                    log.write(last)
                    print(f"step {step + 1}: loss {last['loss']:.6f} k3 {last['k3_kl']:.2e} "
                          f"{last['step_s']:.2f} s", flush=True)
            if args.steps > start and not ckpt.should_save(args.steps):
                ckpt.save(state, data_cursor={"step": args.steps}, force=True)
            ckpt.wait()
        finally:
            if log is not None:
                log.close()
    return {"start": start, "last": last}


def main(argv=None) -> dict | None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import jax

    from r3jax import distributed
    from r3jax.train import CheckpointMismatchError, CheckpointReadError, CheckpointWriteError

    if args.local_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.compilation_cache is not None:  # every program, however small: restarts load them all
        Path(args.compilation_cache).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if args.write_example_data is not None:  # a single-process utility: joins no job
        print(f"r3jax train: wrote {write_example_data(args)}", flush=True)
        return None
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        raise SystemExit(f"r3jax train: error: {e}") from e
    try:
        return train(args)
    except (CheckpointMismatchError, CheckpointReadError, CheckpointWriteError, ValueError) as e:
        raise SystemExit(f"r3jax train: error: {e}") from e
