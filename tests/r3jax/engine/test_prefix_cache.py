"""Prefix cache: a multi-turn conversation reuses KV and recorded routes, LRU eviction under a byte
budget, duplicate prefixes in one batch, and set_weights dropping everything."""

import numpy as np
import pytest
from flax import nnx

from models import MoeConfig
from r3jax.engine import GenerateRequest

V = MoeConfig.tiny().vocab_size


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, V, n).tolist()


def _conversation(engine, turns=3, first=12, user=6, gen=8):
    """Each turn's prompt is the whole conversation so far plus new user tokens; all rows from 0."""
    history, outs = [], []
    for t in range(turns):
        history = history + _tokens(100 + t, first if t == 0 else user)
        [out] = engine.generate([GenerateRequest(prompt_ids=list(history), max_tokens=gen, temperature=0.0,
                                                 return_routed_experts=True)])
        outs.append(out)
        history = history + out.output_ids
    return outs


def test_three_turns_with_cache_equal_without_and_prefill_far_less(tiny_model, make_engine):
    cached, plain = make_engine(tiny_model), make_engine(tiny_model, prefix_cache_bytes=0)
    with_cache, without = _conversation(cached), _conversation(plain)
    for a, b in zip(with_cache, without):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    # prompts of 12, 26, 40 tokens; the fed tokens of each turn (prompt + output[:-1]) are cached by
    # whole 8-token blocks, and at least the last prompt token is always computed
    assert [o.prompt_tokens for o in with_cache] == [12, 26, 40]
    assert [o.cached_tokens for o in with_cache] == [0, 16, 32]
    assert [o.cached_tokens for o in without] == [0, 0, 0]
    on, off = cached.stats["prefill_tokens"], plain.stats["prefill_tokens"]
    print(f"\nprefill tokens over 3 turns: {on} with the prefix cache, {off} without")
    assert (on, off) == (12 + 10 + 8, 12 + 26 + 40)
    assert cached.stats["cached_tokens"] == 48
    # rows of cached positions are the ones recorded at turn 1
    first_rows = with_cache[0].routed_experts
    np.testing.assert_array_equal(with_cache[2].routed_experts[:len(first_rows)], first_rows)


@pytest.fixture()
def small_budget(tiny_model, engine, make_engine):
    block_bytes = engine.stats["prefix_cache_block_bytes"]
    return make_engine(tiny_model, prefix_cache_bytes=4 * block_bytes + block_bytes // 2)  # room for 4 blocks


def _run(engine, prompt):
    [out] = engine.generate([GenerateRequest(prompt_ids=prompt, max_tokens=1, temperature=0.0,
                                             return_routed_experts=True)])
    return out


def test_lru_eviction_under_the_byte_budget_drops_leaves_first(small_budget):
    eng = small_budget
    a, b = _tokens(1, 25), _tokens(2, 25)  # 25 fed tokens = 3 whole blocks each
    assert eng.stats["prefix_cache_capacity_blocks"] == 4
    _run(eng, a)
    assert eng.stats["prefix_cache_blocks"] == 3
    _run(eng, b)  # needs 3 slots, 1 free: evicts A's two leaves, keeps A's root
    assert eng.stats["prefix_cache_blocks"] == 4 and eng.stats["prefix_cache_evictions"] == 2
    assert _run(eng, b).cached_tokens == 24  # (25 - 1) // 8 blocks: the last token is always computed
    assert _run(eng, a).cached_tokens == 8


def test_set_weights_drops_the_cache_and_bumps_the_version(tiny_model, small_budget):
    eng = small_budget
    prompt = _tokens(3, 20)
    first = _run(eng, prompt)
    assert _run(eng, prompt).cached_tokens == 16 and first.weight_version == 0
    _, params, _ = nnx.split(tiny_model, nnx.Param, ...)
    assert eng.set_weights(params) == 1
    assert eng.stats["prefix_cache_blocks"] == 0
    again = _run(eng, prompt)
    assert again.cached_tokens == 0 and again.weight_version == 1
    assert again.output_ids == first.output_ids  # same weights: same result, recomputed
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)


def test_identical_prefixes_in_one_batch_are_stored_once(tiny_model, make_engine):
    eng = make_engine(tiny_model)
    prompt = _tokens(4, 20)
    outs = eng.generate([GenerateRequest(prompt_ids=prompt, max_tokens=1, temperature=0.0,
                                         return_routed_experts=True)] * 4)
    assert eng.stats["prefix_cache_blocks"] == 2  # 20 fed tokens: 2 whole blocks, not 8
    assert all(o.output_ids == outs[0].output_ids for o in outs)
    assert _run(eng, prompt).cached_tokens == 16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_stored_then_loaded_come_back_bit_for_bit(dtype):
    """The pool keeps the cache's bit patterns (uint16 for bf16, so its in-place scatter never runs
    through f32): a stored block loads back into another row exactly, padding entries drop."""
    import jax
    import jax.numpy as jnp

    from models import KVCache
    from r3jax.engine.slot.prefix_cache import init_pool, load_blocks, store_blocks

    cfg = MoeConfig.tiny(dtype=getattr(jnp, dtype))
    bs, cap = 8, 6
    cache = KVCache.init(cfg, 2, 32)
    keys = iter(jax.random.split(jax.random.key(0), 16))
    fill = lambda x: jax.random.normal(next(keys), x.shape).astype(x.dtype)
    cache = KVCache(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)))
    routes = jax.random.randint(next(keys), (2, 32, cfg.num_moe_layers, cfg.top_k), 0, cfg.num_experts).astype(jnp.uint8)
    pool = init_pool(cfg, jnp.uint8, capacity=cap, block_size=bs)
    assert {x.dtype for x in pool.k + pool.v} == {jnp.dtype("uint16" if dtype == "bfloat16" else "uint32")}
    i32 = lambda *v: jnp.array(v, jnp.int32)
    # row 0 block 1 -> slot 4, row 1 block 3 -> slot 0, one padding entry (slot == capacity)
    pool = jax.jit(store_blocks, donate_argnums=(0,))(pool, cache, routes, i32(0, 1, 0), i32(1, 3, 0), i32(4, 0, cap))
    empty = KVCache.init(cfg, 2, 32)
    got, got_routes = load_blocks(pool, empty, jnp.zeros_like(routes), i32(1, 0), i32(0, 2), i32(4, 0))
    for a, b in zip(got.k + got.v, cache.k + cache.v):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a[:, 1, :bs]), np.asarray(b[:, 0, bs:2 * bs]))
        np.testing.assert_array_equal(np.asarray(a[:, 0, 2 * bs:3 * bs]), np.asarray(b[:, 1, 3 * bs:4 * bs]))
        assert not np.asarray(a[:, 0, :2 * bs]).any()  # untouched blocks stay as they were
    np.testing.assert_array_equal(got_routes[1, :bs], routes[0, bs:2 * bs])
    np.testing.assert_array_equal(got_routes[0, 2 * bs:3 * bs], routes[1, 3 * bs:4 * bs])
