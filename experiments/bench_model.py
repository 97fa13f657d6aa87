"""Forward throughput of the MoE transformer: tiny vs ~100M, dense vs ragged experts, live vs replay.

    python -m experiments.bench_model [--quick]

Replay overhead is time(replay) ÷ time(live) for the same batch,
from the same run (target <= 1.05).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.common import block, table, timeit, write_json
from models import MoeConfig, MoeTransformer, Replay


def bench(cfg: MoeConfig, batch: int, seq: int, repeats: int) -> list[dict]:
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    @jax.jit
    def fwd(state, tokens, positions, replay):
        out = nnx.merge(graphdef, state)(tokens, positions, replay)
        return out.logits, out.routes

    @jax.jit
    def fwd_live(state, tokens, positions):
        out = nnx.merge(graphdef, state)(tokens, positions)
        return out.logits, out.routes

    _, routes = block(fwd_live(state, tokens, positions))
    replay = Replay(routes.astype(jnp.uint8), jnp.ones((batch, seq), bool))
    t_live = timeit(lambda: block(fwd_live(state, tokens, positions)), repeats=repeats)
    t_rep = timeit(lambda: block(fwd(state, tokens, positions, replay)), repeats=repeats)
    n = batch * seq
    return [{"config": cfg_name(cfg), "moe_impl": cfg.moe_impl, "B": batch, "T": seq,
             "live_tok_s": n / t_live, "replay_tok_s": n / t_rep, "replay_overhead": t_rep / t_live}]


def cfg_name(cfg):
    return "tiny" if cfg.hidden_size == MoeConfig.tiny().hidden_size else "small_100m"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    rows = []
    cases = [(MoeConfig.tiny(), 8, 128), (MoeConfig.small_100m(), 2 if args.quick else 4, 128 if args.quick else 256)]
    for cfg, b, t in cases:
        for impl in ("dense", "ragged"):
            rows += bench(cfg.replace(moe_impl=impl), b, t, repeats)
            print(rows[-1], flush=True)
    cols = ["config", "moe_impl", "B", "T", "live_tok_s", "replay_tok_s", "replay_overhead"]
    print(table(rows, cols))
    print("wrote", write_json("bench_model", {"rows": rows, "quick": args.quick}))


if __name__ == "__main__":
    main()
