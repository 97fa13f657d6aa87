"""A stream of varied requests compiles a small, bounded set of programs, and once those exist no
further request compiles anything."""

import logging

import jax
import numpy as np
import pytest

from models import MoeConfig
from r3jax.engine import Engine, GenerateRequest

MAX_SEQ, MAX_BATCH, CHUNK = 64, 4, 32
V = MoeConfig.tiny().vocab_size


def _stream(seed, n=50):
    """n requests of every kind, in generate() calls of 1, 3, 4 or 5 requests."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(n):
        p = int(rng.integers(1, 41))
        reqs.append(GenerateRequest(
            prompt_ids=rng.integers(0, V, p).tolist(),
            max_tokens=int(rng.integers(1, min(13, MAX_SEQ - p + 1))),
            temperature=float(rng.choice([0.0, 0.6, 1.0])), top_k=int(rng.choice([0, 3])),
            top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(0, 2**40)),
            stop_token_ids=rng.integers(0, V, int(rng.integers(0, 4))).tolist(),
            return_logprobs=bool(rng.random() < 0.8), return_routed_experts=bool(rng.random() < 0.8),
            routed_experts_prompt_start=int(rng.integers(0, p + 1))))
    calls, i = [], 0
    while i < n:
        k = int(rng.choice([1, 3, 4, 5]))
        calls.append(reqs[i:i + k])
        i += k
    return calls


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.compiled = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of"):
            self.compiled.append(msg)


def _run_logged(engine, calls) -> list[str]:
    """Run the calls; return the XLA compilations logged meanwhile."""
    log = _CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(log)
    try:
        with jax.log_compiles(True):
            for call in calls:
                outs = engine.generate(call)
                for req, out in zip(call, outs):
                    g, p, s = len(out.output_ids), len(req.prompt_ids), req.routed_experts_prompt_start
                    assert 1 <= g <= req.max_tokens
                    assert (out.finish_reason == "stop") == (out.output_ids[-1] in req.stop_token_ids)
                    if req.return_routed_experts:
                        assert out.routed_experts.shape == (p - s + g - 1, 2, 2)
    finally:
        logger.removeHandler(log)
    return log.compiled


def test_program_count_is_bounded_and_stable_over_varied_requests(tiny_model):
    engine = Engine(tiny_model, max_seq_len=MAX_SEQ, max_batch_size=MAX_BATCH, prefill_chunk=CHUNK)
    # calls of 1, 3, 4, 5 requests -> batch buckets {1, 4}; prefill chunks {16, 32}; cache length 64;
    # route read-outs of {16, 32, 64} rows. Per batch bucket: buffers, prefix load, prefix store,
    # decode, 2 prefill, 3 read-outs; plus one prefix pool.
    bound = 2 * (4 + 2 + 3) + 1
    compiled = _run_logged(engine, _stream(0))
    first = engine.stats["compiled_programs"]
    # jit programs are shared between engines over equal graphs, so an earlier test may have compiled
    # some: the engine's count is never below what XLA compiled for it
    assert 0 < first <= bound and len(compiled) <= first

    compiled = _run_logged(engine, _stream(1))  # 50 new requests
    second = engine.stats["compiled_programs"]
    assert second <= bound and len(compiled) <= second - first

    # the first 50 again: now their prompts hit the prefix cache (new: prefix loads, shorter chunks)
    compiled = _run_logged(engine, _stream(0))
    third = engine.stats["compiled_programs"]
    assert third <= bound and len(compiled) <= third - second
    print(f"\ncompiled programs after 50 / 100 / 150 varied requests: {first} / {second} / {third} "
          f"(bound {bound})")
    # and once more, with the very same cache hits: not a single compilation
    assert _run_logged(engine, _stream(0)) == []
    assert engine.stats["compiled_programs"] == third and engine.stats["requests"] == 200
