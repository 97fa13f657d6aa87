"""The expert-parallel train step on 8 simulated CPU devices: the compiled program never
all-gathers an expert weight (its equality with one device: test_sharding.py on (2, 2, 2) and
tests/models/test_expert_parallel.py on the three EP meshes)."""

import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
from r3jax import train
from experiments.synthetic import synthetic_batch
from r3jax.sharding import make_mesh, shard_batch

_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def moved_shapes(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result shape without its size-1 dims) of every all-gather, all-to-all and
    collective-permute in compiled HLO text: tuple results give one entry per element."""
    out = []
    for m in _COLLECTIVE.finditer(hlo):
        for dims in _ARRAY.findall(m.group(1)):
            out.append((m.group(2), tuple(int(d) for d in dims.split(",") if d and int(d) != 1)))
    return out


def expert_shapes(cfg, mesh) -> set[tuple[int, ...]]:
    """Every shape (size-1 dims dropped) an expert weight, a shard or a partial gather of it can
    have on ``mesh``: ``[E', D', I']`` or ``[E', I', D']``, E' | E, D' in {D, D/fsdp}, I' in
    {I, I/fsdp}, alone or stacked over the MoE layers ``[L, ...]``."""
    e, d, i, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, mesh.shape["fsdp"]
    es = [k for k in range(1, e + 1) if e % k == 0]
    one = {s for a in es for b in {d, d // f} for c in {i, i // f} for s in ((a, b, c), (a, c, b))}
    full = one | {(cfg.num_moe_layers,) + s for s in one}
    return {tuple(n for n in s if n != 1) for s in full}



def test_compiled_ep_step_gathers_no_expert_weight(tx, train_cfg):
    """(fsdp 2, expert 4): no all-gather (nor all-to-all, collective-permute) of an expert weight.
    Shapes are picked so that no activation looks like an expert weight (D=48, I=40, S=16)."""
    cfg = models.MoeConfig.tiny(hidden_size=48, head_dim=12, moe_intermediate_size=40)
    model = models.MoeTransformer(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh(1, 2, 4)
    state = train.init_train_state(model, tx, mesh=mesh)
    gate = state.params["moe_layers"]["mlp"]["gate_proj"][...]  # [L, E, D, I]
    assert gate.sharding.spec == P(None, ("expert", "fsdp"), None, None)
    assert gate.addressable_shards[0].data.shape == (2, 1, 48, 40)  # [L, E/8, D, I]
    batch = shard_batch(synthetic_batch(cfg, 8, 16), mesh)
    hlo = train.make_train_step(state, config=train_cfg).lower(state, batch).compile().as_text()
    moved = moved_shapes(hlo)
    assert ("all-gather", (8 * 16, cfg.hidden_size)) in moved  # the exchange: 8 devices' 16 tokens
    bad = [m for m in moved if m[1] in expert_shapes(cfg, mesh)]
    assert not bad, f"expert weights moved between devices: {bad}"


def test_replicated_state_does_not_alias_the_model(tiny, tx):
    """On (data 2, expert 4) the non-expert weights are replicated over all 8 devices; the state
    (which train_step donates) must own its buffers: device_put(may_alias=False) alone shares the
    model's buffer on the model's device."""
    _, model = tiny
    s8 = train.init_train_state(model, tx, mesh=make_mesh(2, 1, 4))
    assert s8.params["embed"][...].sharding.spec == P(None, None)
    own = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    shared = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(s8.params)
              if any(s.data.unsafe_buffer_pointer() in own for s in x.addressable_shards)]
    assert not shared, shared


def test_expert_specs_survive_a_stacked_layer_dim():
    """Scanned layers stack parameters as [L, ...]: experts are found by their router sibling and
    split on their trailing [E, D, I] dims; a stacked dense MLP [L, D, I] is not an expert."""
    L, E, D, I = 3, 8, 16, 12
    params = {"moe_layers": {"mlp": {"router": np.zeros((L, D, E)), "gate_proj": np.zeros((L, E, D, I)),
                                     "up_proj": np.zeros((L, E, D, I)), "down_proj": np.zeros((L, E, I, D)),
                                     "shared": {"gate_proj": np.zeros((L, D, I))}}},
              "dense_layers": {"mlp": {"gate_proj": np.zeros((L, D, 4 * D)), "down_proj": np.zeros((L, 4 * D, D))}}}
    sh = train.param_shardings(params, make_mesh(1, 2, 4))
    moe = sh["moe_layers"]["mlp"]
    assert moe["gate_proj"].spec == moe["up_proj"].spec == moe["down_proj"].spec == P(None, ("expert", "fsdp"), None, None)
    assert moe["shared"]["gate_proj"].spec == P(None, "fsdp", None)  # largest dim D=16 on fsdp
    assert sh["dense_layers"]["mlp"]["gate_proj"].spec == P(None, None, "fsdp")
    assert sh["dense_layers"]["mlp"]["down_proj"].spec == P(None, "fsdp", None)
