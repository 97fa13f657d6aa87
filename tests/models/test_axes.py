"""The one logical-axis table (models/axes.py): declarations on every parameter, the resolver's
divisibility rule, and the refusal to replicate an array silently."""

import ast
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer, axes
from models.axes import ReplicationError
from r3jax import train
from r3jax.sharding import make_mesh


def test_every_parameter_declares_logical_axes_of_the_table():
    cfg = MoeConfig.tiny(attention_bias=True, num_shared_experts=1)
    model = nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(flat) > 10
    for path, var in flat:
        declared = var.get_metadata().get("logical_axes")
        assert declared is not None and set(declared) <= set(axes.RULES), path
        # stacked layers: one leading "layers" axis, added in one place
        got = axes.param_axes(path, var)
        assert got == (("layers",) if path[0] in ("dense_layers", "moe_layers") else ()) + declared
        assert len(got) == len(var.shape)
    # a tree without the metadata (a nested dict) gets the same axes from the parameters' names
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for (path, var), (dpath, leaf) in zip(flat, jax.tree_util.tree_leaves_with_path(pure)):
        assert axes.param_axes(dpath, leaf) == axes.param_axes(path, var)


def test_resolve_experts_first_then_largest_dim_in_whole_heads():
    sizes = {"data": 1, "fsdp": 2, "expert": 4}
    # experts over expert x fsdp; the expert's I then keeps whole
    assert axes.resolve(axes.EXPERT_IN, (8, 64, 32), sizes, "train").spec == (("expert", "fsdp"), None, None)
    # E = 4 takes expert only; fsdp goes to I
    assert axes.resolve(axes.EXPERT_IN, (4, 64, 32), sizes, "train").spec == ("expert", None, "fsdp")
    # every other weight: fsdp on its largest dim it divides (vocab 272 > embed 64)
    assert axes.resolve(("vocab", "embed"), (272, 64), sizes, "train").spec == ("fsdp", None)
    assert axes.resolve(("vocab", "embed"), (271, 64), sizes, "train").spec == (None, "fsdp")
    # serving: tensor splits q/k/v only at head boundaries: 512 = 4 heads x 128 columns on tensor = 8
    with pytest.raises(ReplicationError, match=r"tensor=8 divides none of dim 1 \(kv_heads\) = 512 \(4 heads\)"
                                               r".*replicated 8x"):
        axes.spec(("embed", "kv_heads"), (2048, 512), {"tensor": 8}, "serve", what="k_proj", units={"kv_heads": 4})
    assert axes.spec(("embed", "kv_heads"), (2048, 512), {"tensor": 4}, "serve", what="k_proj",
                     units={"kv_heads": 4}) == (None, "tensor")
    # norm scales may stay whole: a few KiB, never an error
    assert axes.spec(("layers", "norm"), (2, 16), {"fsdp": 32}, "train", what="q_norm") == (None, None)


def test_two_kv_heads_on_tensor_8_raise_or_warn_with_the_multiplier_when_opted_in():
    from r3jax.engine.sharding import Placement
    from r3jax.engine.sharding import make_mesh as engine_mesh

    cfg = MoeConfig.tiny()  # 2 kv heads
    mesh = engine_mesh(data=1, tensor=8)
    with pytest.raises(ReplicationError, match=r"KV cache .*tensor=8 divides none of dim 3 \(kv_heads\) = 2 "
                                               r"\(2 heads\), so it would be replicated 8x") as err:
        Placement(mesh, cfg).kv()
    assert err.value.field == "KV cache" and "allow_replication=True" in str(err.value)
    opted = Placement(mesh, cfg, allow_replication=True)
    with pytest.warns(UserWarning, match=r"allow_replication=True: KV cache .*replicated 8x"):
        assert opted.kv().spec == jax.sharding.PartitionSpec(None, None, None, None, None)


def test_engine_refuses_a_mesh_that_would_replicate_its_kv_heads():
    from r3jax.engine import Engine
    from r3jax.engine.sharding import make_mesh as engine_mesh

    tiny_model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))

    # refused before any weight is placed or program compiled: the page pool's kv heads are checked first
    with pytest.raises(ReplicationError, match=r"KV cache .*tensor=8 divides none of dim 3 \(kv_heads\) = 2 "
                                               r"\(2 heads\).*replicated 8x"):
        Engine(tiny_model, mesh=engine_mesh(data=1, tensor=8), max_seq_len=32, max_batch_size=8)
    # the weights' own check names them (k_proj's output dim holds the kv heads)
    from r3jax.engine.sharding import Placement

    params = nnx.state(tiny_model, nnx.Param)
    with pytest.raises(ReplicationError, match=r"attn/k_proj .*tensor=8 divides none of dim 2 \(kv_heads\) = 32 "
                                               r"\(2 heads\).*replicated 8x"):
        Placement(engine_mesh(data=1, tensor=8), tiny_model.config).param_shardings(params)


def test_trainer_refuses_experts_no_axis_splits_unless_opted_in():
    # E = 4 and I = 12 on fsdp = 8: the experts would be whole on all 8 devices
    params = {"moe_layers": {"mlp": {"gate_proj": np.zeros((1, 4, 64, 12)), "down_proj": np.zeros((1, 4, 12, 64))}}}
    mesh = make_mesh(1, 8, 1)
    with pytest.raises(ReplicationError, match=r"moe_layers/mlp/down_proj \[1, 4, 12, 64\] .*fsdp=8 divides none of "
                                               r"dim 1 \(experts\) = 4, dim 2 \(expert_mlp\) = 12.*replicated 8x"):
        train.param_shardings(params, mesh)
    with pytest.warns(UserWarning, match=r"replicated 8x .*\(and 1 more arrays\)"):
        sh = train.param_shardings(params, mesh, allow_replication=True)
    assert sh["moe_layers"]["mlp"]["gate_proj"].spec == jax.sharding.PartitionSpec(None, None, None, None)


def test_one_make_mesh_for_both_roles():
    from r3jax.engine.sharding import make_mesh as engine_mesh

    assert make_mesh(2, 2, 2).axis_names == axes.MESH_AXES["train"] == ("data", "fsdp", "expert")
    assert engine_mesh(2, 2, 2).axis_names == axes.MESH_AXES["serve"] == ("data", "tensor", "expert")
    assert dict(axes.make_mesh("serve", {"data": 2, "tensor": -1, "expert": 1}).shape)["tensor"] == 4
    with pytest.raises(ValueError, match=r"mesh \(data=3, tensor=1, expert=1\) has 3 slots: expected 8"):
        engine_mesh(data=3)


def test_models_never_import_r3jax():
    root = Path(__file__).resolve().parents[2] / "models"
    bad = []
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{f.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "r3jax"]
    assert not bad, bad
