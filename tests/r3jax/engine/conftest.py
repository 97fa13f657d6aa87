"""Shared fixtures: one tiny model per session and a full-sequence reference forward over it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer

REF_ROWS, REF_LEN = 4, 64  # the reference forward always runs at this shape: one compilation


@pytest.fixture(scope="session")
def tiny_model():
    return MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def reference(tiny_model):
    """``reference(seqs) -> [(logits [n, V] f32, live_routes [n, L, K] int32)]``: a full-sequence
    forward (no cache) of each token list, right-padded (causal attention: padding after a token
    cannot change it)."""
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
