"""The rollout side of the demo: ``python -m r3jax serve`` as a subprocess (or the in-process
engine), the agent loop of one step, weight sync, and the per-turn route-transfer measurement."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np


class ServerProcess:
    """``python -m r3jax serve`` as a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(self, args, log_path: Path):
        cmd = [sys.executable, "-m", "r3jax", "serve", "--model", args.config, "--host", "127.0.0.1",
               "--port", "0", "--max-seq-len", str(args.max_seq_len),
               "--max-batch-size", str(args.prompts * args.samples), "--seed", str(args.seed),
               "--dtype", args.rollout_dtype, "--decode-buckets", str(args.decode_buckets),
               *(["--router-noise", str(args.router_noise)] if getattr(args, "router_noise", 0.0) else []),
               # compiled programs persist across demo runs: a second `make demo` skips most of warm-up
               "--compilation-cache", str(Path(args.out).resolve().parent / ".jax-compilation-cache")]
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
        self._wait_ready(log_path)

    def _wait_ready(self, log_path: Path, poll_s: float = 0.5):
        """Block until ``/health`` is 200: the server compiles every program before serving (minutes
        on a cold CPU cache), longer than a request's retry budget should have to cover."""
        from r3jax.serve.client import wait_healthy

        try:
            seconds = wait_healthy(self.url, timeout=3600.0, poll_s=poll_s, proc=self.proc)
        except RuntimeError:
            raise RuntimeError(f"server exited with {self.proc.returncode} during warm-up (see {log_path})") from None
        print(f"server ready after {seconds:.0f} s of warm-up (every program compiled)",
              flush=True)

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
        self.model_config = model.config
        self.offset = 0  # weight version - (optimizer steps + 1) (see begin)
        if args.in_process:
            self.url = None
            self.generator = Engine(model, max_seq_len=args.max_seq_len,
                                    max_batch_size=args.prompts * args.samples,
                                    dtype=getattr(jnp, args.rollout_dtype), decode_buckets=args.decode_buckets,
                                    router_noise=getattr(args, "router_noise", 0.0) or None)
        else:
            server = ServerProcess(args, out / "server.log")
            stack.callback(server.stop)
            self.url = server.url
            self.generator = RemoteInferenceClient([self.url], timeout=120.0)
            stack.callback(self.generator.close)

    def current_version(self) -> int:
        if self.url is None:
            return int(self.generator.weight_version)
        import httpx

        return int(httpx.get(self.url + "/v1/model", timeout=30).json()["weight_version"])

    def begin(self, state) -> int:
        """A run's first push: the weights after k optimizer steps are version k + 1 + ``offset``, where
        ``offset`` is 0 unless the generator already holds a later version (an earlier run on the same
        server): a resumed run on a fresh generator goes on numbering where it stopped, so a token's
        staleness ``current - version`` means the same across restarts. Returns the version pushed."""
        import jax

        step = int(jax.device_get(state.step))
        self.offset = max(0, self.current_version() - step)
        return self.sync(state)

    def sync(self, state, mode: str | None = None) -> int:
        """Push ``state``'s weights as version ``state.step + 1 + offset`` (:meth:`begin`); ``mode`` as
        ``Engine.set_weights`` ("keep" while rollouts run on)."""
        import jax

        from r3jax.train import push_to_engine, push_to_server

        version = int(jax.device_get(state.step)) + 1 + self.offset
        if self.url is None:
            return push_to_engine(self.generator, state, mode=mode, version=version)
        return push_to_server(self.url, self.sync_dir, state, mode=mode, version=version)


EVAL_SEEDS = 1 << 31  # held-out environments: env seeds from here on (training's are drawn in [0, 2**31))


def make_loop(args, generator, step: int, *, seed: int | None = None, full_regather: bool = False,
              temperature: float | None = None):
    """The AgentLoop of one RL step (``step`` -1: the warm-up); use it as a context manager."""
    from r3jax.rollout import AgentLoop, make_env

    return AgentLoop(generator, lambda: make_env(args.env), max_turns=args.max_turns,
                     max_seq_len=args.max_seq_len, full_regather=full_regather,
                     seed=args.seed * 100_003 + step + 1 if seed is None else seed,
                     sampling=dict(max_tokens=args.max_tokens,
                                   temperature=args.temperature if temperature is None else temperature))


def evaluate(args, generator) -> float:
    """Mean reward of greedy rollouts on ``args.eval_prompts`` held-out environments: the same seeds at every
    evaluation, none of them a training seed (those are drawn below ``EVAL_SEEDS``; a toy task's small
    state space may still repeat a training prompt)."""
    with make_loop(args, generator, 0, seed=0, temperature=0.0) as loop:
        trajs = loop.run(args.eval_prompts, 1, env_seeds=[EVAL_SEEDS + i for i in range(args.eval_prompts)])
    return float(np.mean([t.reward for t in trajs]))


def transfer_per_turn(args, rollouts: Rollouts) -> dict:
    """Route bytes received per turn index, incremental vs full re-gather (one batch each)."""
    result = {}
    for name, full in (("incremental", False), ("full_regather", True)):
        with make_loop(args, rollouts.generator, 0, seed=args.seed, full_regather=full) as loop:
            trajs = loop.run(args.prompts, args.samples)
        per_turn = np.zeros(args.max_turns)
        for t in trajs:
            for i, turn in enumerate(t.turns):
                per_turn[i] += turn.route_bytes
        result[name] = per_turn.tolist()
    return result
