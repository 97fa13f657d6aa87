"""The "gather" expert kernel (each chosen expert on only its tokens; the engine's default on CPU)
equals the dense reference for decode-sized and prefill-sized token counts, and the engine picks it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import experts_dense, experts_gather


@pytest.mark.parametrize("n, e, k", [(1, 8, 2), (5, 8, 2), (32, 16, 4), (64, 8, 8)])
def test_gather_kernel_equals_dense(n, e, k):
    rng = np.random.default_rng(n)
    d, i = 16, 24
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    rows = [rng.permutation(e)[:k] for _ in range(n)]
    if n == 32:  # expert 3 chosen by every token: the largest capacity branch
        rows = [np.concatenate([[3], rng.permutation(np.delete(np.arange(e), 3))[:k - 1]]) for _ in range(n)]
    ids = jnp.asarray(np.stack(rows), jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(e, d, i)) * 0.2, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, i, d)) * 0.2, jnp.float32)
    want = experts_dense(x, ids, w, gate, up, down)
    got = jax.jit(experts_gather)(x, ids, w, gate, up, down)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_engine_picks_the_gather_kernel_on_cpu(tiny_model, make_engine):
    assert jax.default_backend() == "cpu"
    assert make_engine(tiny_model, moe_impl=None).config.moe_impl == "gather"
    assert tiny_model.config.moe_impl == "ragged"  # the model itself is untouched
