"""Expert parallelism (models/expert_parallel.py): on 8 simulated CPU devices the MoE transformer
under a (data, fsdp, expert) mesh gives the one-device forward and gradients, with replay."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models import MoeConfig, MoeTransformer, Replay, attention, expert_parallel, moe
from r3jax.sharding import batch_sharding, make_mesh
from r3jax.train.partition import param_shardings

B, T = 8, 8
MESHES = {"data2_expert4": (2, 1, 4), "fsdp2_expert4": (1, 2, 4), "expert8": (1, 1, 8), "fsdp8": (1, 8, 1)}


def _inputs(cfg):
    ks = jax.random.split(jax.random.key(3), 4)
    tokens = jax.random.randint(ks[0], (B, T), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    # replayed rows: K distinct ids per (token, layer), unrelated to the live choice
    routes = jnp.argsort(jax.random.uniform(ks[1], (B, T, cfg.num_moe_layers, cfg.num_experts)), -1)
    routes = routes[..., :cfg.top_k].astype(jnp.uint8)
    mask = jax.random.bernoulli(ks[2], 0.6, (B, T))
    probe = jax.random.normal(ks[3], (B, T, cfg.vocab_size))
    return tokens, positions, Replay(routes, mask), probe


def _loss_fn(graphdef):
    def loss(params, tokens, positions, replay, probe):
        out = nnx.merge(graphdef, params)(tokens, positions, replay, token_mask=tokens > 3)
        return jnp.sum(out.logits * probe) / B + out.aux_loss, out
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.fixture(scope="module")
def one_device():
    """Per (expert count, expert hidden size): (cfg, params, inputs, fn, one-device result)."""
    cache = {}

    def get(num_experts, intermediate=32):
        key = num_experts, intermediate
        if key not in cache:
            cfg = MoeConfig.tiny(moe_intermediate_size=intermediate, num_experts=num_experts, num_layers=2)
            graphdef, params = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)))
            inputs, fn = _inputs(cfg), _loss_fn(graphdef)
            cache[key] = cfg, params, inputs, fn, jax.device_get(fn(params, *inputs))
        return cache[key]
    return get


# (mesh, E, I, exchange axes, gate shard [E_l, D, I_l]): experts over expert x fsdp; on fsdp8 neither
# E = 4 nor I = 12 divides 8, so the experts stay whole on every device (no exchange) while the
# tokens still split 8 ways (a GLM-4.5-Air-like E = 128, I = 1408 on 256 chips is this case)
CASES = [("data2_expert4", 8, 32, ("expert",), (2, 64, 32)),
         ("fsdp2_expert4", 8, 32, ("expert", "fsdp"), (1, 64, 32)),
         ("expert8", 8, 32, ("expert",), (1, 64, 32)),
         ("fsdp8", 4, 12, (), (4, 64, 12))]


@pytest.mark.parametrize("mesh_name,num_experts,intermediate,exchange,shard", CASES)
def test_ep_forward_and_grads_equal_one_device(one_device, mesh_name, num_experts, intermediate, exchange, shard):
    cfg, params, inputs, fn, ((loss1, out1), grads1) = one_device(num_experts, intermediate)
    mesh = make_mesh(*MESHES[mesh_name])
    if exchange:
        p8 = jax.device_put(params, param_shardings(params, mesh))
    else:  # the experts stay whole on all 8 devices: an explicit opt-in, with a warning naming the 8x
        with pytest.warns(UserWarning, match=r"moe_layers/mlp/(gate|up|down)_proj .*replicated 8x"):
            p8 = jax.device_put(params, param_shardings(params, mesh, allow_replication=True))
    assert p8["moe_layers"]["mlp"]["gate_proj"][...].addressable_shards[0].data.shape == (1,) + shard  # [L=1, ...]
    x8 = jax.device_put(inputs, batch_sharding(mesh))
    with jax.set_mesh(mesh):
        assert expert_parallel.plan(B * T, cfg.num_experts, intermediate).exchange == exchange
        assert "shard_map" in str(jax.make_jaxpr(fn)(p8, *x8))
        (loss8, out8), grads8 = jax.device_get(fn(p8, *x8))
    assert np.asarray(inputs[2].mask).mean() > 0.3  # replay applies to a good share of the tokens
    np.testing.assert_array_equal(out8.routes, out1.routes)  # = replayed where mask
    np.testing.assert_array_equal(out8.live_routes, out1.live_routes)
    np.testing.assert_array_equal(out8.expert_load, out1.expert_load)  # global counts
    np.testing.assert_allclose(out8.logits, out1.logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out8.aux_loss, out1.aux_loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(loss8, loss1, rtol=0, atol=1e-5)
    for (path, g1), g8 in zip(jax.tree_util.tree_leaves_with_path(grads1), jax.tree.leaves(grads8)):
        np.testing.assert_allclose(g8, g1, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    expert_grad = np.abs(grads1["moe_layers"]["mlp"]["down_proj"][...]).max()
    assert expert_grad > 1e-3 and np.abs(grads1["moe_layers"]["mlp"]["router"][...]).max() > 1e-3


def _layer_inputs(n, d, i, e, k, seed):
    """One MoE layer's kernel inputs: x [n, d], K distinct ids [n, k], gates [n, k], gate/up [e, d, i], down [e, i, d]."""
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, d))
    ids = jnp.argsort(jax.random.uniform(ks[1], (n, e)), -1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(ks[2], (n, k))
    gate, up = (jax.random.normal(kk, (e, d, i)) / d ** 0.5 for kk in ks[3:5])
    down = jax.random.normal(ks[5], (e, i, d)) / i ** 0.5
    return x, ids, w, gate, up, down


@pytest.mark.parametrize("kernel,with_grad", [("ragged", True), ("dense", True), ("loop", False),
                                              ("gather", False)])
def test_every_kernel_under_ep_with_the_hidden_dim_split(kernel, with_grad):
    """E=4 on (fsdp 2, expert 4): one expert per device along expert, its I split over fsdp. The
    decode kernels (loop, gather) forward only: their gradients compile slowly."""
    n, d, i, e, k = 64, 16, 8, 4, 2
    x, ids, w, gate, up, down = _layer_inputs(n, d, i, e, k, seed=5)
    fn = getattr(moe, f"experts_{kernel}")
    loss = lambda *a: jnp.sum(jnp.sin(expert_parallel.experts(fn, a[0], ids, *a[1:])))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)) if with_grad else loss)
    want = grad(x, w, gate, up, down)
    mesh = make_mesh(1, 2, 4)
    with jax.set_mesh(mesh):
        p = expert_parallel.plan(n, e, i)
        assert (p.expert, p.hidden) == (("expert",), ("fsdp",))
        wsh = lambda name, a: NamedSharding(mesh, P(*expert_parallel.expert_weight_spec(name, a.shape, mesh.shape)))
        tok = NamedSharding(mesh, P(p.batch))
        args = jax.device_put((x, w, gate, up, down),
                              (tok, tok, wsh("gate_proj", gate), wsh("up_proj", up), wsh("down_proj", down)))
        got = grad(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_plan_needs_a_trainer_mesh_and_divisible_shapes():
    assert expert_parallel.plan(64, 8, 32) is None  # no mesh in context
    with jax.set_mesh(make_mesh(8, 1, 1)):
        p = expert_parallel.plan(64, 8, 32)
        assert (p.batch, p.expert, p.hidden, p.exchange) == (("data", "fsdp", "expert"), (), (), ())
        attention._WARNED.clear()
        with pytest.warns(UserWarning, match=r"expert parallelism off for this call: 60 tokens do not divide over "
                                             r"the 8 devices of dataxfsdpxexpert; XLA partitions"):
            assert expert_parallel.plan(60, 8, 32) is None  # tokens not divisible by 8 devices
    with jax.set_mesh(make_mesh(1, 2, 4)):
        assert expert_parallel.plan(64, 6, 33).exchange == ()  # neither E=6 nor I=33 divides
        assert expert_parallel.plan(64, 6, 32).exchange == ("fsdp",)  # I over fsdp only
    auto2 = (jax.sharding.AxisType.Auto,) * 2
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"), axis_types=auto2)):  # a serving mesh
        p = expert_parallel.plan(64, 8, 32)
        assert (p.batch, p.expert, p.hidden, p.role) == (("data", "tensor"), (), ("tensor",), "serve")
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"), axis_types=auto2)):
        assert expert_parallel.plan(64, 8, 32) is None  # an axis of neither role: left to the partitioner
    with jax.set_mesh(make_mesh(2, 1, 4, axis_type=jax.sharding.AxisType.Explicit)):
        assert expert_parallel.plan(64, 8, 32) is None  # Explicit axes: not the trainer's meshes


def test_expert_weight_spec_trailing_dims():
    spec = expert_parallel.expert_weight_spec
    sizes = {"data": 1, "fsdp": 2, "expert": 4}
    assert spec("gate_proj", (8, 64, 32), sizes) == (("expert", "fsdp"), None, None)
    assert spec("down_proj", (3, 4, 32, 64), sizes) == ("expert", "fsdp", None)  # [L, E, I, D]
    assert spec("up_proj", (4, 64, 33), sizes) == ("expert", None, None)
    assert spec("up_proj", (6, 64, 33), sizes) == (None, None, None)
    assert spec("gate_proj", (8, 64, 32), {"data": 2, "fsdp": 2, "expert": 1}) == ("fsdp", None, None)


def test_exchange_chunks_bound_the_gathered_tokens():
    assert expert_parallel.exchange_chunks(8192, 128, None) == 1
    assert expert_parallel.exchange_chunks(64, 8, 1024) == 1                # 512 gathered: one exchange
    assert expert_parallel.exchange_chunks(8192, 128, 16384) == 64          # 128 tokens x 128 devices
    assert expert_parallel.exchange_chunks(12, 8, 40) == 3                  # 4 x 8 = 32 <= 40; 6 x 8 = 48 is not
    assert expert_parallel.exchange_chunks(7, 8, 4) == 7                    # never below one token per chunk


def test_chunked_exchange_equals_one_exchange_forward_and_gradient():
    """64 tokens over (fsdp 2, expert 4): 8 per device, gathered 64 at once or 16 at a time (4 chunks,
    each under jax.checkpoint); outputs and every gradient agree, and the chunked program's largest
    gathered buffer holds 16 tokens' rows, not 64."""
    n, d, i, e, k = 64, 16, 8, 8, 2
    x, ids, w, gate, up, down = _layer_inputs(n, d, i, e, k, seed=7)
    mesh = make_mesh(1, 2, 4)

    def run(exchange_tokens):
        loss = lambda *a: jnp.sum(jnp.sin(expert_parallel.experts(moe.experts_ragged, a[0], ids, *a[1:],
                                                                  exchange_tokens=exchange_tokens)))
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        with jax.set_mesh(mesh):
            p = expert_parallel.plan(n, e, i)
            wsh = lambda name, a: NamedSharding(mesh, P(*expert_parallel.expert_weight_spec(name, a.shape, mesh.shape)))
            tok = NamedSharding(mesh, P(p.batch))
            args = jax.device_put((x, w, gate, up, down),
                                  (tok, tok, wsh("gate_proj", gate), wsh("up_proj", up), wsh("down_proj", down)))
            return jax.device_get(fn(*args)), fn.lower(*args).as_text()

    (whole, whole_hlo), (chunked, chunked_hlo) = run(None), run(16)
    assert expert_parallel.exchange_chunks(8, 8, 16) == 4
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.abs(whole[1][0]).max() > 1e-3
    # the all-gathered token block: [64, 16] in one exchange, [16, 16] per chunk
    gathered = lambda hlo: {int(m) for line in hlo.splitlines() if "all_gather" in line
                            for m in re.findall(r"-> tensor<(\d+)x16xf32>", line)}
    assert gathered(whole_hlo) == {64} and gathered(chunked_hlo) == {16}


def test_the_engines_mesh_splits_experts_over_expert_and_their_hidden_dim_over_tensor():
    """The serving mesh (data, tensor, expert) = (2, 2, 2): tokens over all 8 devices, E=4 over expert,
    each expert's I over tensor, as the engine places the weights; equal to the kernel on one device."""
    from r3jax.engine.sharding import make_mesh as engine_mesh

    n, d, i, e, k = 64, 16, 8, 4, 2
    x, ids, w, gate, up, down = _layer_inputs(n, d, i, e, k, seed=7)
    fn = jax.jit(lambda *a: expert_parallel.experts(moe.experts_ragged, *a))
    want = fn(x, ids, w, gate, up, down)
    mesh = engine_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
        p = expert_parallel.plan(n, e, i)
        assert (p.batch, p.expert, p.hidden, p.role) == (("data", "tensor", "expert"), ("expert",), ("tensor",), "serve")
        assert expert_parallel.expert_weight_spec("down_proj", down.shape, mesh.shape, "serve") == ("expert", "tensor", None)
        wsh = lambda name, a: NamedSharding(mesh, P(*expert_parallel.expert_weight_spec(name, a.shape, mesh.shape, "serve")))
        tok = NamedSharding(mesh, P(p.batch))
        args = jax.device_put((x, ids, w, gate, up, down), (tok, tok, tok, wsh("gate_proj", gate), wsh("up_proj", up),
                                                             wsh("down_proj", down)))
        assert "shard_map" in str(jax.make_jaxpr(fn)(*args))
        got = fn(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
