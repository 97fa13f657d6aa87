"""Mesh construction and batch placement on 8 simulated CPU devices (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from r3jax.batch import collate
from r3jax.sharding import (batch_multiple, batch_sharding, make_mesh, process_batch_multiple, process_rows,
                            shard_batch)

L, K = 2, 2


def _trajs(num_experts, count=5):
    rng = np.random.default_rng(0)
    out = []
    for j in range(count):
        n = 3 + j
        routes = np.argsort(rng.random((n, L, 8)), -1)[..., :K] + (num_experts - 8)  # top ids
        out.append({"tokens": rng.integers(0, 100, n), "loss_mask": np.r_[0, np.ones(n - 1)],
                    "rollout_logprobs": -rng.random(n), "advantage": j * 0.5, "routes": routes,
                    "captured": np.arange(n) < n - 1})
    return out


def test_make_mesh_shapes_and_axis_types():
    assert jax.device_count() == 8
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "expert")
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "expert": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(make_mesh(data=-1, fsdp=2).shape) == {"data": 4, "fsdp": 2, "expert": 1}
    assert dict(make_mesh(2, 2, 2).shape) == {"data": 2, "fsdp": 2, "expert": 2}
    assert dict(make_mesh(data=2, fsdp=1, devices=jax.devices()[:2]).shape)["data"] == 2
    assert make_mesh(axis_type=AxisType.Explicit).axis_types == (AxisType.Explicit,) * 3


@pytest.mark.parametrize("kwargs,message", [
    ({"data": 3}, r"mesh \(data=3, fsdp=1, expert=1\) has 3 slots: expected 8"),
    ({"data": -1, "fsdp": 3}, "data=-1: 8 devices are not divisible by the other axes' product 3"),
    ({"data": -1, "fsdp": -1}, "data and fsdp are both -1"),
    ({"fsdp": 0}, r"fsdp=0: expected an int >= 1, or -1"),
    ({"expert": True}, r"expert=True: expected an int >= 1"),
])
def test_make_mesh_rejections(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**kwargs)


@pytest.mark.parametrize("num_experts,dtype", [(8, np.uint8), (300, np.int16)])
def test_shard_batch_specs_shards_and_round_trip(num_experts, dtype):
    mesh = make_mesh(data=4, fsdp=2)
    assert batch_multiple(mesh) == 8
    host = collate(_trajs(num_experts), buckets=(8,), num_experts=num_experts, top_k=K, num_layers=L,
                   batch_multiple=batch_multiple(mesh))
    assert host.tokens.shape == (8, 8)
    dev = shard_batch(host, mesh)
    assert batch_sharding(mesh) == NamedSharding(mesh, P(("data", "fsdp", "expert")))
    for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(dev), jax.tree_util.tree_leaves(host)):
        name = jax.tree_util.keystr(path)
        assert isinstance(leaf, jax.Array), name
        assert leaf.sharding.spec == P(("data", "fsdp", "expert")), name
        assert leaf.dtype == want.dtype, name
        shards = leaf.addressable_shards
        assert len(shards) == 8 and {s.data.shape for s in shards} == {(1,) + want.shape[1:]}, name
        assert sorted(s.index[0].start for s in shards) == list(range(8)), name
        np.testing.assert_array_equal(np.asarray(leaf), want)
    assert dev.routes.dtype == dtype  # compact on device
    total = jax.jit(lambda b: jnp.sum(b.routes.astype(jnp.int32) * b.route_mask[..., None, None]))(dev)
    assert int(total) == int((host.routes.astype(np.int64) * host.route_mask[..., None, None]).sum())


def test_shard_batch_refuses_batch_not_divisible():
    mesh = make_mesh(data=4, fsdp=2)
    host = collate(_trajs(8), buckets=(8,), num_experts=8, top_k=K, num_layers=L)  # B = 5
    with pytest.raises(ValueError, match=r"batch.tokens shape=\(5, 8\): expected a leading batch dim "
                                         r"that is a multiple of data x fsdp x expert = 8 "
                                         r"\(collate\(..., batch_multiple=8\)\)"):
        shard_batch(host, mesh)


def test_batch_is_split_over_the_expert_axis_too():
    mesh = make_mesh(data=2, expert=4)
    assert batch_multiple(mesh) == 8
    x = shard_batch({"x": np.arange(16).reshape(8, 2)}, mesh)["x"]
    assert sorted(s.index[0].start for s in x.addressable_shards) == list(range(8))
    with pytest.raises(ValueError, match=r"multiple of data x fsdp x expert = 8"):
        shard_batch({"x": np.zeros((4, 2))}, mesh)


def test_process_rows_and_process_local_input_in_one_process():
    # One process owns every batch shard: its own rows are the whole batch, fed either way.
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    assert process_rows(mesh, 8) == slice(0, 8) and process_batch_multiple(mesh) == batch_multiple(mesh) == 8
    host = collate(_trajs(8, count=4), buckets=(8,), num_experts=8, top_k=K, num_layers=L,
                   batch_multiple=8)
    a, b = shard_batch(host, mesh), shard_batch(host, mesh, process_local=False)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.sharding == y.sharding == batch_sharding(mesh)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for bad in (6, 0, True):
        with pytest.raises(ValueError, match=rf"batch_size={bad!r}: expected a positive multiple of the "
                                             r"batch shard count 8"):
            process_rows(mesh, bad)
