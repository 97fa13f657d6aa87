"""Shared fixtures: one tiny model per session, the engine configuration every test shares (so its
programs compile once per session), one warmed engine, and a full-sequence reference forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine

REF_ROWS, REF_LEN = 4, 64  # the reference forward always runs at this shape: one compilation
# one engine configuration for the whole directory: equal configurations share compiled programs
# 24 pages of 8 tokens: three requests of max_seq_len at once, so a full engine runs out of pages
# before it runs out of slots and cached prefixes are evicted under pressure in ordinary tests
ENGINE_KW = dict(max_seq_len=64, max_batch_size=4, block_size=8, prefill_chunk=32, prefill_rows=2, num_pages=25,
                 decode_buckets=1, moe_impl="dense")  # one decode bucket: 3 programs (decode_buckets: test_compilation.py)  # dense: the cheapest kernel to compile (gather: test_kernels.py)


@pytest.fixture(scope="session")
def tiny_model():
    return MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def make_engine():
    """``make_engine(model, **overrides) -> Engine`` with the shared configuration; closed at the end."""
    made = []

    def make(model, **kw):
        engine = Engine(model, **{**ENGINE_KW, **kw})
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(scope="session")
def engine(tiny_model, make_engine):
    """The shared, warmed engine. Tests that change its weights restore them."""
    eng = make_engine(tiny_model)
    eng.warmup()
    return eng


@pytest.fixture(scope="session")
def reference(tiny_model):
    """``reference(seqs) -> [(logits [n, V] f32, live_routes [n, L, K] int32)]``: a full-sequence
    forward (no cache) of each token list, right-padded (causal attention: padding after a token
    cannot change it). Teacher-forced on prompt + output[:-1], its argmax at positions P-1.. is the
    greedy decode of the old static engine, and its routes are the rows that engine returned."""
    graphdef, state = nnx.split(tiny_model)

    @jax.jit
    def fwd(state, tokens):
        positions = jnp.broadcast_to(jnp.arange(REF_LEN, dtype=jnp.int32), tokens.shape)
        out = nnx.merge(graphdef, state)(tokens, positions)
        return out.logits, out.live_routes

    def run(seqs):
        results = []
        for lo in range(0, len(seqs), REF_ROWS):
            group = seqs[lo:lo + REF_ROWS]
            tokens = np.zeros((REF_ROWS, REF_LEN), np.int32)
            for r, seq in enumerate(group):
                tokens[r, :len(seq)] = seq
            logits, routes = jax.device_get(fwd(state, tokens))
            results += [(logits[r, :len(seq)], routes[r, :len(seq)]) for r, seq in enumerate(group)]
        return results

    return run
