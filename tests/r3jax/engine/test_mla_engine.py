"""The engine over an MLA model: with the latent cache (absorbed decode) and its slots split over
data x tensor of a (2, 2, 2) mesh (DP attention), it returns the same tokens, logprobs (1e-5, fp32)
and route rows as with the expanded per-head cache on one device; the prefix cache reuses latent blocks."""

import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from models import MoeConfig, MoeTransformer
from models.axes import ReplicationError
from models.cache import cache_bytes_per_token
from r3jax.engine import Engine, GenerateRequest
from r3jax.engine.sharding import make_mesh

# tiny DeepSeek-V3-family model (the one of tests/models/test_mla_latent.py)
MLA = dict(attention="mla", num_heads=4, num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=16,
           kv_lora_rank=8, v_head_dim=8, router="sigmoid_bias_grouped", n_group=4, topk_group=2,
           routed_scaling_factor=2.5, num_shared_experts=1, qk_norm=False)
# one prompt / window / read-out bucket (16), one chunk bucket, one prefill row: few programs per engine
KW = dict(max_seq_len=16, max_batch_size=4, block_size=8, prefill_chunk=16, min_prefill_chunk=16, prefill_rows=1,
          min_seq_bucket=16, moe_impl="dense")
V = MoeConfig.tiny().vocab_size


def _engine(mla_cache, **kw):
    model = MoeTransformer(MoeConfig.tiny(mla_cache=mla_cache, **MLA), rngs=nnx.Rngs(0))
    return Engine(model, **{**KW, **kw})


@pytest.fixture(scope="module")
def engines():
    # the latent engine on a (data, tensor, expert) = (2, 2, 2) mesh: DP attention, prefix cache on
    made = {"expanded": _engine("expanded"), "latent_dp": _engine("latent", mesh=make_mesh(data=2, tensor=2, expert=2))}
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
    got = engines["latent_dp"].generate(reqs[:3]) + engines["latent_dp"].generate(reqs[3:])
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.output_ids == b.output_ids, i
        assert len(a.logprobs) == len(b.logprobs) > 0
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0, err_msg=f"request {i}")
        assert a.routed_experts.shape == b.routed_experts.shape == (len(reqs[i].prompt_ids) + len(a.output_ids) - 1,
                                                                    2, 2)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts, err_msg=f"request {i}")
    assert want[3].cached_tokens == got[3].cached_tokens == 8  # the latent prefix-cache block was reused


def test_latent_slots_are_split_over_data_and_tensor(engines):
    state = engines["latent_dp"]._state
    spec = lambda x: tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else None
    assert spec(state.cache.k[1]) == (None, ("data", "tensor"), None, None, None)  # c_kv [n, B, S, 1, R]
    assert spec(state.cache.v[1]) == (None, ("data", "tensor"), None, None, None)  # k_rot [n, B, S, 1, rope]
    assert spec(state.routes)[0] == ("data", "tensor")
    assert spec(state.tokens)[0] == ("data", "tensor")
    assert state.cache.k[1].addressable_shards[0].data.shape == (2, 1, 16, 1, 8)  # one slot per data x tensor
    moe = engines["latent_dp"]._params["moe_layers"]["mlp"]
    assert spec(moe["gate_proj"][...])[1] == "expert"  # experts stay expert-parallel


def test_latent_cache_sizes_the_prefix_pool():
    latent, expanded = (MoeConfig.tiny(mla_cache=c, **MLA) for c in ("latent", "expanded"))
    assert cache_bytes_per_token(latent) == latent.num_layers * (8 + 4) * 4
    assert cache_bytes_per_token(expanded) == expanded.num_layers * 2 * 4 * 12 * 4


def test_dp_layout_needs_slots_that_divide_data_times_tensor():
    with pytest.raises(ReplicationError, match=r"max_batch_size=2: expected a multiple of 4, the devices the slots "
                                               r"are split over \(data=2 x tensor=2, logical axis 'attn_batch'\)"):
        _engine("latent", max_batch_size=2, mesh=make_mesh(data=2, tensor=2, expert=2), prefix_cache_bytes=0)


