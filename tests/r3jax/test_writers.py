"""Metric writers: metrics.jsonl as before, TensorBoard event files that TensorBoard's own reader reads
back, W&B through the wandb package (a clear error without it), nothing from a non-primary process."""

import json
import sys
import types

import pytest

from r3jax.writers import MetricWriters, crc32c, scalars

RECORDS = [{"step": s, "reward": 0.25 * s, "replay": "rollout", "per_layer": [s, -2.5 * s],
            "nested": {"a": s / 3}, "done": True, "none": None} for s in (1, 2, 3)]


def test_scalars_flatten_numbers_and_leave_the_rest():
    assert scalars(RECORDS[1]) == {"reward": 0.5, "per_layer/0": 2.0, "per_layer/1": -5.0, "nested/a": 2 / 3}


def test_crc32c_known_answers():  # RFC 3720's test vectors
    assert crc32c(b"") == 0 and crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA and crc32c(bytes([0xFF] * 32)) == 0x62A8AB43


def test_tensorboard_reads_back_every_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricWriters(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb") as w:
        for r in RECORDS:
            w.write(r)
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == RECORDS
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["nested/a", "per_layer/0", "per_layer/1", "reward"]
    for tag in events.Tags()["scalars"]:
        want = [(r["step"], pytest.approx(scalars(r)[tag], rel=1e-6)) for r in RECORDS]
        assert [(e.step, e.value) for e in events.Scalars(tag)] == want, tag


def test_wandb_without_the_package_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"--wandb proj: the wandb package is not installed \(pip install wandb\)"):
        MetricWriters(tmp_path / "metrics.jsonl", wandb="proj")


def test_wandb_gets_one_run_with_its_scalars_per_step(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricWriters(tmp_path / "metrics.jsonl", wandb="proj", run_name="rollout-seed0", config={"lr": 1e-3}) as w:
        for r in RECORDS[:2]:
            w.write(r)
    assert calls == [("init", {"project": "proj", "name": "rollout-seed0", "config": {"lr": 1e-3}, "reinit": True}),
                     ("log", 1, scalars(RECORDS[0])), ("log", 2, scalars(RECORDS[1])), ("finish",)]


def test_a_process_other_than_0_writes_nothing(tmp_path):
    with MetricWriters(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb", primary=False) as w:
        w.write(RECORDS[0])
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
