"""Random, well-formed training data for benchmarks and tests: a padded `Batch` with replay rows, and
collated trajectories written as a batch file (what `python -m r3jax train --batch-file` reads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models import MoeConfig
from r3jax.batch import Batch, collate
from r3jax.train.batch_file import write_rows


def random_routes(rng: np.random.Generator, shape: tuple[int, ...], cfg: MoeConfig) -> np.ndarray:
    """`shape + [L, K]` distinct expert ids per (token, layer), uniformly drawn."""
    scores = rng.random(shape + (cfg.num_moe_layers, cfg.num_experts))
    return np.argsort(scores, -1)[..., :cfg.top_k]


def synthetic_batch(cfg: MoeConfig, b: int, s: int, seed: int = 0) -> Batch:
    """A [b, s] batch: random tokens, the last quarter of each row padding, replay rows on ~70%."""
    rng = np.random.default_rng(seed)
    seg = np.ones((b, s), np.int32)
    seg[:, -s // 4:] = 0
    lm = (seg > 0).astype(np.float32)
    lm[:, 0] = 0
    routes = random_routes(rng, (b, s), cfg)
    return Batch(tokens=rng.integers(1, cfg.vocab_size, (b, s)).astype(np.int32),
                 positions=np.tile(np.arange(s, dtype=np.int32), (b, 1)), segment_ids=seg,
                 attention_mask=seg > 0, loss_mask=lm,
                 advantages=(rng.normal(size=(b, s)) * lm).astype(np.float32),
                 rollout_logprobs=(-rng.random((b, s)) * lm).astype(np.float32),
                 routes=routes.astype(np.uint8), route_mask=rng.random((b, s)) < 0.7)


def synthetic_rows(cfg: MoeConfig, path: Path, rows: int, seq_len: int = 32, seed: int = 0) -> Path:
    """`rows` trajectories of 12..seq_len tokens (routes on every token but the last), collated to
    `seq_len` and written to `path` by `write_rows`; returns what `write_rows` returns."""
    rng = np.random.default_rng(seed)
    trajs = []
    for _ in range(rows):
        n = int(rng.integers(12, seq_len + 1))
        trajs.append(dict(tokens=rng.integers(1, cfg.vocab_size, n), loss_mask=np.r_[0.0, np.ones(n - 1)],
                          rollout_logprobs=-rng.random(n), advantage=float(rng.normal()),
                          routes=random_routes(rng, (n,), cfg), captured=np.arange(n) < n - 1))
    return write_rows(path, collate(trajs, seq_len=seq_len, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                    num_layers=cfg.num_moe_layers))
