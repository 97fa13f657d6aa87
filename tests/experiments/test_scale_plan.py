"""experiments/scale_plan.py on a tiny config: the CPU-simulated mesh path always, the real TPU
topology path (libtpu's ahead-of-time compiler) only where the tpu-aot extra is installed."""

import math

import pytest
from jax.sharding import PartitionSpec as P

from experiments import aot_cells, scale_plan, topologies
from models import MoeConfig
from models.axes import ReplicationError
from r3jax.sharding import AXES, BATCH_AXES

CFG = MoeConfig.tiny()  # f32: 4 bytes per parameter
L, K = CFG.num_moe_layers, CFG.top_k
RL_BATCH, SEQ = 8, 32
TOPO = "v5e:2x2"  # 4 chips


def cell(program, backend, cfg=CFG):
    return scale_plan.run_cell(cfg, TOPO, program, backend=backend, rl_batch=RL_BATCH, seq_len=SEQ)


@pytest.fixture(scope="module")
def cpu_train():
    return cell("train", "cpu")


@pytest.fixture(scope="module")
def cpu_decode():
    return cell("decode", "cpu")


def test_train_cell_on_a_simulated_cpu_mesh(cpu_train):
    c = cpu_train
    assert c["status"] == "fits", c.get("error")
    assert c["chips"] == 4 and c["mesh"] == dict(zip(AXES, aot_cells.train_layout(CFG, 4)))
    assert math.prod(c["mesh"].values()) == 4
    # every tiny tensor has a dim divisible by 4, and the parameters split over all 4 chips
    assert c["params_total_bytes"] == CFG.param_count() * 4
    assert c["params_bytes"] == CFG.param_count() * 4 // 4
    assert c["optimizer_bytes"] == 2 * c["params_bytes"] + 4  # AdamW mu, nu and an int32 step count
    # the RL batch's routes [B, S, L, K] uint8, split by rows over data x fsdp
    assert c["routes_total_bytes"] == RL_BATCH * SEQ * L * K
    assert c["routes_bytes"] == RL_BATCH * SEQ * L * K // 4
    assert c["routes_sharding"] == {"spec": str(P(BATCH_AXES)), "global_shape": [RL_BATCH, SEQ, L, K],
                                    "chip_shape": [RL_BATCH // 4, SEQ, L, K], "dtype": "uint8"}
    assert c["minibatch_rows"] == 4 and c["minibatch_routes_bytes"] == SEQ * L * K  # one row per chip
    assert c["peak_bytes"] > 0 and c["compile_s"] > 0


def test_decode_cell_on_a_simulated_cpu_mesh(cpu_decode):
    c = cpu_decode
    assert c["status"] == "fits", c.get("error")
    d, t, e = (c["mesh"][a] for a in ("data", "tensor", "expert"))
    assert d * t * e == 4 and CFG.num_kv_heads % t == 0 and CFG.num_experts // e >= 2
    # d engine cores, each on t * e chips with RL_BATCH / d rows; a core's page pool [P, 16, Hkv, Dh]
    # per layer (k and v), P = 1 + rows * pages of a SEQ request: kv heads along tensor, pages whole
    rows = RL_BATCH // d
    assert (c["engine_cores"], c["core_devices"], c["core_slots"], c["replicated"]) == (d, t * e, rows, [])
    assert c["num_pages"] == 1 + rows * -(-SEQ // 16)
    kv = 2 * CFG.num_layers * c["num_pages"] * 16 * CFG.num_kv_heads * CFG.head_dim * 4
    assert c["kv_cache_bytes"] == kv // t
    # the decode loop's route rows: decode_steps tokens per row per call (scale_plan's default 8)
    assert c["decode_steps"] == 8 and c["routes_bytes"] == 8 * rows * L * K
    assert c["routes_total_bytes"] == 8 * RL_BATCH * L * K
    assert c["bytes_accessed"] > 0
    # the layout chosen has the fewest resident bytes per chip of every layout the engine could use
    assert (d, t, e) in aot_cells.decode_layouts(CFG, 4, RL_BATCH)
    resident = {lay: (lambda i: i["params_bytes"] + i["slot_state_bytes"])(aot_cells.decode_program(
        CFG, topologies.devices(topologies.topology(TOPO), "cpu"), slots=RL_BATCH, seq_len=SEQ, layout=lay)[2])
        for lay in aot_cells.decode_layouts(CFG, 4, RL_BATCH)}
    assert c["params_bytes"] + c["slot_state_bytes"] == min(resident.values())
    # tensor=4 is not offered: the tiny model has 2 kv heads
    assert all(lay[1] <= CFG.num_kv_heads for lay in resident)
    # two cores of two chips: each holds the whole model over its 2 chips and half the rows' pool
    core = aot_cells.decode_program(CFG, topologies.devices(topologies.topology(TOPO), "cpu"), slots=RL_BATCH,
                                    seq_len=SEQ, layout=(2, 2, 1))[2]
    assert (core["core_devices"], core["core_slots"]) == (2, RL_BATCH // 2)
    assert core["num_pages"] == 1 + RL_BATCH // 2 * -(-SEQ // 16)


def test_a_latent_pool_decode_layout_over_tensor_competes_only_with_replication_allowed():
    """An MLA latent pool has no head axis: tensor > 1 in a core holds it whole on each chip, so such
    layouts are skipped unless allow_replication, and then the cell names what it replicates."""
    mla = MoeConfig.tiny(attention="mla", num_heads=4, num_kv_heads=4, head_dim=12, qk_rope_head_dim=4,
                         q_lora_rank=16, kv_lora_rank=8, v_head_dim=8, mla_cache="latent")
    devs = topologies.devices(topologies.topology(TOPO), "cpu")
    strict = [aot_cells.decode_program(mla, devs, slots=RL_BATCH, seq_len=SEQ, layout=lay)[2]
              for lay in aot_cells.decode_layouts(mla, 4, RL_BATCH) if lay[1] == 1]
    assert all(i["replicated"] == [] for i in strict)
    chosen = aot_cells.decode_program(mla, devs, slots=RL_BATCH, seq_len=SEQ)[2]
    assert chosen["mesh"]["tensor"] == 1 and chosen["replicated"] == []
    with pytest.raises(ReplicationError, match="MLA latent page pool .* so tensor=2 would replicate it 2x"):
        aot_cells.decode_program(mla, devs, slots=RL_BATCH, seq_len=SEQ, layout=(1, 2, 2))
    allowed = aot_cells.decode_program(mla, devs, slots=RL_BATCH, seq_len=SEQ, layout=(1, 2, 2),
                                       allow_replication=True)[2]
    assert len(allowed["replicated"]) == 1 and "tensor=2 would replicate it 2x" in allowed["replicated"][0]


def test_summary_names_the_smallest_fitting_topology_and_the_exhausted_ones():
    base = {"model": "m", "program": "train", "hbm_bytes": 16, "peak_bytes": 1}
    cells = [{**base, "topology": "big", "chips": 256, "status": "fits"},
             {**base, "topology": "small", "chips": 16, "status": "fits"},
             {**base, "topology": "tiny", "chips": 4, "status": "RESOURCE_EXHAUSTED"},
             {**base, "topology": "slow", "chips": 8, "status": "timeout"}]
    s = scale_plan.smallest_fitting(cells)["m/train"]
    assert s["smallest"]["topology"] == "small"
    assert s["resource_exhausted"] == ["tiny"] and s["not_compiled"] == ["slow (timeout)"]
    # a slice the compiler accepts at 95% of HBM has no headroom left: the next one is the smallest
    cells.append({**base, "topology": "full", "chips": 8, "status": "fits", "peak_bytes": 15.2})
    s = scale_plan.smallest_fitting(cells)["m/train"]
    assert s["smallest"]["topology"] == "small" and s["above_headroom"] == ["full"]


def test_summary_divides_the_earlier_plans_peak_by_this_ones():
    base = {"model": "m", "program": "train", "topology": "t", "chips": 4, "hbm_bytes": 100 * 2**30}
    now = {**base, "status": "fits", "peak_bytes": 20 * 2**30}
    fitted = {**base, "status": "fits", "peak_bytes": 50 * 2**30}
    refused = {**base, "status": "RESOURCE_EXHAUSTED", "required_bytes": 300 * 2**30}
    ratio = lambda before: scale_plan.summary_rows([now], before)[0]["peak before÷after"]
    assert ratio([fitted]) == "2.5" and ratio([refused]) == ">15.0" and ratio([]) == ""
    assert scale_plan.summary_rows([refused], [fitted])[0]["peak before÷after"] == ""  # no bound when refused now
    assert scale_plan.summary_rows([now])[0]["% HBM"] == "20"


def test_unknown_topology_and_too_few_cpu_devices_are_refused():
    with pytest.raises(ValueError, match="topology='v9:1x1'"):
        topologies.topology("v9:1x1")
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=256"):
        topologies.devices(topologies.topology("v5e:16x16"), "cpu")


tpu = pytest.mark.skipif(not topologies.tpu_aot_available(),
                         reason="libtpu is not importable: install the tpu-aot extra (make scale-plan builds .venv-tpu)")


@tpu
def test_train_and_decode_compile_for_a_real_v5e_2x2(cpu_train):
    c = cell("train", "tpu")
    assert c["status"] == "fits", c.get("error")
    assert c["backend"] == "tpu" and c["peak_bytes"] > 0
    for k in ("params_bytes", "optimizer_bytes", "routes_bytes", "mesh"):  # the layout does not depend on the backend
        assert c[k] == cpu_train[k]
    d = cell("decode", "tpu")
    assert d["status"] == "fits", d.get("error")


@tpu
def test_a_program_too_large_for_hbm_is_reported_as_resource_exhausted():
    # 2 x 2**20 x 4096 f32 embedding + head = 32 GiB of parameters, 8 GiB per chip, plus 16 GiB of AdamW
    # state per chip: more than a v5e's 16 GiB
    big = MoeConfig.tiny(vocab_size=1 << 20, hidden_size=4096, num_layers=1, first_dense_layers=0)
    c = cell("train", "tpu", big)
    assert c["status"] == "RESOURCE_EXHAUSTED", c.get("error")
    # every layout was tried (each refused), and the cell reports the least demanding one
    assert [t["mesh"] for t in c["layouts_tried"]] == [dict(zip(AXES, lay)) for lay in aot_cells.train_layouts(big, 4)]
    assert c["required_bytes"] == min(t["peak_bytes"] for t in c["layouts_tried"])
    assert c["required_bytes"] > c["available_bytes"] and c["available_bytes"] <= 16 << 30
    assert c["params_bytes"] == big.param_count() * 4 // math.prod(c["mesh"][a] for a in ("fsdp", "expert"))


def test_train_layouts_go_from_all_fsdp_towards_data_and_skip_one_expert_per_chip():
    assert aot_cells.train_layouts(CFG, 4) == [(1, 4, 1), (2, 2, 1), (4, 1, 1)]
    # E = 4 on 4 chips would leave one expert per chip (libtpu cannot compile its gradient)
    assert aot_cells.train_layouts(CFG.replace(num_experts=4), 4) == [(2, 2, 1), (4, 1, 1)]
    assert len(aot_cells.train_layouts(CFG, 256)) == 6


def test_merge_joins_runs_over_disjoint_models_and_keeps_each_cells_commit(tmp_path, capsys):
    import json

    def cell(model, commit, peak):
        return {"model": model, "topology": "v5p:2x2x1", "chips": 4, "program": "train", "backend": "tpu",
                "rl_batch": 256, "seq_len": 8192, "commit": commit, "status": "fits", "peak_bytes": peak,
                "hbm_bytes": 100, "compile_s": 1.0}

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps({"cells": [cell("m1", "abc1234", 10), cell("m2", "abc1234", 20)]}))
    b.write_text(json.dumps({"cells": [cell("m2", "def5678", 30), cell("m3", "def5678", 40)]}))
    assert scale_plan.main(["--merge", str(a), str(b), "--out", str(out), "--backend", "cpu",
                            "--before", str(tmp_path / "none.json")]) == 0
    cells = {c["model"]: c for c in json.loads(out.read_text())["cells"]}
    assert sorted(cells) == ["m1", "m2", "m3"]
    assert (cells["m1"]["commit"], cells["m2"]["commit"], cells["m2"]["peak_bytes"]) == ("abc1234", "def5678", 30)
    assert "m3/train: smallest fitting v5p:2x2x1 (4 chips)" in capsys.readouterr().out


def test_lane_aligned_expert_shares():
    """A chip's share of an expert's hidden dim is a multiple of the TPU's 128 lanes, or not."""
    deepseek, qwen3 = MoeConfig.preset("deepseek_v3"), MoeConfig.preset("qwen3_30b_a3b")  # I = 2048, 768
    assert [t for t in (1, 2, 4, 8, 16, 32, 64) if aot_cells.lane_aligned(deepseek, t)] == [1, 2, 4, 8, 16]
    assert [t for t in (1, 2, 3, 4, 6, 8) if aot_cells.lane_aligned(qwen3, t)] == [1, 2, 3, 6]


@tpu
def test_a_tpu_decode_order_puts_lane_aligned_layouts_first():
    cfg = CFG.replace(moe_intermediate_size=256, num_kv_heads=4)  # tensor 1, 2: 256, 128 a chip; tensor 4: 64
    devs = topologies.devices(topologies.topology(TOPO), "tpu")
    order = aot_cells.decode_order(cfg, devs, slots=RL_BATCH, seq_len=SEQ)
    aligned = [aot_cells.lane_aligned(cfg, t) for _, t, _ in order]
    assert aligned == sorted(aligned, reverse=True) and aligned[0] and not aligned[-1] and set(order) == set(
        aot_cells.decode_layouts(cfg, 4, RL_BATCH))


def test_a_cells_commit_is_the_code_provenance_not_the_result_files(monkeypatch):
    """A cell records ``experiments.common.provenance``: another experiment's fresh result file (an
    output) leaves it clean; changed code marks it ``-dirty``."""
    from experiments import common, scale_plan

    for dirty, want in ((False, "abc1234"), (True, "abc1234-dirty")):
        monkeypatch.setattr(common, "provenance", lambda dirty=dirty: {"commit": "abc1234", "dirty": dirty})
        assert scale_plan._commit() == want
