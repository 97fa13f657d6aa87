"""Where does replay pay? Training outcome against train–rollout mismatch, per arm, resumable.

    python -m experiments.replay_dose [--settings bf16,s0.03,...] [--arms none,R2,R3,TIS,R3+TIS]
                                      [--seeds 5] [--steps 10] [--summarize] [--quick]

A grid of (setting, arm, seed) GRPO runs on the multi-turn echo task, from one supervised warm start
per router family (the replay_rl model: 4 MoE layers, E=64, top-8, expert outputs x4). A **setting**
is one train–rollout mismatch source and one off-policy degree, named by its parts joined by ``-``:

- rollout precision: ``bf16`` (bf16 compute of the fp32 weights; the default), ``int8`` or ``fp8``
  (weight-only fake quantization of every matmul weight but the router, ``models.quant``);
- ``s<σ>``: *simulated* Gaussian selection noise of std σ on the rollout engine's router logits
  (``Engine(router_noise=σ)``, standing in for a different inference kernel), to sweep the live
  disagreement on purpose; the trainer never sees it;
- ``sigmoid``: the DeepSeek-V3 router shape (``sigmoid_bias_grouped``, 8 groups, top-4 groups,
  scaling 2.5) at toy size instead of softmax top-k;
- ``mb<n>`` minibatch updates per rollout batch (default 2) and ``ep<n>`` epochs over them (default 1).

**Arms**: ``none`` (live routing), ``R2`` (``replay="trainer"``), ``R3`` (``replay="rollout"``),
``TIS`` (``LossConfig.tis_cap``), ``R3+TIS``. Seeds are paired across arms (same sampling seeds and
initial optimizer state). The rollout side is the real engine path (paged engine, bf16).

Each finished run is written at once to ``experiments/results/replay_dose[_quick].json`` as
``runs["<setting>/<arm>"][seed]`` = its per-step records (reward, k3 KL, mean |Δ|, p99 and max
|log ratio|, live disagreement, clip fraction, grad norm, entropy, mean truncated importance weight,
train and rollout seconds), with the commit it ran on. A rerun skips every finished run; a run cut
off midway leaves nothing and its cell incomplete (``cells[...]["complete"]``, top-level
``complete``). ``--summarize`` re-derives the summary, tables and figure from the stored records
(experiments/dose_summary.py). The grid's fixed knobs (steps, batch, model, tis cap) are stored; a
rerun with other values is refused rather than mixed in. An arm whose definition changed (``ARM_DEFS``:
the TIS arms' ratio) drops its stored runs of the older definition and runs them again.

Several processes can fill one grid at once: start the same command more than once and they split
its runs (experiments/dose_grid.py: a lock around every write, a claim per run).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import time
import types
from pathlib import Path

import numpy as np

from experiments import dose_summary as ds
from experiments.common import RESULTS
from experiments.dose_grid import drop_superseded, load, report, resummarize, run_grid

ARMS = {"none": ("none", None), "R2": ("trainer", None), "R3": ("rollout", None),
        "TIS": ("none", "cap"), "R3+TIS": ("rollout", "cap")}
PRECISIONS = ("bf16", "int8", "fp8")
DEFAULT_SETTINGS = "bf16,s0.03,s0.01,s0.03-mb8,s0.003,mb8,fp8,sigmoid,int8,ep2,mb1,s0.03-mb1,s0.01-mb8"
# knobs every run of one grid shares: a stored grid with other values is not extended
FIXED = ("steps", "prompts", "samples", "max_turns", "max_tokens", "lr", "warmup_steps", "experts", "top_k",
         "moe_layers", "expert_scale", "tis_cap")
# what the TIS arms' PPO ratio is taken against (r3jax.train.record_old_logprobs): part of those arms'
# definition, stored with each of their runs; a stored run of another definition is dropped and rerun
TIS_RATIO = "pre-update trainer logprobs"
ARM_DEFS = {"TIS": {"tis_ratio": TIS_RATIO}, "R3+TIS": {"tis_ratio": TIS_RATIO}}


@dataclasses.dataclass(frozen=True)
class Setting:
    precision: str = "bf16"
    noise: float = 0.0
    router: str = "softmax_topk"
    minibatches: int = 2
    epochs: int = 1

    @classmethod
    def parse(cls, name: str) -> "Setting":
        """``"fp8-s0.05-sigmoid-mb4-ep2"`` and the like; parts in any order, defaults for the rest."""
        kw = {}
        for part in name.strip().split("-"):
            if part in PRECISIONS:
                kw["precision"] = part
            elif part == "sigmoid":
                kw["router"] = "sigmoid_bias_grouped"
            elif part[:1] == "s" and _number(part[1:]) is not None and float(part[1:]) >= 0:
                kw["noise"] = float(part[1:])
            elif part[:2] in ("mb", "ep") and part[2:].isdigit() and int(part[2:]) >= 1:
                kw["minibatches" if part[:2] == "mb" else "epochs"] = int(part[2:])
            else:
                raise ValueError(f"--settings {name!r}: part {part!r} is not one of {'/'.join(PRECISIONS)}, "
                                 "s<sigma >= 0>, sigmoid, mb<n >= 1>, ep<n >= 1>")
        return cls(**kw)

    @property
    def name(self) -> str:
        parts = [] if self.precision == "bf16" else [self.precision]  # bf16: the default, named alone
        parts += [f"s{self.noise:g}"] if self.noise else []
        parts += ["sigmoid"] if self.router != "softmax_topk" else []
        parts += [f"mb{self.minibatches}"] if self.minibatches != 2 else []
        parts += [f"ep{self.epochs}"] if self.epochs != 1 else []
        return "-".join(parts) or "bf16"

    @property
    def family(self) -> str:
        """Settings of one family differ only in the mismatch source (precision, noise)."""
        return ("sigmoid " if self.router != "softmax_topk" else "") + f"{self.minibatches} minibatch x {self.epochs} epoch"

    def describe(self) -> dict:
        return {**dataclasses.asdict(self), "family": self.family}


def _number(s: str):
    try:
        return float(s)
    except ValueError:
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated (default {DEFAULT_SETTINGS})")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="RL steps per run")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--expert-scale", type=float, default=4.0)
    ap.add_argument("--tis-cap", type=float, default=2.0, help="LossConfig.tis_cap of the TIS arms")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, 3 steps, 4 prompts, own result file")
    ap.add_argument("--summarize", action="store_true", help="re-derive summary, tables and figure; no training")
    ap.add_argument("--results", default=None, help="result file (default experiments/results/replay_dose[_quick].json)")
    ap.add_argument("--out", default="runs/replay_rl", help="warm-start cache directory (shared with replay_rl)")
    ap.add_argument("--compilation-cache", default="runs/jax-cache", help="JAX persistent compilation cache ('' off)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.prompts = 2, 3, 4
    args.settings = [Setting.parse(s) for s in args.settings.split(",") if s.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        ap.error(f"--arms {bad[0]!r}: expected a subset of {','.join(ARMS)}")
    if args.seeds < 1 or args.steps < 1:
        ap.error(f"--seeds {args.seeds} / --steps {args.steps}: expected >= 1")
    args.results = Path(args.results) if args.results else RESULTS / ("replay_dose_quick.json" if args.quick
                                                                          else "replay_dose.json")
    # fields the demo's loop/warm-start helpers read
    args.env, args.max_seq_len, args.temperature, args.warmup_batch, args.seed = "echo", 128, 1.0, 32, 0
    return args


# ---- the real runs -----------------------------------------------------------------------------------------
class Runner:
    """Builds one warm start per router family and one engine per (router, noise), lazily, and runs
    one (setting, arm, seed) GRPO run on them."""

    def __init__(self, args):
        import jax

        from r3jax.sharding import make_mesh

        self.args, self.mesh = args, make_mesh(data=-1)
        self.jax = jax
        self._warm, self._engine, self._engine_key, self._meshes = {}, None, None, {}

    def mesh_for(self, st: Setting):
        """The training mesh of ``st``: every minibatch holds only real rows (the prompts x samples
        trajectories split ``st.minibatches`` ways), so its batch divisor is the largest device count
        that divides a minibatch (8 devices at 2 minibatches of 8 rows, 2 at 8 of 2). Padding rows would
        make empty updates, which Adam's momentum still turns into steps."""
        import math

        from r3jax.sharding import make_mesh

        rows = self.args.prompts * self.args.samples
        if rows % st.minibatches:
            raise SystemExit(f"--settings {st.name}: {rows} trajectories per batch (--prompts x --samples) do not "
                             f"split into {st.minibatches} minibatches")
        d = math.gcd(rows // st.minibatches, len(self.jax.devices()))
        if d not in self._meshes:
            self._meshes[d] = make_mesh(data=d, devices=self.jax.devices()[:d])
        return self._meshes[d]

    def model_config(self, router: str):
        from models import MoeConfig

        a = self.args
        extra = dict(router=router, n_group=8, topk_group=4, routed_scaling_factor=2.5) \
            if router == "sigmoid_bias_grouped" else {}
        return MoeConfig.tiny(num_experts=a.experts, top_k=a.top_k, num_layers=a.moe_layers, first_dense_layers=0,
                              moe_intermediate_size=32, **extra)

    def engine(self, st: Setting):
        import jax.numpy as jnp

        from r3jax.engine import Engine

        key = (st.router, st.noise)
        if self._engine_key != key:
            if self._engine is not None:
                self._engine.close()
            model = self.warm(st.router)
            self._engine = Engine(model, max_seq_len=self.args.max_seq_len,
                                  max_batch_size=self.args.prompts * self.args.samples, dtype=jnp.bfloat16,
                                  router_noise=st.noise, decode_buckets=1)
            self._engine_key = key
        return self._engine

    def warm(self, router: str):
        if router in self._warm:
            return self._warm[router]
        from flax import nnx

        from models import MoeTransformer
        from r3jax.demo.run import warm_start
        from r3jax.engine import Engine
        import jax.numpy as jnp

        a, jax = self.args, self.jax
        model = MoeTransformer(self.model_config(router), rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)  # expert outputs scaled: narrow top-k margins, as replay_rl
        nnx.update(model, jax.tree_util.tree_map_with_path(
            lambda p, x: x * a.expert_scale if "down_proj" in jax.tree_util.keystr(p) else x, params))
        tag = "sig" if router == "sigmoid_bias_grouped" else ""
        out = Path(a.out) / f"E{a.experts}k{a.top_k}L{a.moe_layers}x{a.expert_scale:g}w{a.warmup_steps}{tag}"
        out.mkdir(parents=True, exist_ok=True)
        gen = Engine(model, max_seq_len=a.max_seq_len, max_batch_size=a.prompts * a.samples, dtype=jnp.bfloat16,
                     decode_buckets=1)
        try:
            self._warm[router], _ = warm_start(a, model, self.mesh, gen, out)
        finally:
            gen.close()
        return self._warm[router]

    def sync(self, engine, state, precision: str) -> None:
        from models.quant import quantize_fp8, quantize_int8
        from r3jax.params_io import weights_of
        from r3jax.train import push_to_engine

        params = weights_of(state)
        push_to_engine(engine, {"int8": quantize_int8, "fp8": quantize_fp8}.get(precision, lambda p: p)(params))

    def __call__(self, st: Setting, arm: str, seed: int) -> list[dict]:
        from r3jax.batch import collate
        from r3jax.demo.rollouts import make_loop
        from r3jax.demo.run import adam
        from r3jax.sharding import batch_multiple, shard_batch
        from r3jax.train import LossConfig, group_advantages, init_train_state, ppo_update

        a, jax = self.args, self.jax
        engine = self.engine(st)
        cfg = engine.config
        replay, cap = ARMS[arm]
        loss = LossConfig(tis_cap=a.tis_cap if cap else None)
        loop_args = types.SimpleNamespace(**{**vars(a), "seed": seed})
        mesh = self.mesh_for(st)
        state = init_train_state(self.warm(st.router), adam(a.lr), mesh=mesh, seed=seed)
        self.sync(engine, state, st.precision)
        records = []
        for step in range(a.steps):
            t0 = time.perf_counter()
            with make_loop(loop_args, engine, step) as loop:
                trajs = loop.run(a.prompts, a.samples)
            t1 = time.perf_counter()
            rewards = np.array([t.reward for t in trajs])
            for t, adv in zip(trajs, group_advantages(rewards, np.array([t.group for t in trajs]))):
                t.advantage = float(adv)
            batch = collate(trajs, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers,
                            batch_multiple=batch_multiple(mesh) * st.minibatches)
            if batch.tokens.shape[0] != a.prompts * a.samples:
                raise RuntimeError(f"batch rows={batch.tokens.shape[0]}: expected one per trajectory "
                                   f"({a.prompts * a.samples}, no padding row)")
            state, hist = ppo_update(state, shard_batch(batch, mesh), replay=replay, config=loss,
                                     num_minibatches=st.minibatches, epochs=st.epochs)
            hist = jax.device_get(hist)
            t2 = time.perf_counter()
            first = hist[0]  # before any update on this batch: the train-inference mismatch itself
            records.append({
                "step": step + 1, "reward": float(rewards.mean()),
                **{k: float(first[k]) for k in ("k3_kl", "mean_abs_delta", "abs_delta_p99", "abs_delta_max",
                                                "live_routing_disagreement", "entropy")},
                "importance_weight": float(np.mean([h["importance_weight"] for h in hist])),
                "clip_fraction": float(np.nanmean([h["clip_fraction"] for h in hist])),
                "grad_norm": float(np.mean([h["grad_norm"] for h in hist])),
                "rollout_s": t1 - t0, "train_s": t2 - t1})
            self.sync(engine, state, st.precision)
        return records


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.summarize:
        return resummarize(args.results)
    if args.compilation_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(Path(args.compilation_cache).resolve()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from tqdm import tqdm

    fixed = {k: getattr(args, k) for k in FIXED}  # not seeds: more seeds extend a grid
    result = copy.deepcopy(load(args.results, fixed))
    drop_superseded(result, ARM_DEFS)  # what run_grid will find stored
    todo = sum(str(s) not in result["runs"].get(f"{st.name}/{a}", {})
               for st in args.settings for s in range(args.seeds) for a in args.arms)
    command = "python -m experiments.replay_dose " + " ".join(argv if argv is not None else os.sys.argv[1:])
    runner = Runner(args)
    with tqdm(total=todo, desc="replay_dose runs", disable=args.no_progress) as bar:
        def done(cell, seed, records):
            bar.update(1)
            bar.set_postfix(cell=cell, seed=seed, reward=f"{ds.final_reward(records):.2f}")

        result = run_grid(args.results, fixed, args.settings, args.arms, args.seeds, runner,
                          command=command.strip(), on_done=done, arm_defs=ARM_DEFS)
    report(result, args.results)
    return result


if __name__ == "__main__":
    main()
