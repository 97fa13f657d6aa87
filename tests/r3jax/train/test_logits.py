"""Chunked target statistics (r3jax/train/logits.py) against the full-vocabulary computation:
values and gradients (hidden states and head weights), uneven chunks, the processed (temperature,
top-k, top-p) distribution; the train step's loss, metrics and gradients with and without
chunking; and the compiled chunked loss holding no [S, V]-sized f32 buffer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax import metrics as mm
from r3jax.batch import Batch
from r3jax.train import LossConfig, forward_metrics, init_train_state, token_logprobs
from r3jax.train.logits import forward_stats, target_stats

B, S, D, V = 2, 37, 8, 50  # S is no multiple of the chunks used


def _data(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = jax.random.normal(k[0], (B, S, D), jnp.float32)
    w = jax.random.normal(k[1], (D, V), jnp.float32)
    tokens = jax.random.randint(k[2], (B, S), 0, V)
    mask = (jax.random.uniform(k[3], (B, S)) > 0.3).astype(jnp.float32).at[:, 0].set(0.0)
    return hidden, w, tokens, mask


def _reference(hidden, w, tokens, temperature=1.0, top_k=0, top_p=1.0):
    """The full [B, S, V] path: loss.token_logprobs, metrics.target_entropy's per-position term, argmax."""
    logits = hidden @ w
    lp = token_logprobs(logits, tokens, temperature, top_k, top_p)
    logp = jax.nn.log_softmax(logits, -1)
    ent = jnp.pad(-jnp.sum(jnp.exp(logp) * logp, -1)[:, :-1], ((0, 0), (1, 0)))
    am = jnp.pad(jnp.argmax(logits, -1)[:, :-1], ((0, 0), (1, 0)))
    return lp, ent, am


def _objective(stats_fn, mask):
    """A scalar mixing masked logprobs and entropy, so both gradients are checked at once."""
    def f(hidden, w):
        lp, ent, _ = stats_fn(hidden, w)
        return jnp.sum(jnp.where(mask > 0, 1.3 * lp - 0.7 * ent, 0.0)), (lp, ent)
    return f


@pytest.mark.parametrize("chunk", [5, 0])
@pytest.mark.parametrize("process", [(1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["raw", "processed"])
def test_chunked_stats_and_gradients_equal_the_full_computation(chunk, process):
    hidden, w, tokens, mask = _data()
    t, k, p = process

    def chunked(h, w_):
        ts = target_stats(lambda x: x @ w_, h, tokens, chunk=chunk, temperature=t, top_k=k, top_p=p)
        return ts.logprobs, ts.entropy, ts.argmax

    ref = lambda h, w_: _reference(h, w_, tokens, t, k, p)
    got = jax.jit(chunked)(hidden, w)
    want = jax.jit(ref)(hidden, w)
    for name, g, r in zip(("logprobs", "entropy"), got[:2], want[:2]):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=name)
        assert np.all(np.asarray(g)[:, 0] == 0.0)  # nothing predicts the first token
    np.testing.assert_array_equal(got[2], want[2])
    grad = lambda fn: jax.jit(jax.grad(_objective(fn, mask), argnums=(0, 1), has_aux=True))(hidden, w)[0]
    (gh, gw), (rh, rw) = grad(chunked), grad(ref)
    assert float(jnp.max(jnp.abs(rh))) > 1e-3 and float(jnp.max(jnp.abs(rw))) > 1e-3  # not vacuous
    np.testing.assert_allclose(gh, rh, atol=1e-5, rtol=0)
    np.testing.assert_allclose(gw, rw, atol=1e-5, rtol=0)
    # masked targets get no gradient: hidden at a position predicting a masked token stays 0
    pred = np.asarray(mm.predicting_mask(mask))
    assert np.all(np.asarray(gh)[~pred] == 0.0)


def test_logits_chunk_is_validated():
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(ValueError, match=r"LossConfig.logits_chunk="):
            LossConfig(logits_chunk=bad)
    for ok in (None, 0, 1, 512):
        LossConfig(logits_chunk=ok)
    with pytest.raises(ValueError, match=r"logits_chunk=-2: expected None or an int >= 0"):
        target_stats(lambda x: x, jnp.zeros((1, 4, 3)), jnp.zeros((1, 4), jnp.int32), chunk=-2)


def _f32_sizes(hlo: str) -> list[int]:
    return [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"f32\[([\d,]*)\]", hlo)]


def test_compiled_chunked_loss_holds_no_sequence_by_vocab_buffer():
    s, v, d = 96, 1000, 16
    hidden = jax.ShapeDtypeStruct((1, s, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    tokens = jnp.zeros((1, s), jnp.int32)

    def hlo(chunk):
        def loss(h, w_):
            ts = target_stats(lambda x: x @ w_, h, tokens, chunk=chunk)
            return jnp.sum(ts.logprobs) + jnp.sum(jax.lax.stop_gradient(ts.entropy))
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, w).compile().as_text()

    assert max(_f32_sizes(hlo(0))) >= s * v  # the control: the unchunked program holds [S, V]
    assert max(_f32_sizes(hlo(32))) < s * v
    assert max(_f32_sizes(hlo(32))) >= 32 * v  # one chunk's logits are there


@pytest.fixture(scope="module")
def tiny_state():
    # tied: the embedding gets both gradients; one dense + one MoE layer keeps compiling cheap
    cfg = MoeConfig.tiny(vocab_size=64, tie_embeddings=True, num_layers=2)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(3))
    return cfg, init_train_state(model, optax.sgd(0.1))


def _batch(cfg, b=2, s=24, seed=1):
    rng = np.random.default_rng(seed)
    loss_mask = (rng.random((b, s)) > 0.3).astype(np.float32)
    loss_mask[:, 0] = 0.0
    return Batch(tokens=rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32),
                 positions=np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
                 segment_ids=np.ones((b, s), np.int32), attention_mask=np.ones((b, s), bool),
                 loss_mask=loss_mask, advantages=rng.normal(size=(b, s)).astype(np.float32),
                 rollout_logprobs=-rng.random((b, s)).astype(np.float32) * 3,
                 routes=np.zeros((b, s, cfg.num_moe_layers, cfg.top_k), np.uint8),
                 route_mask=np.zeros((b, s), bool))


def test_train_step_loss_metrics_and_grads_do_not_depend_on_the_chunk(tiny_state):
    cfg, state = tiny_state
    batch = _batch(cfg)

    def run(chunk):
        config = LossConfig(aux_coef=0.01, kl_coef=0.1, temperature=0.8, logits_chunk=chunk)
        ref = jnp.asarray(batch.rollout_logprobs) - 0.1
        fn = jax.jit(jax.value_and_grad(forward_metrics, has_aux=True), static_argnums=(3, 4))
        (loss, metrics), grads = fn(state.params, state, batch, "none", config, ref)
        metrics.pop("_expert_load")
        return jax.device_get((loss, metrics, grads))

    (l0, m0, g0), (l5, m5, g5) = run(0), run(7)  # 7: uneven chunks of S = 24
    np.testing.assert_allclose(l5, l0, atol=1e-5, rtol=0)
    for k in m0:
        np.testing.assert_allclose(m5[k], m0[k], atol=1e-5, rtol=0, err_msg=k)
    flat0, flat5 = jax.tree.leaves(g0), jax.tree.leaves(g5)
    assert sum(float(np.abs(x).sum()) for x in flat0) > 0.0
    for a, b in zip(flat5, flat0):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # entropy: the old full-logits metric at the predicting positions
    logits = jax.jit(lambda st, t, p: st.model()(t, p).logits)(state, batch.tokens, batch.positions)
    want = mm.target_entropy(logits, batch.loss_mask)
    np.testing.assert_allclose(m5["entropy"], want, atol=1e-5, rtol=0)


def test_model_hidden_and_head_give_the_default_logits(tiny_state):
    cfg, state = tiny_state
    batch = _batch(cfg, s=9)

    @jax.jit
    def run(state, tokens, positions):
        model = state.model()
        full = model(tokens, positions)
        hid = model(tokens, positions, return_hidden=True)
        plain = lambda *a, **kw: full  # a model without a logits method: its full logits are used
        return (full, hid, model.logits(hid.hidden), forward_stats(plain, tokens, positions, chunk=4)[1],
                forward_stats(model, tokens, positions, chunk=4)[1])

    full, hid, head, ts_plain, ts_model = run(state, batch.tokens, batch.positions)
    assert hid.logits is None and hid.hidden.shape == (2, 9, cfg.hidden_size)
    np.testing.assert_array_equal(head, full.logits)
    np.testing.assert_array_equal(hid.routes, full.routes)
    want = token_logprobs(full.logits, jnp.asarray(batch.tokens))
    np.testing.assert_allclose(ts_plain.logprobs, want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(ts_model.logprobs, want, atol=1e-6, rtol=0)


def test_sft_loss_equals_the_full_logits_formula(tiny_state):
    from r3jax.train.sft import sft_loss

    cfg, state = tiny_state
    batch = _batch(cfg, s=600)  # > the default chunk of 512: two uneven chunks

    @jax.jit
    def run(state, batch):
        logits = state.model()(batch.tokens, batch.positions, segment_ids=batch.segment_ids).logits
        mask = batch.loss_mask > 0
        nll = -mm.masked_mean(token_logprobs(logits, batch.tokens), mask)
        hit = jnp.pad(jnp.argmax(logits[:, :-1], -1) == batch.tokens[:, 1:], ((0, 0), (1, 0)))
        return sft_loss(state.params, state, batch)[1], nll, mm.masked_mean(hit.astype(jnp.float32), mask)

    got, nll, acc = run(state, batch)
    np.testing.assert_allclose(got["nll"], nll, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got["accuracy"], acc, atol=1e-6, rtol=0)
