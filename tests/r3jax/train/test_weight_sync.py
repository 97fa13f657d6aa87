"""Weight sync: standalone params export/load (``r3jax.params_io``, also under ``r3jax.train``), the
remote POST /v1/weights contract, and the in-process engine handoff with weight_version recorded on
new rollouts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

import models
from r3jax import params_io, train

REPO = Path(__file__).resolve().parents[3]


def _same(a, b):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def test_export_and_load_params_round_trip(tiny, tx, tmp_path):
    cfg, model = tiny
    state = train.init_train_state(model, tx)
    path = train.export_params(tmp_path / "w", state)
    other = models.MoeTransformer(cfg, rngs=nnx.Rngs(77))
    assert not _same(nnx.state(other, nnx.Param), state.params)
    assert train.load_params(path, other) is other
    assert _same(nnx.state(other, nnx.Param), state.params)
    wrong = models.MoeTransformer(cfg.replace(num_experts=4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"does not hold this model's params: moe_layers/mlp/down_proj "
                                         r"has shape \(2, 8, 64, 64\), expected \(2, 4, 64, 64\)"):
        train.load_params(path, wrong)
    unrolled = models.MoeTransformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"dense_layers/.* is not a parameter of the model \(the file holds "
                                         r"scanned layers; the model has scan_layers=False\)"):
        train.load_params(path, unrolled)
    with pytest.raises(ValueError, match=r"expected an orbax params directory"):
        train.load_params(tmp_path / "missing", other)


def test_train_and_params_io_share_one_implementation():
    assert train.export_params is params_io.export_params and train.load_params is params_io.load_params


def test_load_params_refuses_directories_without_params_metadata(tiny, tmp_path):
    """orbax reports no item metadata (and logs a warning) for a directory without a readable
    ``_METADATA``: that, and only that, is "not an orbax params directory"."""
    cfg, model = tiny
    path = train.export_params(tmp_path / "w", model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    shutil.copytree(path, tmp_path / "garbled")
    (tmp_path / "garbled" / "_METADATA").write_text("not json {")
    target = models.MoeTransformer(cfg, rngs=nnx.Rngs(3))
    for name in ("empty", "hf", "garbled"):
        with pytest.raises(ValueError, match=r"expected an orbax params directory written by export_params "
                                             r"\(no readable orbax item metadata there\)"):
            params_io.load_params(tmp_path / name, target)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's orphaned read futures
def test_load_params_lets_read_errors_through(tiny, tmp_path):
    """Metadata fine, array data gone: orbax's own read error propagates, not dressed up as a
    'not a params directory' ValueError."""
    cfg, model = tiny
    path = train.export_params(tmp_path / "w", model)
    for f in path.iterdir():
        if f.name.startswith("ocdbt.process_"):
            shutil.rmtree(f)
    with pytest.raises(Exception) as err:
        params_io.load_params(path, models.MoeTransformer(cfg, rngs=nnx.Rngs(3)))
    assert "expected an orbax params directory" not in str(err.value)
    assert "reading array" in str(err.value)


def test_serve_reads_params_files_without_importing_the_trainer(tiny, tmp_path):
    """``python -m r3jax serve --model ORBAX_DIR`` and ``POST /v1/weights`` go through
    ``r3jax.serve.weights``: it must not pull in ``r3jax.train``."""
    _, model = tiny
    path = train.export_params(tmp_path / "w", model)
    code = (f"import sys; from r3jax.serve import weights; m = weights.build_model({str(path)!r}, config='tiny'); "
            "bad = sorted(n for n in sys.modules if n.startswith('r3jax.train')); "
            "assert not bad, bad; print('ok', type(m).__name__)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "XLA_FLAGS": os.environ.get("R3JAX_TEST_XLA_FLAGS", "")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok MoeTransformer" in proc.stdout, proc.stderr[-2000:]


def test_push_to_server_posts_the_export_and_returns_the_version(tiny, tmp_path):
    _, model = tiny
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"weight_version": 7})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    version = train.push_to_server("http://trainer.test/", tmp_path / "v1", model, api_key="k3y",
                                   client=client)
    assert version == 7
    [req] = seen
    assert req.method == "POST" and str(req.url) == "http://trainer.test/v1/weights"
    assert req.headers["authorization"] == "Bearer k3y"
    body = json.loads(req.content)
    assert body == {"path": str((tmp_path / "v1").absolute()), "format": "orbax"}
    loaded = train.load_params(body["path"], models.MoeTransformer(model.config, rngs=nnx.Rngs(5)))
    assert _same(nnx.state(loaded, nnx.Param), nnx.state(model, nnx.Param))

    bad = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"ok": True})))
    with pytest.raises(ValueError, match=r"expected JSON \{\"weight_version\": int\}"):
        train.push_to_server("http://trainer.test", tmp_path / "v2", model, client=bad)
    down = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(503, json={})))
    with pytest.raises(httpx.HTTPStatusError):
        train.push_to_server("http://trainer.test", tmp_path / "v3", model, client=down)


def test_push_to_engine_advances_weight_version(tiny, engine, rollout_batch, make_rollout_batch, tx,
                                               train_cfg):
    _, model = tiny
    old = train.init_train_state(model, tx)
    state, _ = train.train_step(train.init_train_state(model, tx), rollout_batch, config=train_cfg)
    before = engine.weight_version
    version = train.push_to_engine(engine, state)
    assert version == before + 1 == engine.weight_version
    try:
        batch, versions = make_rollout_batch(engine, seed=1)
    finally:
        train.push_to_engine(engine, model)  # leave the shared engine on the original weights
    assert versions == [version] * 4  # trajectories record the version they were sampled with
    # the engine sampled from the trained params: the trainer reproduces its logprobs and routes
    new_m = train.eval_step(state, batch)
    assert float(new_m["mean_abs_delta"]) < 1e-5 and float(new_m["live_routing_disagreement"]) == 0.0
    assert float(train.eval_step(old, batch)["mean_abs_delta"]) > 1e-4


def test_in_process_sync_to_a_multi_device_engine_survives_donated_train_steps(tiny, tx, rollout_batch8):
    """The engine owns copies: a trainer replicated over 8 devices pushes to an engine on a 2-device
    mesh, then donated train steps run; before, the engine's device-0 buffers were views of the
    trainer's and were deleted with them ("Array has been deleted" in the engine's next prefill)."""
    from r3jax.engine import Engine, GenerateRequest
    from r3jax.engine.sharding import make_mesh as engine_mesh
    from r3jax.sharding import make_mesh, shard_batch

    cfg, model = tiny
    engine = Engine(model, mesh=engine_mesh(data=1, tensor=2, devices=jax.devices()[:2]), max_seq_len=32, max_batch_size=2,
                    prefix_cache_bytes=0, block_size=8, prefill_chunk=16, moe_impl="dense")
    try:
        mesh = make_mesh(data=-1)
        state = train.init_train_state(model, tx, mesh=mesh)
        req = GenerateRequest([1, 2, 3], max_tokens=3, temperature=0.0, return_routed_experts=True)
        for _ in range(2):
            version = train.push_to_engine(engine, state)
            state, _ = train.train_step(state, shard_batch(rollout_batch8, mesh), replay="rollout")  # donates
            [out] = engine.generate([req])
            assert out.weight_version == version and len(out.output_ids) == 3
        reference = models.MoeTransformer(cfg, rngs=nnx.Rngs(0))
        nnx.update(reference, jax.device_get(params_io.weights_of(state)))
        assert not _same(nnx.state(reference, nnx.Param), nnx.state(model, nnx.Param))  # training moved them
    finally:
        engine.close()


def test_push_to_engine_moves_sharded_weights_device_to_device(tiny, tx, monkeypatch):
    """Trainer params sharded on a (data, fsdp, expert) = (2, 2, 2) mesh over all 8 devices, pushed to
    an engine on a (tensor, expert) = (2, 2) mesh over 4 of them: no weight is read back to the host
    (``jax.device_put`` alone would copy each one through it), the engine's params carry the engine's
    own shardings and the trainer's values, and its greedy rollouts equal an engine built directly
    from those weights on the same mesh."""
    import jax._src.array as jax_array

    from r3jax.engine import Engine, GenerateRequest
    from r3jax.engine.sharding import make_mesh as engine_mesh
    from r3jax.sharding import make_mesh

    cfg, model = tiny
    trained = models.MoeTransformer(cfg, rngs=nnx.Rngs(5))  # other weights than the engine's
    state = train.init_train_state(trained, tx, mesh=make_mesh(data=2, fsdp=2, expert=2))
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(state.params))  # really sharded on the trainer's mesh
    mesh = engine_mesh(data=1, tensor=2, expert=2, devices=jax.devices()[4:])
    kw = dict(mesh=mesh, max_seq_len=32, max_batch_size=1, prefill_rows=1, prefill_chunk=16, block_size=8,
              prefix_cache_bytes=0)
    engine, reference = Engine(model, **kw), Engine(trained, **kw)
    try:
        shardings = lambda tree: [x.sharding for x in jax.tree.leaves(tree)]
        want = shardings(engine._params)
        reads = []  # every host read of a device array goes through ArrayImpl._value
        value = jax_array.ArrayImpl._value
        monkeypatch.setattr(jax_array.ArrayImpl, "_value",
                            property(lambda a: (reads.append(a.shape), value.fget(a))[1]))
        version = train.push_to_engine(engine, state)
        jax.block_until_ready(engine._params)
        monkeypatch.undo()
        assert reads == [] and version == 1
        assert shardings(engine._params) == want and all(s.mesh == mesh for s in want)
        assert _same(engine._params, state.params)
        assert _same(engine._params, reference._params)
        req = GenerateRequest([3, 1, 4, 1, 5], max_tokens=6, temperature=0.0, return_routed_experts=True)
        [got], [ref] = engine.generate([req]), reference.generate([req])
        assert got.output_ids == ref.output_ids and got.weight_version == 1
        np.testing.assert_array_equal(np.asarray(got.routed_experts), np.asarray(ref.routed_experts))
    finally:
        engine.close()
        reference.close()
