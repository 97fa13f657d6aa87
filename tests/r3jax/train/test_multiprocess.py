"""Two processes of 4 simulated CPU devices (jax.distributed over a loopback coordinator, gloo
collectives) train exactly like one process of 8: same loss and metrics, same new parameters, bit
for bit; checkpoints written by either restore in the other.

Why the 8-device reference is a subprocess too: this pytest process's devices use XLA's in-process
CPU collectives, which sum an all-reduce in another order than gloo (last-bit differences in about
40% of the elements of an 8-way sum); a single process that joins a 1-process job uses gloo for its
8 devices. ``NPROC=8`` fixes XLA's CPU thread pool size, which otherwise follows the local device
count (4 vs 8) and changes how the replicated expert matmuls are blocked.
"""

import json
import os
import shutil
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import models
from experiments.synthetic import synthetic_rows
from r3jax.sharding import make_mesh
from r3jax.train import Checkpointer
from r3jax.train.cli import build_state
from r3jax.train.local_job import LocalJob

ROOT = Path(__file__).resolve().parents[3]
MESH = "1,4,2"  # fsdp spans both processes: every parameter is split between them
ROWS, BATCH = 16, 8  # step 1 trains rows 0-7, step 2 rows 8-15



def _truncate_arrays(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        if os.path.basename(root) == "d":  # OCDBT data files
            for f in files:
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(2)


def _records(run):
    return [{k: v for k, v in json.loads(x).items() if k != "step_s"}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get((state.params, state.opt_state, state.step,
                                                                    state.rng)))]


def test_two_processes_train_like_one_and_checkpoints_cross_process_counts(tmp_path):
    cfg = models.MoeConfig.tiny()
    rows = synthetic_rows(cfg, tmp_path / "rows", ROWS)
    args = types.SimpleNamespace(config="tiny", seed=0, lr=1e-3)
    # A 1-process checkpoint of the initial state for the 2-process run to resume from, next to an
    # interrupted step (no commit marker) and an unreadable one, which both processes must skip
    # together (process 0 renames them).
    init = build_state(args, make_mesh(*map(int, MESH.split(","))))
    ckpt_dir = tmp_path / "two" / "ckpt"
    with Checkpointer(ckpt_dir, async_save=False) as c:
        c.save(init, data_cursor={"step": 0}, force=True)
        c.save(init.replace(step=init.step + 1), data_cursor={"step": 1}, force=True)
    _truncate_arrays(ckpt_dir / "1")
    shutil.copytree(ckpt_dir / "0", ckpt_dir / "5")
    os.remove(ckpt_dir / "5" / "commit_success.txt")

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", NPROC="8", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=os.environ.get("R3JAX_TEST_XLA_FLAGS", ""))  # this process's codegen: same bits
    common = ["--data", str(rows), "--batch-size", str(BATCH), "--mesh", MESH, "--steps", "2",
              "--compilation-cache", str(ROOT / ".pytest_cache" / "jax-compilation")]
    # Both jobs at once; leaving the block kills whatever still runs (a failure, a timeout).
    with LocalJob(1, common + ["--out", str(tmp_path / "one")], devices_per_process=8, env=env, cwd=ROOT) as j1, \
            LocalJob(2, common + ["--out", str(tmp_path / "two"), "--tensorboard", str(tmp_path / "tb")],
                     devices_per_process=4, env=env, cwd=ROOT) as j2:
        one, two = j1.wait(timeout=240), j2.wait(timeout=240)
    out = two[0].output
    assert "2 process(es), 8 cpu devices" in out and "4 from each process" in out and "resuming at step 0" in out
    assert "checkpoint step 5" in out and "checkpoint step 1" in out and "could not be read" in out
    assert "fresh start" in one[0].output

    # loss and every metric of both steps, bit for bit (JSON round-trips float32 exactly)
    a, b = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a == b
    assert a[0]["loss"] != a[1]["loss"]  # real steps
    # process 0 alone wrote TensorBoard events: one file, its losses those of metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"], rel=1e-6))
                                                                    for r in b]

    # Process 0 alone renamed the damaged steps (a second renamer would have made 5.damaged-1).
    assert sorted(os.listdir(ckpt_dir)) == ["0", "1", "1.damaged", "2", "5.damaged"]
    # New parameters: the 2-process checkpoint restored here (1 process) equals the 1-process one.
    two_state, cursor = Checkpointer(ckpt_dir).restore(2, init)
    one_state, _ = Checkpointer(tmp_path / "one" / "ckpt").restore(2, init)
    assert cursor == {"step": 2} and int(two_state.step) == 2
    got, want, start = _leaves(two_state), _leaves(one_state), _leaves(init)
    assert len(got) == len(want) and all(np.array_equal(x, y) for x, y in zip(got, want))
    assert not all(np.array_equal(x, y) for x, y in zip(got, start))  # training moved them
