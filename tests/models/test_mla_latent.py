"""MLA's latent cache (weight absorption) decodes exactly as the expanded per-head cache: same logits
(fp32, 1e-5), tokens and route rows step by step, and both match a full-sequence forward; the
cache is the size the latent predicts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import KVCache, MoeConfig, MoeTransformer
from models.cache import cache_bytes_per_token, cache_layout
from models.fields import FieldError

# a tiny DeepSeek-V3-family model: MLA with q LoRA and interleaved RoPE, sigmoid router with groups,
# a shared expert, one dense layer first
MLA = dict(attention="mla", num_heads=4, num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=16,
           kv_lora_rank=8, v_head_dim=8, router="sigmoid_bias_grouped", n_group=4, topk_group=2,
           routed_scaling_factor=2.5, num_shared_experts=1, qk_norm=False, moe_impl="dense")
B, P, G, S = 2, 5, 6, 16


def _model(mla_cache):
    return MoeTransformer(MoeConfig.tiny(mla_cache=mla_cache, **MLA), rngs=nnx.Rngs(0))


def _greedy(model, prompt):
    """Prefill ``prompt [B, P]`` into a cache, then G greedy decode steps. Returns per step
    ``(logits [B, V], routes [B, L, K])`` of the prompt's last token and each fed token, and the tokens."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, tok, pos, cache: (lambda o: (o.logits[:, -1], o.routes[:, -1], o.cache))(
        nnx.merge(graphdef, s)(tok, pos, cache=cache)))
    cache = KVCache.init(model.config, B, S)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, routes, cache = step(state, jnp.asarray(prompt), pos, cache)
    out, fed = [(logits, routes)], []
    for g in range(G):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        fed.append(tok)
        logits, routes, cache = step(state, tok, jnp.full((B, 1), P + g, jnp.int32), cache)
        out.append((logits, routes))
    return out, np.concatenate([np.asarray(prompt)] + [np.asarray(t) for t in fed], axis=1)


def test_latent_decode_equals_expanded_decode_and_full_forward():
    latent, expanded = _model("latent"), _model("expanded")
    prompt = np.random.default_rng(0).integers(0, latent.config.vocab_size, (B, P)).astype(np.int32)
    lat, lat_tokens = _greedy(latent, prompt)
    exp, exp_tokens = _greedy(expanded, prompt)
    np.testing.assert_array_equal(lat_tokens, exp_tokens)
    for i, ((la, lr), (ea, er)) in enumerate(zip(lat, exp)):
        np.testing.assert_allclose(np.asarray(la), np.asarray(ea), atol=1e-5, rtol=0, err_msg=f"step {i}")
        np.testing.assert_array_equal(np.asarray(lr), np.asarray(er), err_msg=f"step {i}")
    # independent reference: one full-sequence forward (no cache) over the whole greedy sequence
    seq = jnp.asarray(lat_tokens)  # step i fed the token at position P - 1 + i
    pos = jnp.broadcast_to(jnp.arange(seq.shape[1], dtype=jnp.int32), seq.shape)
    graphdef, state = nnx.split(latent)
    full = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p))(state, seq, pos)
    for i, (la, lr) in enumerate(lat):
        np.testing.assert_allclose(np.asarray(la), np.asarray(full.logits[:, P - 1 + i]), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(lr), np.asarray(full.routes[:, P - 1 + i]))


def _per_token_per_layer(cfg):
    cache = jax.eval_shape(lambda: KVCache.init(cfg, 1, 1))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    return total // cfg.num_layers


def test_latent_cache_holds_the_latent_and_the_rope_key():
    cfg = MoeConfig.tiny(mla_cache="latent", **MLA)
    cache = jax.eval_shape(lambda: KVCache.init(cfg, 3, S))
    assert [x.shape for x in cache.k] == [(1, 3, S, 1, 8), (2, 3, S, 1, 8)]  # c_kv [n, B, S, 1, R]
    assert [x.shape for x in cache.v] == [(1, 3, S, 1, 4), (2, 3, S, 1, 4)]  # k_rot [n, B, S, 1, rope]
    assert _per_token_per_layer(cfg) == (8 + 4) * 4
    assert _per_token_per_layer(cfg.replace(mla_cache="expanded")) == 2 * 4 * 12 * 4
    for name, latent_numbers, expanded_numbers in [("deepseek_v3", 576, 49152), ("kimi_k2", 576, 24576)]:
        big = MoeConfig.preset(name)
        assert _per_token_per_layer(big) == latent_numbers * 2  # bf16
        assert cache_bytes_per_token(big) == big.num_layers * latent_numbers * 2
        assert cache_bytes_per_token(big.replace(mla_cache="expanded")) == big.num_layers * expanded_numbers * 2
    gqa = MoeConfig.tiny(mla_cache="latent")  # the field only concerns MLA models
    assert cache_layout(gqa).k == (gqa.num_kv_heads, gqa.head_dim)


def test_mla_cache_must_be_a_known_form():
    with pytest.raises(FieldError, match=r"MoeConfig.mla_cache='compressed': expected one of 'latent', 'expanded'"):
        MoeConfig.tiny(mla_cache="compressed", **MLA)
