"""The engine on a (data, tensor, expert) = (2, 2, 2) mesh of 8 simulated CPU devices returns the same
greedy tokens and route rows as on one device, with parameters and the page pool really split."""

import numpy as np
import pytest
from jax.sharding import NamedSharding

from models import MoeConfig
from r3jax.engine import GenerateRequest
from r3jax.engine.sharding import make_mesh

V = MoeConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def sharded(tiny_model, make_engine):
    # prefix cache off and one prefill row bucket: fewer programs to compile for the mesh
    return make_engine(tiny_model, mesh=make_mesh(data=2, tensor=2, expert=2), prefix_cache_bytes=0,
                       prefill_rows=1)


def test_parameters_and_slots_are_split_over_the_mesh(sharded):
    params = sharded._params
    spec = lambda x: tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else None
    # scanned layers: a leading layer axis, never sharded, before each layer's own spec
    moe = params["moe_layers"]["mlp"]
    assert spec(moe["gate_proj"][...]) == (None, "expert", None, "tensor")  # [L, E, D, I]
    assert spec(moe["down_proj"][...]) == (None, "expert", "tensor", None)  # [L, E, I, D]
    assert spec(params["dense_layers"]["attn"]["q_proj"][...]) == (None, None, "tensor")  # heads
    assert spec(params["dense_layers"]["attn"]["o_proj"][...]) == (None, "tensor", None)
    assert spec(params["dense_layers"]["mlp"]["gate_proj"][...]) == (None, None, "tensor")  # [1, D, I]
    # the combined pool [n, pages, page_size, 2 * kv heads, head_dim]: kv heads over tensor (a shard
    # holds the key and the value of its one head), pages whole (every data shard sees every page: the
    # pool is replicated over data, docs/scaling.md)
    k = sharded._k[1]
    assert sharded._v == ()
    assert spec(k) in ((None, None, None, "tensor", None), (None, None, None, "tensor"))
    assert k.addressable_shards[0].data.shape == (2, sharded.num_pages, 8, 2, 16)  # of [.., 4, 16]


def test_sharded_engine_equals_one_device(engine, sharded):
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(6):
        p = int(rng.integers(1, 40))
        reqs.append(GenerateRequest(prompt_ids=rng.integers(0, V, p).tolist(), max_tokens=int(rng.integers(1, 20)),
                                    temperature=0.0, return_routed_experts=True,
                                    routed_experts_prompt_start=[0, p, p // 2][i % 3]))
    one, many = engine.generate(reqs), sharded.generate(reqs)
    for a, b in zip(one, many):
        assert a.output_ids == b.output_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
