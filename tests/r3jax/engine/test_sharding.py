"""The engine on a (data, tensor, expert) = (1, 2, 4) mesh of 8 simulated CPU devices returns the same
greedy tokens and route rows as on one device, with parameters and the page pool really split; a
mesh with data > 1 would replicate the pool, so it is refused (or warned once when allowed)."""

import warnings

import numpy as np
import pytest
from jax.sharding import NamedSharding

from models import MoeConfig
from models.axes import ReplicationError
from r3jax.engine import Engine, GenerateRequest
from r3jax.engine.sharding import Placement, make_mesh

V = MoeConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def sharded(tiny_model, make_engine):
    # prefix cache off and one prefill row bucket: fewer programs to compile for the mesh
    return make_engine(tiny_model, mesh=make_mesh(data=1, tensor=2, expert=4), prefix_cache_bytes=0,
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
    # holds the key and the value of its one head), pages whole (any step may read any page)
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


def test_a_pool_replicated_over_data_is_refused_before_any_weight_is_placed(tiny_model):
    """One engine keeps its whole pool on every device (any step may read any page): data = 2 would
    hold it twice. The error names the axis, the multiplier and where data parallelism lives."""
    mesh = make_mesh(data=2, tensor=2, expert=2)
    with pytest.raises(ReplicationError, match=r"page pool .* so data=2 would replicate it 2x: expected data=1 "
                                               r"\(data parallelism: EngineGroup\(data=D\)"):
        Engine(tiny_model, mesh=mesh, max_seq_len=32, max_batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        place = Placement(mesh, tiny_model.config, allow_replication=True)
        sharding = place.kv()
        place.kv()
    assert [str(w.message) for w in caught] == [
        "allow_replication=True: KV cache: the page pool (logical axes ('layers', 'batch', None, 'kv_heads', None)) "
        "is whole on every device of one engine (any step may read any page), so data=2 would replicate it 2x"]
    assert tuple(sharding.spec) == (None, None, None, "tensor", None)  # kv heads still split over tensor
