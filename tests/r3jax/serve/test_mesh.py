"""The HTTP server with its engine sharded over a mesh of the 8 simulated CPU devices (vLLM's flags
``-tp 2 -dp 4 --enable-expert-parallel``: mesh (data, tensor, expert) = (1, 2, 4)) answers like the
server on one device: same greedy tokens, logprobs and route rows; ``/v1/stats`` reports the mesh.
And the mesh flags' errors name the flag, its value and what was expected."""

from __future__ import annotations

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateRequest
from r3jax.serve import RemoteInferenceClient, create_app
from r3jax.serve.server import build_mesh, mesh_shape, parse_args

# the engine tests' configuration (tests/r3jax/engine/conftest.py); prefix cache off and one prefill
# row bucket on both servers: fewer programs to compile, and the two engines run the same steps
ENGINE_KW = dict(max_seq_len=64, max_batch_size=4, block_size=8, prefill_chunk=32, prefill_rows=1, num_pages=25,
                 decode_buckets=1, moe_impl="dense", prefix_cache_bytes=0)
EP_FLAGS = ["--tensor-parallel-size", "2", "--data-parallel-size", "4", "--enable-expert-parallel"]
V = MoeConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def servers(serve_helpers):
    """``(one-device url, mesh url, mesh engine)``: the same tiny model behind both."""
    model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
    args = parse_args(EP_FLAGS, devices=jax.devices())
    assert args.mesh_shape == (1, 2, 4)
    one = Engine(model, **ENGINE_KW)
    many = Engine(model, mesh=build_mesh(args.mesh_shape), **ENGINE_KW)
    try:
        with serve_helpers.thread_server(create_app(one)) as a, serve_helpers.thread_server(create_app(many)) as b:
            yield a.url, b.url, many
    finally:
        one.close()
        many.close()


def requests() -> list[GenerateRequest]:
    """Greedy requests of mixed lengths (one prompt longer than a prefill chunk), most with routes."""
    rng = np.random.default_rng(7)
    out = []
    for i, (p, g) in enumerate(((1, 5), (5, 12), (17, 3), (40, 9), (9, 1), (33, 20))):
        out.append(GenerateRequest(rng.integers(0, V, p).tolist(), max_tokens=g, temperature=0.0,
                                   return_routed_experts=i != 4, routed_experts_prompt_start=[0, p // 2, p][i % 3]))
    return out


@pytest.mark.parametrize("binary", [True, False])
def test_mesh_server_answers_like_one_device(servers, binary):
    one_url, mesh_url, _ = servers
    reqs = requests()
    with RemoteInferenceClient(one_url, binary_routes=binary) as a, RemoteInferenceClient(mesh_url, binary_routes=binary) as b:
        want, got = a.generate(reqs), b.generate(reqs)  # each batch sent at once: several rows per step
    for req, x, y in zip(reqs, want, got):
        assert y.output_ids == x.output_ids and y.finish_reason == x.finish_reason
        assert len(y.output_ids) == req.max_tokens
        np.testing.assert_allclose(y.logprobs, x.logprobs, rtol=0, atol=1e-5)
        if not req.return_routed_experts:
            assert x.routed_experts is None and y.routed_experts is None
            continue
        p, s = len(req.prompt_ids), req.routed_experts_prompt_start
        assert y.routed_experts.shape == (p - s + req.max_tokens - 1, 2, 2)
        assert y.routed_experts.dtype == x.routed_experts.dtype
        np.testing.assert_array_equal(y.routed_experts, x.routed_experts)


def test_stats_report_the_mesh(servers):
    one_url, mesh_url, engine = servers
    assert httpx.get(one_url + "/v1/stats", timeout=30).json()["mesh"] == \
        {"data": 1, "tensor": 1, "expert": 1, "devices": 1, "engine_cores": 1, "expert_parallel": None}
    # tensor > 1 too: experts over expert, each one's hidden dim over tensor, tokens over every axis
    assert httpx.get(mesh_url + "/v1/stats", timeout=30).json()["mesh"] == \
        {"data": 1, "tensor": 2, "expert": 4, "devices": 8, "engine_cores": 1, "expert_parallel": {
            "tokens_over": ["data", "tensor", "expert"], "experts_over": ["expert"], "hidden_over": ["tensor"],
            "tokens_multiple": 8}}
    # really split: an expert weight's shards hold 2 of the 8 experts and half of each hidden dim
    moe = engine._params["moe_layers"]["mlp"]["gate_proj"][...]  # [L, E, D, I]
    assert moe.addressable_shards[0].data.shape == (moe.shape[0], 2, moe.shape[2], moe.shape[3] // 2)


def test_weight_push_to_the_mesh_server_matches_one_device(servers, tmp_path):
    """``POST /v1/weights`` (orbax, then safetensors back) to both servers: the mesh engine places the
    pushed weights on its mesh (its shardings unchanged) and still answers like one device."""
    from models.hf import save_pretrained
    from models.weights import WEIGHTS
    from r3jax.train import export_params

    one_url, mesh_url, engine = servers
    model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))  # the served weights (same seed)
    flipped = jax.tree.map(lambda x: -np.asarray(x), nnx.state(model, WEIGHTS))
    orbax = export_params(tmp_path / "orbax", flipped)
    save_pretrained(model, tmp_path / "hf")
    shardings = [x.sharding for x in jax.tree.leaves(engine._params)]
    reqs = requests()[:3]
    with RemoteInferenceClient([one_url]) as a, RemoteInferenceClient([mesh_url]) as b:
        [before] = b.generate(reqs[:1])
        for path, fmt in ((orbax, "orbax"), (tmp_path / "hf", "safetensors")):
            v = engine.weight_version
            assert a.update_weights(str(path), fmt) == [v + 1] and b.update_weights(str(path), fmt) == [v + 1]
            assert [x.sharding for x in jax.tree.leaves(engine._params)] == shardings
            for x, y in zip(a.generate(reqs), b.generate(reqs)):
                assert y.output_ids == x.output_ids and y.weight_version == x.weight_version == v + 1
                np.testing.assert_allclose(y.logprobs, x.logprobs, rtol=0, atol=1e-5)
                np.testing.assert_array_equal(y.routed_experts, x.routed_experts)
            if fmt == "orbax":  # other weights: other experts chosen
                [changed] = b.generate(reqs[:1])
                assert not np.array_equal(changed.routed_experts, before.routed_experts)
        [after] = b.generate(reqs[:1])
    assert after.output_ids == before.output_ids  # the original weights back
    np.testing.assert_array_equal(after.routed_experts, before.routed_experts)


def test_mesh_flags_give_the_mesh_shape():
    devices = jax.devices()
    shape = lambda argv: parse_args(argv, devices=devices).mesh_shape
    assert shape([]) == (1, 1, 1)  # CPU default: one device
    assert shape(["--mesh", "2,2,2"]) == (2, 2, 2)
    assert shape(["-tp", "2", "-dp", "4"]) == (4, 2, 1)
    assert shape(["-tp", "2", "-dp", "4", "--enable-expert-parallel"]) == (1, 2, 4)
    assert shape(["--enable-expert-parallel", "-dp", "8"]) == (1, 1, 8)
    assert shape(["-tp", "8"]) == (1, 8, 1)


BAD_FLAGS = [  # argv, words the error must contain (flag and value, then the expectation)
    (["--mesh", "2,2,2", "-tp", "2"], ["--mesh='2,2,2' and --tensor-parallel-size", "expected one of them"]),
    (["--mesh", "1,1,1", "--enable-expert-parallel"], ["--mesh='1,1,1' and --enable-expert-parallel",
                                                       "expected one of them"]),
    (["--mesh", "2,2,4"], ["--mesh=2,2,4: 16 devices", "expected at most the 8 local cpu device(s)"]),
    (["-tp", "4", "-dp", "4"], ["--tensor-parallel-size=4 x --data-parallel-size=4: 16 devices",
                                "expected at most the 8 local cpu device(s)"]),
    (["-tp", "4", "-dp", "4", "--enable-expert-parallel"], ["16 devices", "at most the 8 local"]),
    (["--mesh", "2,2"], ["--mesh='2,2'", "expected DATA,TENSOR,EXPERT, three ints >= 1"]),
    (["--mesh", "2,2,2,1"], ["--mesh='2,2,2,1'", "expected DATA,TENSOR,EXPERT"]),
    (["--mesh", "a,b,c"], ["--mesh='a,b,c'", "expected DATA,TENSOR,EXPERT"]),
    (["--mesh", "2,0,1"], ["--mesh='2,0,1'", "three ints >= 1"]),
    (["--mesh", "2x2x2"], ["--mesh='2x2x2'", "expected DATA,TENSOR,EXPERT"]),
    (["--mesh", ""], ["--mesh=''", "expected DATA,TENSOR,EXPERT"]),
    (["-tp", "0"], ["--tensor-parallel-size=0: expected >= 1"]),
    (["--data-parallel-size", "-2"], ["--data-parallel-size=-2: expected >= 1"]),
]


@pytest.mark.parametrize("argv,words", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_mesh_flags_name_flag_value_and_expectation(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, devices=jax.devices())
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (argv, err)


def test_mesh_shape_raises_value_errors():
    """``mesh_shape`` itself (what ``parse_args`` reports through argparse) raises ValueError."""
    args = parse_args([], devices=jax.devices())
    args.mesh, args.tensor_parallel_size = "1,2,2", 2
    with pytest.raises(ValueError, match=r"--mesh='1,2,2' and --tensor-parallel-size: expected one of them"):
        mesh_shape(args, 8, "cpu")
    args.tensor_parallel_size = None
    assert mesh_shape(args, 4, "cpu") == (1, 2, 2)
    with pytest.raises(ValueError, match=r"--mesh=1,2,2: 4 devices, expected at most the 2 local gpu device\(s\)"):
        mesh_shape(args, 2, "gpu")
    args.mesh = None
    assert mesh_shape(args, 4, "gpu") == (4, 1, 1)  # accelerator default: every device along data


@pytest.fixture(scope="module")
def cores_url(serve_helpers):
    """A server of two engine cores (``-dp 2``: one simulated device each) and the group."""
    from r3jax.engine.group import EngineGroup

    group = EngineGroup(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)), data=2, **ENGINE_KW)
    try:
        with serve_helpers.thread_server(create_app(group)) as s:
            yield s.url, group
    finally:
        group.close()


def test_engine_cores_serve_like_one_device(servers, cores_url, tmp_path):
    """``-dp 2``: two engine cores behind one server answer like one device, report themselves in
    ``/v1/stats`` and take a weight push together."""
    from r3jax.train import export_params

    one_url, _, _ = servers
    url, group = cores_url
    reqs = requests()
    with RemoteInferenceClient(one_url) as a, RemoteInferenceClient(url) as b:
        for x, y in zip(a.generate(reqs), b.generate(reqs)):
            assert y.output_ids == x.output_ids
            np.testing.assert_allclose(y.logprobs, x.logprobs, rtol=0, atol=1e-5)
            if x.routed_experts is not None:
                np.testing.assert_array_equal(y.routed_experts, x.routed_experts)
        stats = httpx.get(url + "/v1/stats", timeout=30).json()
        assert stats["mesh"] == {"data": 2, "tensor": 1, "expert": 1, "devices": 2, "engine_cores": 2,
                                 "expert_parallel": None}
        assert [c["requests"] > 0 for c in stats["engine"]["cores"]] == [True, True]
        flipped = jax.tree.map(lambda x: -np.asarray(x), nnx.state(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)),
                                                                     nnx.Param))
        v = group.weight_version
        assert b.update_weights(str(export_params(tmp_path / "w", flipped)), "orbax") == [v + 1]
        assert [core.weight_version for core in group.cores] == [v + 1, v + 1]


def test_data_parallel_flags_build_engine_cores():
    from r3jax.engine.group import EngineGroup
    from r3jax.serve.app import mesh_info
    from r3jax.serve.server import build_engine

    args = parse_args(["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-seq-len", "64",
                       "--max-batch-size", "4"], devices=jax.devices())
    assert args.mesh_shape == (2, 2, 1)
    eng = build_engine(args)  # built, not warmed up: nothing compiles
    try:
        assert isinstance(eng, EngineGroup) and [c.placement.describe() for c in eng.cores] == \
            [{"devices": 2, "data": 1, "tensor": 2, "expert": 1}] * 2
        info = mesh_info(eng)
        assert {k: info[k] for k in ("data", "tensor", "expert", "devices", "engine_cores")} == \
            {"data": 2, "tensor": 2, "expert": 1, "devices": 4, "engine_cores": 2}
    finally:
        eng.close()


def test_a_mesh_that_replicates_an_array_is_refused_unless_allowed():
    """tensor = 4 does not divide the tiny model's 2 kv heads: the server refuses the mesh naming the
    array, and ``--allow-replication`` serves it with one warning."""
    from models.axes import ReplicationError
    from r3jax.serve.server import build_engine

    base = ["--mesh", "1,4,1", "--max-seq-len", "64", "--max-batch-size", "4"]
    with pytest.raises(ReplicationError, match=r"tensor=4 divides none of dim \d \(kv_heads\) = 2 \(2 heads\)"):
        build_engine(parse_args(base, devices=jax.devices()))
    with pytest.warns(UserWarning, match=r"allow_replication=True: .*tensor=4 divides none"):
        eng = build_engine(parse_args(base + ["--allow-replication"], devices=jax.devices()))
    try:
        assert eng.placement.describe() == {"devices": 4, "data": 1, "tensor": 4, "expert": 1}
    finally:
        eng.close()


def test_a_checkpoint_loads_into_its_shards_never_whole_on_one_device(tmp_path, monkeypatch):
    """``--model HF_DIR`` on the (1, 2, 4) mesh: the model build_model reads is host arrays, so when the
    engine places the weights no device holds any of them; afterwards device 0 holds only its own
    shards (a fraction of the model) and every weight equals the checkpoint's."""
    from models.hf import save_pretrained
    from r3jax.engine.sharding import Placement
    from r3jax.serve.server import build_engine

    model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(3))
    save_pretrained(model, tmp_path / "hf")
    want = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    del model
    d0 = jax.devices()[0]
    on_d0 = lambda arrays: sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == d0)
    old = jax.live_arrays()  # held, so no new array can take one of their ids
    new_on_d0 = lambda: on_d0(a for a in jax.live_arrays() if id(a) not in {id(b) for b in old})
    seen, real = [], Placement.params

    def spy(self, tree, like=None):  # what the engine is given to place, and device 0 at that moment
        seen.append(({type(x) for x in jax.tree.leaves(tree)}, new_on_d0()))
        return real(self, tree, like)

    monkeypatch.setattr(Placement, "params", spy)
    args = parse_args(["--model", str(tmp_path / "hf"), *EP_FLAGS, "--max-seq-len", "64", "--max-batch-size", "4"],
                      devices=jax.devices())
    eng = build_engine(args)  # built, not warmed up: nothing compiles
    try:
        (kinds, grown), = seen
        assert kinds == {np.ndarray} and grown == 0, seen
        got = jax.tree.leaves(eng._params)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)
        total = sum(w.nbytes for w in want)
        assert on_d0(got) < 0.5 * total, (on_d0(got), total)  # experts over expert = 4, heads over tensor = 2
    finally:
        eng.close()
