"""Memory of the LM head: the train step's temporaries with chunked vs full-vocabulary logits.

    python -m experiments.bench_logits [--vocab 151936] [--tokens 2048,4096] [--quick]

Train step: the real ``r3jax.train`` step (value_and_grad of the policy loss, sgd update) of a
2-layer model with a realistic vocabulary on a small hidden size, compiled (not run) at B = 1 and S
tokens; ``memory_analysis().temp_size_in_bytes`` with ``LossConfig.logits_chunk`` = 0 (one [S, V]
computation) and = 512, and their ratio; ``base``: the same step at a 1024-token vocabulary (what
attention, whose [S, S] scores XLA:CPU materialises, and the MoE hold), so ``*_head`` = temp - base
is the LM head's and the loss's share. Writes experiments/results/bench_logits.json.
"""

from __future__ import annotations

import argparse

import numpy as np
import optax
from flax import nnx

from experiments.common import table, write_json
from models import MoeConfig, MoeTransformer
from r3jax import train
from r3jax.batch import Batch

WIDTHS = dict(hidden_size=64, num_layers=2, first_dense_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
              num_experts=8, top_k=2, moe_intermediate_size=32, dense_intermediate_size=64)
CHUNK = 512
BASE_VOCAB = 1024


def _batch(cfg: MoeConfig, s: int) -> Batch:
    rng = np.random.default_rng(0)
    mask = np.ones((1, s), np.float32)
    mask[:, 0] = 0.0
    return Batch(tokens=rng.integers(0, cfg.vocab_size, (1, s)).astype(np.int32),
                 positions=np.arange(s, dtype=np.int32)[None], segment_ids=np.ones((1, s), np.int32),
                 attention_mask=np.ones((1, s), bool), loss_mask=mask,
                 advantages=rng.normal(size=(1, s)).astype(np.float32),
                 rollout_logprobs=np.full((1, s), -1.0, np.float32),
                 routes=np.zeros((1, s, cfg.num_moe_layers, cfg.top_k), np.uint8), route_mask=np.zeros((1, s), bool))


def train_temp(vocab: int, s: int) -> dict:
    cfg = MoeConfig.tiny(vocab_size=vocab, **WIDTHS)
    state = train.init_train_state(MoeTransformer(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    batch = _batch(cfg, s)
    temp = {}
    for chunk in (0, CHUNK):
        fn = train.make_train_step(state, replay="none", config=train.LossConfig(aux_coef=0.0, logits_chunk=chunk))
        temp[chunk] = fn.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    # the same step at a 1024-token vocabulary: what the rest of the step (attention scores, MoE) holds
    small = MoeConfig.tiny(vocab_size=BASE_VOCAB, **WIDTHS)
    small_state = train.init_train_state(MoeTransformer(small, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    fn = train.make_train_step(small_state, replay="none", config=train.LossConfig(aux_coef=0.0, logits_chunk=0))
    base = fn.lower(small_state, _batch(small, s)).compile().memory_analysis().temp_size_in_bytes
    mib = lambda x: x / 2**20
    return {"vocab": vocab, "tokens": s, "hidden": cfg.hidden_size, "chunk": CHUNK,
            "logits_f32_mib": mib(4 * s * vocab), "full_temp_mib": mib(temp[0]),
            "chunked_temp_mib": mib(temp[CHUNK]), "chunked_over_full": temp[CHUNK] / temp[0],
            "base_temp_mib": mib(base), "full_head_mib": mib(temp[0] - base),
            "chunked_head_mib": mib(temp[CHUNK] - base),
            "head_chunked_over_full": (temp[CHUNK] - base) / (temp[0] - base)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--quick", action="store_true", help="vocab 32768 and 1024 tokens")
    args = ap.parse_args()
    vocab = 32768 if args.quick else args.vocab
    tokens = [1024] if args.quick else [int(t) for t in args.tokens.split(",")]
    rows = []
    for s in tokens:
        rows.append(train_temp(vocab, s))
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    print(table(rows, ["vocab", "tokens", "hidden", "chunk", "logits_f32_mib", "full_temp_mib", "chunked_temp_mib",
                       "chunked_over_full", "base_temp_mib", "full_head_mib", "chunked_head_mib",
                       "head_chunked_over_full"]))
    print("wrote", write_json("bench_logits", {"train": rows, "widths": WIDTHS,
                                               "note": "compiled on XLA:CPU (not run); temp bytes per program"}))


if __name__ == "__main__":
    main()
