"""Shared, session-scoped inputs for the trainer tests: the tiny model, real rollouts from the tiny
engine collated into one Batch, and one optimizer object (the compiled step is cached per optimizer,
so every test that shares it shares one compilation)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import models
from r3jax.batch import collate
from r3jax.engine import Engine, GenerateRequest
from r3jax.trace import RoutedExpertTrace
from r3jax.train import LossConfig

TX = optax.sgd(0.1, momentum=0.9)  # linear first step (update = -lr * grad); has optimizer state
# aux off: router gradients must come from the policy loss alone; logits in chunks of 12 positions
# (S = 32: uneven), so every step here runs the chunked loss (r3jax/train/logits.py)
TRAIN_CFG = LossConfig(aux_coef=0.0, logits_chunk=12)
SEQ_LEN = 32
PROMPT_LENS = (4, 5, 6, 7)
MAX_TOKENS = 8
ADVANTAGES = (1.0, -1.0, 0.5, -0.5)


def rollout_trajectories(engine, cfg, *, seed=0, request_seed=None, temperature=1.0, **sampling):
    """Sampled single-turn rollouts from ``engine`` as collate-ready dicts (routes via the trace).
    ``seed`` draws the prompts; request i samples with ``request_seed + i`` (default ``seed + i``);
    ``sampling``: further GenerateRequest fields (top_k, top_p, logprobs_mode)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, cfg.vocab_size, p).tolist() for p in PROMPT_LENS]
    first = seed if request_seed is None else request_seed
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, temperature=temperature, seed=first + i,
                            return_routed_experts=True, **sampling) for i, p in enumerate(prompts)]
    trajs = []
    for prompt, out, adv in zip(prompts, engine.generate(reqs), ADVANTAGES):
        p, g = len(prompt), len(out.output_ids)
        loss_mask = np.array([0.0] * p + [1.0] * g, np.float32)
        trace = RoutedExpertTrace().record(prompt_len=p, generated_len=g, routes=out.routed_experts)
        routes, captured = trace.finalize(token_count=p + g, loss_mask=loss_mask)
        trajs.append(dict(tokens=np.array(prompt + list(out.output_ids), np.int32), loss_mask=loss_mask,
                          rollout_logprobs=np.array([0.0] * p + list(out.logprobs), np.float32),
                          advantage=adv, routes=routes, captured=captured,
                          weight_version=out.weight_version))
    return trajs


def collate_tiny(trajs, cfg):
    return collate(trajs, seq_len=SEQ_LEN, num_experts=cfg.num_experts, top_k=cfg.top_k,
                   num_layers=cfg.num_moe_layers)


@pytest.fixture(scope="session")
def sample_rollouts():
    """:func:`rollout_trajectories`, for test modules (conftest helpers are not importable)."""
    return rollout_trajectories


@pytest.fixture(scope="session")
def tx():
    return TX


@pytest.fixture(scope="session")
def train_cfg():
    return TRAIN_CFG


@pytest.fixture(scope="session")
def tiny():
    cfg = models.MoeConfig.tiny()
    return cfg, models.MoeTransformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def engine(tiny):
    cfg, model = tiny
    return Engine(model, max_seq_len=64, max_batch_size=4, decode_buckets=1, prefill_rows=1)


@pytest.fixture(scope="session")
def make_rollout_batch(tiny):
    """``fn(engine, seed) -> (Batch, weight_versions)``: same shapes as ``rollout_batch``."""
    cfg, _ = tiny

    def make(engine, seed):
        trajs = rollout_trajectories(engine, cfg, seed=seed)
        return collate_tiny(trajs, cfg), [t["weight_version"] for t in trajs]
    return make


@pytest.fixture(scope="session")
def rollout_trajs(tiny, engine):
    """Four sampled fp32 engine rollouts of the tiny model (collate-ready dicts)."""
    cfg, _ = tiny
    return rollout_trajectories(engine, cfg)


@pytest.fixture(scope="session")
def rollout_batch(tiny, rollout_trajs):
    """The rollouts as a padded [4, 32] Batch (uint8 routes, terminal gap uncaptured)."""
    cfg, _ = tiny
    return collate_tiny(rollout_trajs, cfg)


@pytest.fixture(scope="session")
def rollout_batch8(tiny, engine, rollout_batch, make_rollout_batch):
    """Eight rollouts as a [8, 32] Batch: ``rollout_batch`` and a second draw (seed 1). The batch
    is split over every device of an 8-device mesh, so multi-device steps need B % 8 == 0."""
    other, _ = make_rollout_batch(engine, 1)
    return jax.tree.map(lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)]), rollout_batch, other)
