"""The engine over an MLA model: with the latent page pool (absorbed decode) on a (1, 2, 4) mesh it
returns the same tokens, logprobs (1e-5, fp32) and route rows as with the expanded per-head pool on
one device; a prefix hit reuses latent pages. The latent pool has no head axis, so tensor = 2 holds it
whole on both devices: refused unless allow_replication (one warning)."""

import numpy as np
import pytest
from models.axes import ReplicationError
from flax import nnx
from jax.sharding import NamedSharding

from models import MoeConfig, MoeTransformer
from models.cache import cache_bytes_per_token
from r3jax.engine import Engine, GenerateRequest
from r3jax.engine.sharding import Placement, make_mesh

# tiny DeepSeek-V3-family model (the one of tests/models/test_mla_latent.py)
MLA = dict(attention="mla", num_heads=4, num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=16,
           kv_lora_rank=8, v_head_dim=8, router="sigmoid_bias_grouped", n_group=4, topk_group=2,
           routed_scaling_factor=2.5, num_shared_experts=1, qk_norm=False)
# one prefill row of 16 tokens and one decode bucket: two step programs per engine
KW = dict(max_seq_len=16, max_batch_size=4, block_size=8, prefill_chunk=16, prefill_rows=1, decode_buckets=1,
          moe_impl="dense")
V = MoeConfig.tiny().vocab_size


def _engine(mla_cache, **kw):
    model = MoeTransformer(MoeConfig.tiny(mla_cache=mla_cache, **MLA), rngs=nnx.Rngs(0))
    return Engine(model, **{**KW, **kw})


@pytest.fixture(scope="module")
def engines():
    # the latent engine on a (data, tensor, expert) = (1, 2, 4) mesh, its pool replicated over tensor by
    # choice; prefix cache on
    with pytest.warns(UserWarning, match=r"MLA latent page pool .* so tensor=2 would replicate it 2x"):
        latent = _engine("latent", mesh=make_mesh(data=1, tensor=2, expert=4), allow_replication=True)
    made = {"expanded": _engine("expanded"), "latent_tp": latent}
    yield made
    for e in made.values():
        e.close()


def _requests():
    rng = np.random.default_rng(5)
    shared = rng.integers(0, V, 9).tolist()  # a whole block that a later prompt reuses from the prefix cache
    prompts = [shared, rng.integers(0, V, 3).tolist(), rng.integers(0, V, 10).tolist(), shared + [7, 8]]
    return [GenerateRequest(prompt_ids=p, max_tokens=4 + i % 2, temperature=0.0, return_routed_experts=True,
                            return_logprobs=True) for i, p in enumerate(prompts)]


def test_latent_engine_equals_expanded_engine(engines):
    reqs = _requests()
    want = engines["expanded"].generate(reqs[:3]) + engines["expanded"].generate(reqs[3:])
    got = engines["latent_tp"].generate(reqs[:3]) + engines["latent_tp"].generate(reqs[3:])
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.output_ids == b.output_ids, i
        assert len(a.logprobs) == len(b.logprobs) > 0
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0, err_msg=f"request {i}")
        assert a.routed_experts.shape == b.routed_experts.shape == (len(reqs[i].prompt_ids) + len(a.output_ids) - 1,
                                                                    2, 2)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts, err_msg=f"request {i}")
    assert want[3].cached_tokens == got[3].cached_tokens == 8  # the latent prefix-cache block was reused


def test_latent_pool_is_whole_per_device_and_experts_stay_expert_parallel(engines):
    """The latent pool has one shared 'head' (c_kv, k_rot), so tensor cannot split it and one engine
    never splits its pages: every device holds the whole pool (docs/scaling.md, the limitation)."""
    eng = engines["latent_tp"]
    spec = lambda x: tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else None
    n, pages, ps = 2, eng.num_pages, eng.block_size
    assert all(s is None for s in spec(eng._k[1])) and all(s is None for s in spec(eng._v[1]))
    assert eng._k[1].addressable_shards[0].data.shape == (n, pages, ps, 1, 8)  # c_kv [n, pages, ps, 1, R]
    assert eng._v[1].addressable_shards[0].data.shape == (n, pages, ps, 1, 4)  # k_rot [n, pages, ps, 1, rope]
    moe = eng._params["moe_layers"]["mlp"]
    assert spec(moe["gate_proj"][...])[1] == "expert"  # experts stay expert-parallel


def test_a_latent_pool_replicated_over_tensor_is_refused_by_default():
    model = MoeTransformer(MoeConfig.tiny(mla_cache="latent", **MLA), rngs=nnx.Rngs(0))
    with pytest.raises(ReplicationError, match=r"the MLA latent page pool .* so tensor=2 would replicate it 2x: "
                                               r"expected tensor=1 .* or allow_replication=True"):
        Engine(model, mesh=make_mesh(data=1, tensor=2, expert=4), **KW)
    expanded = MoeTransformer(MoeConfig.tiny(mla_cache="expanded", **MLA), rngs=nnx.Rngs(0))
    place = Placement(make_mesh(data=1, tensor=2, expert=4), expanded.config)
    assert tuple(place.kv().spec) == (None, None, None, "tensor", None)  # the per-head pool splits by heads


def test_latent_cache_sizes_the_prefix_pool():
    latent, expanded = (MoeConfig.tiny(mla_cache=c, **MLA) for c in ("latent", "expanded"))
    assert cache_bytes_per_token(latent) == latent.num_layers * (8 + 4) * 4
    assert cache_bytes_per_token(expanded) == expanded.num_layers * 2 * 4 * 12 * 4
