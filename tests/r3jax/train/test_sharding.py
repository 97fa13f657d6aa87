"""Partition specs and the 1-device vs (2, 2, 2)-mesh equality of one replaying train step."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from r3jax import train
from r3jax.sharding import make_mesh, shard_batch


def _spec(tree, *keys):
    node = tree
    for k in keys:
        node = node[k]
    return node[...].sharding.spec


def test_one_device_and_eight_device_steps_agree(tiny, rollout_batch8, tx, train_cfg):
    _, model = tiny
    mesh = make_mesh(2, 2, 2)
    s1 = train.init_train_state(model, tx)
    s8 = train.init_train_state(model, tx, mesh=mesh)

    # scanned layers: the leading layer axis stays unsharded, each layer's tensor as before
    moe = ("moe_layers", "mlp")
    # experts [L, E, D, I] / [L, E, I, D]: E over expert x fsdp (models/expert_parallel.py)
    assert _spec(s8.params, *moe, "gate_proj") == P(None, ("expert", "fsdp"), None, None)
    assert _spec(s8.params, *moe, "down_proj") == P(None, ("expert", "fsdp"), None, None)
    assert _spec(s8.params, *moe, "router") == P(None, "fsdp", None)
    assert _spec(s8.params, "embed") == P("fsdp", None)
    assert _spec(s8.params, "dense_layers", "mlp", "gate_proj") == P(None, None, "fsdp")  # dense [1, 64, 128]
    gate = s8.params["moe_layers"]["mlp"]["gate_proj"][...]
    assert gate.addressable_shards[0].data.shape == (2, 2, 64, 64)  # L, E/4, D, I
    assert _spec(s8.opt_state[0].trace, *moe, "gate_proj") == P(None, ("expert", "fsdp"), None, None)

    lr = 0.1  # conftest TX: the first momentum-SGD update is exactly -lr * grad
    p1_before, p8_before = jax.device_get(s1.params), jax.device_get(s8.params)
    s1, m1 = train.train_step(s1, rollout_batch8, config=train_cfg)
    s8, m8 = train.train_step(s8, shard_batch(rollout_batch8, mesh), config=train_cfg)
    assert _spec(s8.params, *moe, "gate_proj") == P(None, ("expert", "fsdp"), None, None)
    for k in ("loss", "pg_loss", "aux_loss", "grad_norm", "mean_abs_delta", "k3_kl"):
        np.testing.assert_allclose(m8[k], m1[k], rtol=0, atol=1e-5, err_msg=k)
    g1 = jax.tree.map(lambda a, b: (a - b) / lr, p1_before, jax.device_get(s1.params))
    g8 = jax.tree.map(lambda a, b: (a - b) / lr, p8_before, jax.device_get(s8.params))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g8)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(g1)) > 1e-3  # gradients are not ~0
