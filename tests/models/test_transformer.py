"""Behaviour of the MoE transformer: shapes, replay semantics, kernels, cache, validation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import KVCache, MoeConfig, MoeTransformer, Replay, stacking, validate_replay

B, T = 2, 12


def _fwd(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, positions, replay=None, segment_ids=None, token_mask=None):
        return nnx.merge(graphdef, state)(tokens, positions, replay, segment_ids=segment_ids,
                                          token_mask=token_mask)

    return lambda *a, **k: fwd(state, *a, **k)


@pytest.fixture(scope="module")
def setup():
    cfg = MoeConfig.tiny()
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    fwd = _fwd(model)
    return cfg, model, fwd, tokens, positions, fwd(tokens, positions)


def test_shapes_and_dtypes(setup):
    cfg, model, _, _, _, out = setup
    L, K = cfg.num_moe_layers, cfg.top_k
    assert model.moe_layer_ids == cfg.moe_layer_ids == (1, 2)
    assert out.logits.shape == (B, T, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.routes.shape == out.live_routes.shape == (B, T, L, K)
    assert out.routes.dtype == out.live_routes.dtype == jnp.int32
    assert out.aux_loss.shape == () and out.aux_loss.dtype == jnp.float32
    routes = np.asarray(out.routes)
    assert routes.min() >= 0 and routes.max() < cfg.num_experts
    assert (np.sort(routes, -1)[..., 1:] != np.sort(routes, -1)[..., :-1]).all()  # distinct per row
    np.testing.assert_array_equal(out.routes, out.live_routes)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.int16])
def test_replay_own_routes_is_bit_identical(setup, dtype):
    _, _, fwd, tokens, positions, out = setup
    rep = fwd(tokens, positions, Replay(out.routes.astype(dtype), jnp.ones((B, T), bool)))
    np.testing.assert_array_equal(rep.logits, out.logits)
    np.testing.assert_array_equal(rep.routes, out.routes)
    np.testing.assert_array_equal(rep.aux_loss, out.aux_loss)


def _other_routes(routes, num_experts):
    """Distinct ids that differ from the live ones in every (token, layer): shift by K mod E."""
    k = routes.shape[-1]
    return (np.asarray(routes) + k) % num_experts


def test_replay_of_different_routes_uses_exactly_them(setup):
    cfg, _, fwd, tokens, positions, out = setup
    forced = _other_routes(out.routes, cfg.num_experts).astype(np.uint8)
    rep = fwd(tokens, positions, Replay(jnp.asarray(forced), jnp.ones((B, T), bool)))
    np.testing.assert_array_equal(rep.routes, forced)
    # the router's own choice is still reported, and unchanged at the first MoE layer's inputs
    np.testing.assert_array_equal(rep.live_routes[:, :, 0], out.live_routes[:, :, 0])
    assert not np.allclose(rep.logits, out.logits, atol=1e-4)


def test_mask_false_rows_route_live(setup):
    cfg, _, fwd, tokens, positions, out = setup
    forced = _other_routes(out.routes, cfg.num_experts)
    mask = np.zeros((B, T), bool)
    mask[:, ::2] = True  # replay even positions only
    rep = fwd(tokens, positions, Replay(jnp.asarray(forced), jnp.asarray(mask)))
    routes, live = np.asarray(rep.routes), np.asarray(rep.live_routes)
    np.testing.assert_array_equal(routes[mask], forced[mask])
    np.testing.assert_array_equal(routes[~mask], live[~mask])
    # an all-False mask is exactly the live forward, whatever the (ignored) route contents
    garbage = np.zeros_like(forced)
    rep0 = fwd(tokens, positions, Replay(jnp.asarray(garbage), jnp.zeros((B, T), bool)))
    np.testing.assert_array_equal(rep0.logits, out.logits)


def test_router_gradient_under_replay(setup):
    cfg, model, _, tokens, positions, out = setup
    graphdef, state = nnx.split(model)
    forced = jnp.asarray(_other_routes(out.routes, cfg.num_experts))
    replay = Replay(forced, jnp.ones((B, T), bool))

    @jax.jit
    def loss(state):
        o = nnx.merge(graphdef, state)(tokens, positions, replay)
        return jnp.mean(jax.nn.log_softmax(o.logits)[..., 0])

    grads = jax.grad(loss)(state)
    for layer_id in cfg.moe_layer_ids:
        g = stacking.layer(grads, cfg, layer_id)["mlp"]["router"][...]
        assert float(jnp.abs(g).max()) > 0.0, f"router of layer {layer_id} got no gradient"


@pytest.mark.parametrize("impl", ["dense", "loop"])
def test_dense_and_ragged_kernels_agree(setup, impl):
    cfg, model, _, tokens, positions, out = setup
    dense = MoeTransformer(cfg.replace(moe_impl=impl), rngs=nnx.Rngs(0))
    out_d = _fwd(dense)(tokens, positions)
    np.testing.assert_array_equal(out_d.routes, out.routes)
    np.testing.assert_allclose(out_d.logits, out.logits, atol=1e-5, rtol=0)
    forced = jnp.asarray(_other_routes(out.routes, cfg.num_experts))
    rep = Replay(forced, jnp.ones((B, T), bool))
    np.testing.assert_allclose(_fwd(dense)(tokens, positions, rep).logits,
                               _fwd(model)(tokens, positions, rep).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["ragged", "dense", "loop", "gather"])
def test_padding_marked_not_real_gets_no_expert_work(impl):
    """MoeBlock(real=...): a token marked not real (a paged step's padding) gets 0 from its routed
    experts, the others exactly what they get without the mask, and every token keeps its routes."""
    from models.moe import MoeBlock

    cfg = MoeConfig.tiny(moe_impl=impl)
    block = MoeBlock(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (1, 10, cfg.hidden_size), jnp.float32)
    real = jnp.asarray([[True] * 6 + [False] * 4])
    y0, ids0, live0, _, _ = block(x)
    y, ids, live, _, _ = block(x, real=real)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_array_equal(live, live0)
    np.testing.assert_allclose(y[0, :6], y0[0, :6], atol=1e-6, rtol=0)
    assert float(jnp.abs(y0[0, 6:]).min()) > 0 and not np.asarray(y[0, 6:]).any()


def test_aux_loss_ignores_masked_positions(setup):
    cfg, _, fwd, tokens, positions, _ = setup
    token_mask = np.ones((B, T), bool)
    token_mask[:, 8:] = False  # right padding
    other = np.asarray(tokens).copy()
    other[:, 8:] = (other[:, 8:] + 7) % cfg.vocab_size
    a = fwd(tokens, positions, token_mask=jnp.asarray(token_mask))
    b = fwd(jnp.asarray(other), positions, token_mask=jnp.asarray(token_mask))
    np.testing.assert_allclose(a.aux_loss, b.aux_loss, rtol=1e-6)
    full = fwd(jnp.asarray(other), positions)
    assert abs(float(full.aux_loss) - float(b.aux_loss)) > 1e-7


def test_segments_do_not_attend_to_each_other(setup):
    _, _, fwd, tokens, positions, out = setup
    # pack row 0's first 5 tokens and row 1's first 7 tokens into one row with restarting positions
    packed = jnp.concatenate([tokens[0, :5], tokens[1, :7]])[None]
    pos = jnp.concatenate([jnp.arange(5), jnp.arange(7)]).astype(jnp.int32)[None]
    seg = jnp.asarray([[1] * 5 + [2] * 7], jnp.int32)
    got = fwd(packed, pos, segment_ids=seg)
    np.testing.assert_allclose(got.logits[0, :5], out.logits[0, :5], atol=1e-5)
    np.testing.assert_allclose(got.logits[0, 5:], out.logits[1, :7], atol=1e-5)
    np.testing.assert_array_equal(got.routes[0, 5:], out.routes[1, :7])


def _unpadded(fwd, tokens, n):
    """Each row's first n tokens, on its own (positions 0..n-1, no padding)."""
    return fwd(tokens[:, :n], jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n)))


def test_right_padding_never_reaches_real_tokens(setup):
    """docs/design.md §5: right padding with positions 0 and no segment_ids leaves real tokens alone."""
    cfg, _, fwd, tokens, _, _ = setup
    n = 7
    want = _unpadded(fwd, tokens, n)
    pad_tokens = tokens.at[:, n:].set((tokens[:, n:] + 5) % cfg.vocab_size)  # padding ids vary too
    pos = jnp.where(jnp.arange(T) < n, jnp.arange(T), 0).astype(jnp.int32)  # padding positions 0
    got = fwd(pad_tokens, jnp.broadcast_to(pos, (B, T)))
    np.testing.assert_allclose(got.logits[:, :n], want.logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got.routes[:, :n], want.routes)
    np.testing.assert_array_equal(got.live_routes[:, :n], want.live_routes)


def test_left_padding_with_segment_ids(setup):
    """Left padding is supported when segment_ids give the padding its own id (0 here)."""
    cfg, _, fwd, tokens, _, _ = setup
    n, pad = 7, T - 7
    want = _unpadded(fwd, tokens, n)
    left = jnp.concatenate([jnp.full((B, pad), 3, jnp.int32), tokens[:, :n]], axis=1)
    pos = jnp.concatenate([jnp.zeros(pad, jnp.int32), jnp.arange(n, dtype=jnp.int32)])
    seg = jnp.concatenate([jnp.zeros(pad, jnp.int32), jnp.ones(n, jnp.int32)])
    got = fwd(left, jnp.broadcast_to(pos, (B, T)), segment_ids=jnp.broadcast_to(seg, (B, T)))
    np.testing.assert_allclose(got.logits[:, pad:], want.logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got.routes[:, pad:], want.routes)


def test_kv_cache_incremental_equals_full_forward(setup):
    cfg, model, _, tokens, positions, out = setup
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tok, pos, cache):
        return nnx.merge(graphdef, state)(tok, pos, cache=cache)

    cache = KVCache.init(cfg, B, 16)
    first = step(state, tokens[:, :7], positions[:, :7], cache)
    rest = [first]
    cache = first.cache
    for t in range(7, T):
        o = step(state, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        cache = o.cache
        rest.append(o)
    logits = jnp.concatenate([o.logits for o in rest], axis=1)
    routes = jnp.concatenate([o.routes for o in rest], axis=1)
    np.testing.assert_allclose(logits, out.logits, atol=1e-5)
    np.testing.assert_array_equal(routes, out.routes)


class TestValidateReplay:
    cfg = MoeConfig.tiny()

    def _replay(self, routes=None, mask=None):
        routes = np.tile(np.arange(2, dtype=np.uint8), (B, T, 2, 1)) if routes is None else routes
        mask = np.ones((B, T), bool) if mask is None else mask
        return Replay(routes, mask)

    def test_valid_passes(self):
        validate_replay(self._replay(), self.cfg, (B, T))

    def test_id_out_of_range(self):
        r = np.tile(np.arange(2, dtype=np.int32), (B, T, 2, 1))
        r[1, 3, 0, 1] = 8  # == E
        with pytest.raises(ValueError, match=re.escape("replay.routes (trajectory 1, token 3, layer 0): expert id 8 "
                                                       "at slot 1: expected ids >= 0 and < num_experts=8")):
            validate_replay(self._replay(r), self.cfg, (B, T))
        r[1, 3, 0, 1] = -1
        with pytest.raises(ValueError, match=r"\(trajectory 1, token 3, layer 0\): expert id -1"):
            validate_replay(self._replay(r), self.cfg, (B, T))

    def test_duplicates(self):
        r = np.tile(np.arange(2, dtype=np.uint8), (B, T, 2, 1))
        r[0, 5, 1] = [3, 3]
        with pytest.raises(ValueError, match=re.escape("replay.routes (trajectory 0, token 5, layer 1)=[3, 3]: "
                                                       "expert id 3 repeated")) as e:
            validate_replay(self._replay(r), self.cfg, (B, T))
        assert e.value.field == "replay.routes" and e.value.value == [3, 3]
        mask = np.ones((B, T), bool)
        mask[0, 5] = False  # masked-out rows are ignored
        validate_replay(self._replay(r, mask), self.cfg, (B, T))

    def test_shapes_and_dtypes(self):
        with pytest.raises(ValueError, match=r"replay.routes shape=\(2, 12, 3, 2\): expected \[B, T, L, K\] = \(2, 12, 2, 2\)"):
            validate_replay(self._replay(np.zeros((B, T, 3, 2), np.uint8)), self.cfg, (B, T))
        for dtype in (np.float32, bool):
            routes = np.tile(np.arange(2), (B, T, 2, 1)).astype(dtype)
            with pytest.raises(ValueError, match=f"replay.routes.dtype='{np.dtype(dtype)}': expected an integer dtype"):
                validate_replay(self._replay(routes), self.cfg, (B, T))
        with pytest.raises(ValueError, match="replay.mask dtype=int64: expected bool"):
            validate_replay(self._replay(mask=np.ones((B, T), np.int64)), self.cfg, (B, T))
        with pytest.raises(ValueError, match=r"replay.mask shape=\(2, 11\)"):
            validate_replay(self._replay(mask=np.ones((B, T - 1), bool)), self.cfg, (B, T))


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="MoeConfig.top_k=9: expected in \\[1, num_experts=8\\]"):
        MoeConfig.tiny(top_k=9)
    q = MoeConfig.qwen3_30b_a3b()
    assert (q.num_moe_layers, q.num_experts, q.top_k) == (48, 128, 8)
    assert 90e6 < MoeConfig.small_100m().param_count() < 115e6
    with pytest.raises(ValueError, match="preset='nope'"):
        MoeConfig.preset("nope")


def test_presets_of_the_new_families_have_their_published_sizes():
    # total parameters (the MTP layers of DeepSeek-V3 / GLM are not part of the model)
    for name, lo, hi in (("qwen3_235b_a22b", 234e9, 236e9), ("deepseek_v3", 670e9, 672e9),
                         ("kimi_k2", 1.02e12, 1.04e12), ("glm4_5_air", 106e9, 107.5e9)):
        assert lo < MoeConfig.preset(name).param_count() < hi, name
    k2 = MoeConfig.kimi_k2()
    assert (k2.num_experts, k2.top_k, k2.moe_layer_ids[0], k2.num_moe_layers) == (384, 8, 1, 60)
    assert MoeConfig.deepseek_v3().moe_layer_ids[:2] == (3, 4)
    with pytest.raises(ValueError, match=r"MoeConfig.router='topk': expected one of"):
        MoeConfig.tiny(router="topk")
    with pytest.raises(ValueError, match=r"MoeConfig.n_group=3: expected >= 1 and dividing num_experts=8"):
        MoeConfig.tiny(router="sigmoid_bias_grouped", n_group=3)
    with pytest.raises(ValueError, match=r"MoeConfig.topk_group=1: expected enough groups for top_k=4"):
        MoeConfig.tiny(router="sigmoid_bias_grouped", n_group=4, topk_group=1, top_k=4)
    with pytest.raises(ValueError, match=r"MoeConfig.num_kv_heads=2: expected num_heads=4 for attention='mla'"):
        MoeConfig.tiny(attention="mla", kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("variant", [
    dict(attention="mla", num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=16, kv_lora_rank=8,
         v_head_dim=6, qk_norm=False),  # DeepSeek-V3: v padded to head_dim in the cache
    dict(attention_bias=True, partial_rotary_factor=0.5, qk_norm=False, router="sigmoid_bias_grouped",
         num_shared_experts=1),  # GLM-4.5
])
def test_kv_cache_incremental_equals_full_forward_for_mla_and_partial_rope(variant):
    cfg = MoeConfig.tiny(**variant)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, tok, pos, cache: nnx.merge(graphdef, s)(tok, pos, cache=cache))
    tokens = jax.random.randint(jax.random.key(1), (B, 6), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (B, 6))
    full = step(state, tokens, positions, None)  # full-sequence forward, no cache
    first = step(state, tokens[:, :5], positions[:, :5], KVCache.init(cfg, B, 8))  # prefill
    last = step(state, tokens[:, 5:], positions[:, 5:], first.cache)  # one decode step
    logits = jnp.concatenate([first.logits, last.logits], axis=1)
    np.testing.assert_allclose(logits, full.logits, atol=1e-5)
    np.testing.assert_array_equal(jnp.concatenate([first.routes, last.routes], axis=1), full.routes)


def test_logits_dot_in_fp32_runs_the_head_in_fp32_for_a_bf16_model():
    """``logits_dot_in_fp32``: the head's matmul takes fp32 operands (the bf16 hidden state and weights cast
    up exactly) and accumulates in fp32; off, it runs in bf16 and only its result is cast. The two differ."""
    cfg = MoeConfig.tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    hidden = jax.random.normal(jax.random.key(1), (3, 5, cfg.hidden_size), jnp.bfloat16)
    head = model.lm_head[...]
    off = model.logits(hidden)
    want_off = (hidden @ head).astype(jnp.float32)
    model.config = cfg.replace(logits_dot_in_fp32=True)
    on = model.logits(hidden)
    want_on = hidden.astype(jnp.float32) @ head.astype(jnp.float32)
    assert off.dtype == on.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(off), np.asarray(want_off))
    np.testing.assert_allclose(np.asarray(on), np.asarray(want_on), rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(on - off))) > 1e-3  # bf16 rounding of the head's output, gone
    with pytest.raises(ValueError, match="logits_dot_in_fp32"):
        MoeConfig.tiny(logits_dot_in_fp32=1)
