"""What the demo does when resuming or checkpointing goes wrong: nothing to resume (says so, starts
fresh, keeps an old log), a checkpoint of another training state (exits 1, touches nothing), a
checkpoint directory that stops taking writes (exits 1 at the next step with the error, no hang)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import optax
import pytest
from flax import nnx

import models
from r3jax import train
from r3jax.demo import main

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--prompts", "2", "--samples", "2", "--warmup-steps", "0", "--max-turns", "2", "--max-tokens", "3",
         "--max-seq-len", "64", "--save-every", "1", "--no-progress", "--in-process", "--replay", "rollout",
         "--seeds", "1", "--decode-buckets", "1"]  # a third of the engine's programs


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_with_nothing_to_resume_says_so_and_keeps_the_old_log(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "rollout" / "seed0").mkdir(parents=True)
    old_log = '{"step": 1, "note": "a run whose checkpoints are gone"}\n'
    (out / "rollout" / "seed0" / "metrics.jsonl").write_text(old_log)
    main(SMALL + ["--steps", "1", "--resume", "--out", str(out)])
    said = capsys.readouterr().out
    assert f"--resume found no checkpoint in {out / 'rollout' / 'seed0' / 'ckpt'}; starting fresh at step 0" in said
    assert _steps(out / "rollout" / "seed0" / "metrics.jsonl") == [1]
    assert (out / "rollout" / "seed0" / "metrics.jsonl.1").read_text() == old_log  # kept, not truncated


def test_resume_from_a_different_training_state_exits_nonzero_and_touches_nothing(tmp_path):
    out = tmp_path / "demo"
    ckpt_dir, log = out / "rollout" / "seed0" / "ckpt", out / "rollout" / "seed0" / "metrics.jsonl"
    # a checkpoint of the same model trained with plain sgd (no optimizer state); the demo uses adam
    model = models.MoeTransformer(models.MoeConfig.tiny(), rngs=nnx.Rngs(0))
    state = train.init_train_state(model, optax.sgd(0.1))
    with train.Checkpointer(ckpt_dir, async_save=False) as ckpt:
        ckpt.save(state.replace(step=state.step + 1), data_cursor={"step": 1}, force=True)
    log.write_text('{"step": 1, "reward": 0.5}\n')
    before = sorted((p, p.stat().st_mtime_ns) for p in ckpt_dir.rglob("*"))
    with pytest.raises(SystemExit) as e:
        main(SMALL + ["--steps", "2", "--resume", "--out", str(out)])
    assert e.value.code not in (0, None)
    msg = str(e.value.code)
    assert msg.startswith("r3jax demo: error: checkpoint step 1 in ") and "holds a different training state" in msg
    assert "opt_state: only in the template" in msg  # adam state vs sgd's none
    assert log.read_text() == '{"step": 1, "reward": 0.5}\n'  # not truncated
    assert sorted((p, p.stat().st_mtime_ns) for p in ckpt_dir.rglob("*")) == before


# The checkpoint directory stops taking writes after the step-1 save. We run as root, for whom chmod
# does not stop writes, so the step-2 save first puts a regular file where the directory was: every
# write under it then fails (ENOTDIR), as a read-only or vanished directory would. Run in a
# subprocess so that a hang at exit (orbax threads waiting forever) fails the test by its timeout.
_BREAK_AT_STEP_2 = """
import shutil, sys
from r3jax import train
from r3jax.demo import main

real_save = train.Checkpointer.save

def save(self, state, **kw):
    if int(state.step) == 2 and self.directory.is_dir():
        self.wait()  # step 1 is on disk; the directory breaks between two saves
        shutil.rmtree(self.directory)
        self.directory.write_text("not a directory any more")
    return real_save(self, state, **kw)

train.Checkpointer.save = save
main(sys.argv[1:])
"""


def test_a_failing_checkpoint_write_stops_the_run_with_the_error(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("R3JAX_TEST_XLA_FLAGS", "")}  # one device: this is about the failure
    proc = subprocess.run([sys.executable, "-c", _BREAK_AT_STEP_2, *SMALL, "--steps", "4", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"r3jax demo: error: checkpoint save of step 2 to {out / 'rollout' / 'seed0' / 'ckpt'} failed "
            "(NotADirectoryError") in proc.stderr, proc.stderr[-3000:]
    assert _steps(out / "rollout" / "seed0" / "metrics.jsonl") == [1]  # stopped at the failing step
