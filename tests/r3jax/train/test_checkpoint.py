"""Orbax checkpoints: bit-identical resume, keep-k / every-N, data cursor, restore onto another mesh,
interrupted and damaged steps (truncated, missing or overwritten in place) skipped with a warning, a
different state or a permission error refused without touching the directory, a transient read
error retried, failed writes raised, changed settings logged."""

import errno
import logging
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import models
from r3jax import train
from r3jax.sharding import make_mesh


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _at_step(state, step):
    return state.replace(step=jax.device_put(np.int32(step), state.step.sharding))


def _fresh_template(tx, mesh=None, **cfg_overrides):
    """A state built from a differently initialised model: restore must overwrite every leaf."""
    cfg = models.MoeConfig.tiny(**cfg_overrides)
    return train.init_train_state(models.MoeTransformer(cfg, rngs=nnx.Rngs(123)), tx, mesh=mesh, seed=9)


def test_resume_after_crash_is_bit_identical(tiny, rollout_batch, tx, train_cfg, tmp_path):
    _, model = tiny
    batches = [rollout_batch, rollout_batch.replace(advantages=-rollout_batch.advantages)]

    # Uninterrupted run, checkpointing every 2 steps with async saves (the step right after a save
    # donates the buffers that were just saved).
    ckpt = train.Checkpointer(tmp_path / "a", save_every=2, keep=2)
    state, reference = train.init_train_state(model, tx, seed=3), {}
    for step in range(4):
        state, _ = train.train_step(state, batches[step % 2], config=train_cfg)
        ckpt.save(state, data_cursor={"next_batch": step + 1})
        reference[step + 1] = _leaves((state.params, state.opt_state, state.rng))
    ckpt.close()
    # the async step-2 save was taken before step 3 donated those buffers
    a2, _ = train.Checkpointer(tmp_path / "a").restore(2, _fresh_template(tx))
    got = _leaves((a2.params, a2.opt_state, a2.rng))
    assert len(got) == len(reference[2]) and all(np.array_equal(x, y) for x, y in zip(got, reference[2]))

    # Run that "crashes" right after the step-2 save: nothing but the directory survives.
    crash = train.Checkpointer(tmp_path / "b", save_every=2, keep=2)
    state = train.init_train_state(model, tx, seed=3)
    for step in range(2):
        state, _ = train.train_step(state, batches[step % 2], config=train_cfg)
        crash.save(state, data_cursor={"next_batch": step + 1})
    crash.close()
    del state, crash

    resumed = train.Checkpointer(tmp_path / "b", save_every=2, keep=2)
    state, cursor = resumed.restore_latest(_fresh_template(tx))
    assert int(state.step) == 2 and cursor == {"next_batch": 2}
    got = _leaves((state.params, state.opt_state, state.rng))
    assert len(got) == len(reference[2]) and all(np.array_equal(a, b) for a, b in zip(got, reference[2]))
    for step in range(cursor["next_batch"], 4):
        state, _ = train.train_step(state, batches[step % 2], config=train_cfg)
        got = _leaves((state.params, state.opt_state, state.rng))
        assert all(np.array_equal(a, b) for a, b in zip(got, reference[step + 1])), f"step {step + 1}"
    assert int(state.step) == 4
    resumed.close()
    assert sorted(os.listdir(tmp_path / "a")) == ["2", "4"]


def test_every_n_keep_k_and_cursor_validation(tiny, tx, tmp_path):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, save_every=2, keep=2, async_save=False) as ckpt:
        saved = [ckpt.save(_at_step(state, s), data_cursor=s) for s in range(1, 8)]
        assert saved == [False, True, False, True, False, True, False]
        assert ckpt.all_steps() == [4, 6]
        with pytest.raises(ValueError, match=r"data_cursor=.*expected a JSON-serialisable value"):
            ckpt.save(_at_step(state, 8), data_cursor=object())
    with pytest.raises(ValueError, match=r"save_every=0: expected an int >= 1"):
        train.Checkpointer(tmp_path, save_every=0)


def test_restore_onto_a_different_mesh(tiny, tx, tmp_path):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(_at_step(state, 1), data_cursor=[1, 2])
        mesh = make_mesh(2, 2, 2)
        restored, cursor = ckpt.restore_latest(_fresh_template(tx, mesh))
    assert cursor == [1, 2]
    gate = restored.params["moe_layers"]["mlp"]["gate_proj"][...]  # [L, E, D, I]
    assert gate.sharding.mesh == mesh and gate.sharding.spec == jax.sharding.PartitionSpec(None, ("expert", "fsdp"), None, None)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(restored.params), _leaves(state.params)))


def _truncate_arrays(step_dir):
    n = 0
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            if os.path.basename(root) == "d":  # OCDBT data files
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(2)
                n += 1
    assert n > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: failed read
def test_damaged_and_interrupted_steps_are_skipped(tiny, tx, tmp_path):
    _, model = tiny
    state = train.init_train_state(model, tx)
    ckpt = train.Checkpointer(tmp_path, keep=5, async_save=False)
    for s in (2, 4):
        ckpt.save(_at_step(state, s), data_cursor=s, force=True)
    # An interrupted save: orbax's temporary directory, and a step directory never committed.
    shutil.copytree(tmp_path / "4", tmp_path / "6.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(tmp_path / "4", tmp_path / "8")
    os.remove(tmp_path / "8" / "commit_success.txt")
    assert ckpt.all_steps() == [2, 4]
    _truncate_arrays(tmp_path / "4")  # the newest complete step is damaged

    with pytest.warns(RuntimeWarning) as caught:
        restored, cursor = ckpt.restore_latest(_fresh_template(tx))
    messages = [str(w.message) for w in caught]
    assert any("step 8" in m and "commit_success.txt" in m for m in messages), messages
    assert any("step 4" in m and "could not be read" in m and "OUT_OF_RANGE" in m for m in messages), messages
    assert cursor == 2 and int(restored.step) == 2
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(restored.params), _leaves(state.params)))
    assert (tmp_path / "4.damaged").is_dir() and (tmp_path / "8.damaged").is_dir()
    # training goes on and step 4 can be saved again
    assert ckpt.save(_at_step(state, 4), data_cursor=4) and ckpt.all_steps() == [2, 4]
    ckpt.close()


def test_empty_directory_restores_nothing(tiny, tx, tmp_path):
    with train.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore_latest(_fresh_template(tx)) is None


def _listing(root):
    """Every path under ``root`` with its size and mtime: 'unchanged' means byte-for-byte untouched."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            st = os.stat(os.path.join(dirpath, name))
            out.append((os.path.relpath(os.path.join(dirpath, name), root), st.st_size, st.st_mtime_ns))
    return sorted(out)


def test_restore_into_a_different_state_raises_and_touches_nothing(tiny, tx, tmp_path):
    _, model = tiny
    with train.Checkpointer(tmp_path, async_save=False) as ckpt:
        for s in (1, 2):
            ckpt.save(_at_step(train.init_train_state(model, optax.adam(1e-3)), s), data_cursor=s)
    before = _listing(tmp_path)
    assert [p for p, *_ in before if "/" not in p] == ["1", "2"]

    ckpt = train.Checkpointer(tmp_path)
    # another optimizer: adam's mu/nu/count on disk, sgd-with-momentum's trace in the template
    with pytest.raises(ValueError) as e:
        ckpt.restore_latest(_fresh_template(optax.sgd(0.1, momentum=0.9)))
    assert isinstance(e.value, train.CheckpointMismatchError)
    msg = str(e.value)
    assert f"checkpoint step 2 in {tmp_path}" in msg and "Nothing on disk was changed" in msg
    assert e.value.differences == ["opt_state/0/count: only in the checkpoint",
                                   "opt_state/0/mu: only in the checkpoint",
                                   "opt_state/0/nu: only in the checkpoint",
                                   "opt_state/0/trace: only in the template"]
    # another model config: the same tree with other shapes, each leaf named with both shapes
    with pytest.raises(train.CheckpointMismatchError,
                       match=r"params/embed: checkpoint float32\[272, 64\], template float32\[300, 64\]"):
        ckpt.restore_latest(_fresh_template(optax.adam(1e-3), vocab_size=300))
    # another dtype (orbax would silently cast it)
    with pytest.raises(train.CheckpointMismatchError,
                       match=r"params/embed: checkpoint float32\[272, 64\], template bfloat16\[272, 64\]"):
        ckpt.restore(2, _fresh_template(optax.adam(1e-3), param_dtype=jax.numpy.bfloat16))
    assert _listing(tmp_path) == before  # no step quarantined, renamed or rewritten
    state, cursor = ckpt.restore_latest(_fresh_template(optax.adam(1e-3)))  # the right template still works
    assert cursor == 2 and int(state.step) == 2
    ckpt.close()


def _corrupt_meta_json(step_dir):
    (step_dir / "meta" / "metadata").write_text("{not json")


def _remove_array_files(step_dir):
    shutil.rmtree(step_dir / "state" / "d")


@pytest.mark.parametrize("damage", [_corrupt_meta_json, _remove_array_files, _truncate_arrays])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: failed read
def test_unreadable_newest_step_is_quarantined_and_the_previous_restored(tiny, tx, tmp_path, damage):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for s in (3, 6):
            ckpt.save(_at_step(state, s), data_cursor=s, force=True)
    damage(tmp_path / "6")
    with train.Checkpointer(tmp_path) as ckpt, pytest.warns(RuntimeWarning, match=r"step 6 .* could not be read"):
        restored, cursor = ckpt.restore_latest(_fresh_template(tx))
    assert cursor == 3 and int(restored.step) == 3
    assert sorted(os.listdir(tmp_path)) == ["3", "6.damaged"]


def test_write_into_a_vanished_directory_raises_at_the_next_save(tiny, tx, tmp_path):
    _, model = tiny
    state = train.init_train_state(model, tx)
    d = tmp_path / "ckpt"
    ckpt = train.Checkpointer(d, save_every=1)
    assert ckpt.save(_at_step(state, 1), data_cursor=1)
    ckpt.wait()
    # The directory turns unwritable. We run as root, for whom chmod does not stop writes, so put a
    # regular file where the directory was: every write under it fails with ENOTDIR.
    shutil.rmtree(d)
    d.write_text("not a directory")
    with pytest.raises(train.CheckpointWriteError, match=rf"checkpoint save of step 2 to {d} failed "
                                                         r"\(NotADirectoryError"):
        ckpt.save(_at_step(state, 2), data_cursor=2)
    # sticky: the run cannot carry on by ignoring one exception
    with pytest.raises(train.CheckpointWriteError, match="step 2"):
        ckpt.save(_at_step(state, 3), data_cursor=3)
    ckpt.close()  # already reported: closing does not raise it again


def test_background_write_failure_raises_at_the_next_call(tiny, tx, tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    async def disk_full(self):  # the last step of orbax's background commit: rename tmp -> step
        raise OSError(errno.ENOSPC, "No space left on device")

    _, model = tiny
    state = train.init_train_state(model, tx)
    ckpt = train.Checkpointer(tmp_path, save_every=2)
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    assert ckpt.save(_at_step(state, 2), data_cursor=2)  # async: returns before the failure
    with pytest.raises(train.CheckpointWriteError, match=r"step 2 .* failed .*No space left on device"):
        ckpt.wait()
    with pytest.raises(train.CheckpointWriteError):  # and every save after it, due or not
        ckpt.save(_at_step(state, 3), data_cursor=3)
    assert ckpt.all_steps() == []
    ckpt.close()


def test_changed_settings_are_allowed_and_logged(tiny, tx, tmp_path, caplog):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, async_save=False, config={"lr": 1e-3, "env": "echo"}) as ckpt:
        ckpt.save(_at_step(state, 1), data_cursor=1)
    with train.Checkpointer(tmp_path, config={"lr": 3e-4, "env": "echo"}) as ckpt:
        with caplog.at_level(logging.WARNING, logger="r3jax.train.checkpoint"):
            restored, cursor = ckpt.restore_latest(_fresh_template(tx))
    assert cursor == 1 and ckpt.config_changes == {"lr": (1e-3, 3e-4)}
    assert "resuming from checkpoint step 1" in caplog.text and "lr 0.001 -> 0.0003" in caplog.text


def test_a_checkpoint_of_the_other_layer_layout_is_named_and_still_restores(tx, tmp_path):
    """A checkpoint with unrolled layers (params/layers/{i}: scan_layers=False, or one written before
    scanned layers became the default) restored into a scanned state: refused, the message says which
    layout it holds and how to load it, nothing on disk changes, and the advice works."""
    from models import stacking

    unrolled_cfg = models.MoeConfig.tiny(scan_layers=False)
    unrolled = train.init_train_state(models.MoeTransformer(unrolled_cfg, rngs=nnx.Rngs(0)), tx, seed=1)
    with train.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(_at_step(unrolled, 4), data_cursor=4)
    before = _listing(tmp_path)
    ckpt = train.Checkpointer(tmp_path)
    with pytest.raises(train.CheckpointMismatchError) as e:
        ckpt.restore_latest(_fresh_template(tx))
    assert "params/layers: only in the checkpoint" in e.value.differences
    assert "params/moe_layers: only in the template" in e.value.differences
    assert "The checkpoint's layers are unrolled (params/layers/{i}" in str(e.value)
    assert "restore it into a state built with scan_layers=False" in str(e.value)
    assert _listing(tmp_path) == before
    # the advice: restore with scan_layers=False, then stack the parameters for the scanned model
    state, cursor = ckpt.restore_latest(_fresh_template(tx, scan_layers=False))
    ckpt.close()
    assert cursor == 4 and all(np.array_equal(a, b) for a, b in zip(_leaves(state.params), _leaves(unrolled.params)))
    scanned = models.MoeTransformer(models.MoeConfig.tiny(), rngs=nnx.Rngs(0))  # same seed: same numbers
    pure = jax.device_get(nnx.to_pure_dict(state.params) if isinstance(state.params, nnx.State) else state.params)
    stacked = stacking.stack_layers(pure, unrolled_cfg)
    want = jax.device_get(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)))
    got_leaves = jax.tree_util.tree_leaves_with_path(stacked)
    assert len(got_leaves) == len(jax.tree.leaves(want))
    for (path, a), b in zip(got_leaves, jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _overwrite(paths, fill, start=0.0):
    """Overwrite each file's bytes from ``start`` (a fraction of its size) to the end, same size."""
    rng = np.random.default_rng(0)
    for p in paths:
        n = p.stat().st_size
        lo = int(n * start)
        data = rng.integers(0, 256, n - lo, dtype=np.uint8).tobytes() if fill == "random" else bytes(n - lo)
        with open(p, "r+b") as fh:
            fh.seek(lo)
            fh.write(data)
    assert paths


def _chunks_random(step_dir):  # the arrays' data (zarr chunks in OCDBT value files)
    _overwrite(sorted((step_dir / "state" / "ocdbt.process_0" / "d").iterdir()), "random")


def _chunks_zero(step_dir):
    _overwrite(sorted((step_dir / "state" / "ocdbt.process_0" / "d").iterdir()), "zero")


def _index_body_random(step_dir):  # the OCDBT b-tree node past its header: zstd "Data corruption detected"
    _overwrite(sorted((step_dir / "state" / "d").iterdir()), "random", start=0.125)


@pytest.mark.parametrize("damage", [_chunks_random, _chunks_zero, _index_body_random])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: failed read
def test_data_overwritten_in_place_is_quarantined_and_the_previous_restored(tiny, tx, tmp_path, damage):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for s in (3, 6):
            ckpt.save(_at_step(state, s), data_cursor=s, force=True)
    before = {p: (sz, t) for p, sz, t in _listing(tmp_path / "6")}
    damage(tmp_path / "6")
    assert {p: sz for p, sz, _ in _listing(tmp_path / "6")} == {p: sz for p, (sz, _) in before.items()}  # same size
    with train.Checkpointer(tmp_path) as ckpt, pytest.warns(RuntimeWarning, match=r"step 6 .* could not be read"):
        restored, cursor = ckpt.restore_latest(_fresh_template(tx))
    assert cursor == 3 and int(restored.step) == 3
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(restored.params), _leaves(state.params)))
    assert sorted(os.listdir(tmp_path)) == ["3", "6.damaged"]


def _deny_meta_read(monkeypatch, step_dir):
    """orbax's read of the step's meta JSON fails with EACCES (we run as root: chmod cannot)."""
    import orbax.checkpoint as ocp

    real = ocp.JsonCheckpointHandler.restore
    denied = step_dir / "meta" / "metadata"

    def restore(self, directory, *a, **kw):
        if str(directory) == str(denied.parent):
            raise PermissionError(errno.EACCES, "Permission denied", str(denied))
        return real(self, directory, *a, **kw)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "restore", restore)
    return denied


def _deny_array_read(monkeypatch, step_dir):
    """The arrays' read fails with EACCES (orbax wraps it in a bare Exception)."""
    from orbax.checkpoint._src.serialization import serialization

    denied = sorted((step_dir / "state" / "ocdbt.process_0" / "d").iterdir())[0]

    async def read_shard(t, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(denied))

    monkeypatch.setattr(serialization, "_read_shard", read_shard)
    return denied


@pytest.mark.parametrize("deny", [_deny_meta_read, _deny_array_read])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: failed read
def test_permission_error_during_restore_raises_naming_the_path_and_touches_nothing(
        tiny, tx, tmp_path, monkeypatch, deny):
    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for s in (3, 6):
            ckpt.save(_at_step(state, s), data_cursor=s, force=True)
    before = _listing(tmp_path)
    denied = deny(monkeypatch, tmp_path / "6")
    ckpt = train.Checkpointer(tmp_path)
    with pytest.raises(train.CheckpointReadError) as e:
        ckpt.restore_latest(_fresh_template(tx))
    ckpt.close()
    assert isinstance(e.value, OSError) and e.value.path == str(denied) and e.value.step == 6
    assert f"checkpoint step 6 in {tmp_path} could not be read: {denied} (PermissionError" in str(e.value)
    assert "nothing on disk was changed" in str(e.value)
    assert _listing(tmp_path) == before  # every step directory as it was: no .damaged


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: failed read
def test_unreadable_data_directory_raises_naming_it(tiny, tx, tmp_path):
    _, model = tiny
    with train.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for s in (3, 6):
            ckpt.save(_at_step(train.init_train_state(model, tx), s), data_cursor=s, force=True)
    before = _listing(tmp_path)
    denied = tmp_path / "6" / "state" / "ocdbt.process_0" / "d"
    denied.chmod(0)
    try:
        with train.Checkpointer(tmp_path) as ckpt, pytest.raises(train.CheckpointReadError) as e:
            ckpt.restore_latest(_fresh_template(tx))
    finally:
        denied.chmod(0o755)
    assert e.value.path == str(denied) and "PermissionError" in str(e.value)
    assert _listing(tmp_path) == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax: failed read
def test_a_transient_read_error_is_retried_not_quarantined(tiny, tx, tmp_path, monkeypatch):
    from orbax.checkpoint._src.serialization import serialization

    _, model = tiny
    state = train.init_train_state(model, tx)
    with train.Checkpointer(tmp_path, keep=5, async_save=False) as ckpt:
        for s in (3, 6):
            ckpt.save(_at_step(state, s), data_cursor=s, force=True)
    real, calls = serialization._read_shard, []

    async def flaky(t, **kw):  # tensorstore reports every failure as ValueError
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("UNAVAILABLE: the storage did not answer")
        return await real(t, **kw)

    monkeypatch.setattr(serialization, "_read_shard", flaky)
    with train.Checkpointer(tmp_path) as ckpt:
        restored, cursor = ckpt.restore_latest(_fresh_template(tx))
    assert cursor == 6 and int(restored.step) == 6
    assert sorted(os.listdir(tmp_path)) == ["3", "6"]
