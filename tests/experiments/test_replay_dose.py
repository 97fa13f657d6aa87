"""experiments.replay_dose's grid bookkeeping (resume, summary from stored records, verdicts from CIs),
driven by a stand-in run function: the training runs themselves are the experiment, not a test."""

import json
import math

import numpy as np
import pytest

from experiments import dose_summary as ds
from experiments import replay_dose as rd

FIXED = {"steps": 8, "tis_cap": 2.0}
SETTINGS = [rd.Setting.parse("bf16"), rd.Setting.parse("s0.05-mb4")]
ARMS = ["none", "R3", "TIS"]


def fake_run(calls, *, fail_at=None):
    """Deterministic per-step records whose reward depends on (setting, arm, seed); raises on call fail_at."""
    def run(st, arm, seed):
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt("stopped midway")
        calls.append((st.name, arm, seed))
        rng = np.random.default_rng(abs(hash((st.name, arm, seed))) % 2**32)
        lift = 0.2 if arm == "R3" and st.noise else 0.0  # a real effect in one cell
        recs = []
        for t in range(FIXED["steps"]):
            k3 = float(1e-3 * (1 + st.noise * 40) * (0.2 if arm == "R3" else 1.0) * rng.uniform(0.5, 1.5))
            recs.append({"step": t + 1, "reward": float(0.3 + lift + 0.01 * t + rng.normal(0, 0.01)),
                         "k3_kl": k3, "mean_abs_delta": 10 * k3, "abs_delta_p99": 50 * k3, "abs_delta_max": 80 * k3,
                         "live_routing_disagreement": 0.02 + st.noise, "entropy": 1.0, "importance_weight": 1.0,
                         "clip_fraction": 0.05, "grad_norm": 0.5, "train_s": 1.0 + (arm == "R3") * 0.1,
                         "rollout_s": 2.0})
        return recs
    return run


def test_setting_names_round_trip_and_bad_parts_are_named():
    for name in ("bf16", "int8", "fp8-s0.1", "s0.02", "s0.05-mb8", "sigmoid", "fp8-sigmoid-mb4-ep2"):
        assert rd.Setting.parse(name).name == name
    assert rd.Setting.parse("mb2-bf16") == rd.Setting()  # defaults spelled out
    with pytest.raises(ValueError, match=r"'fp16' is not one of bf16/int8/fp8"):
        rd.Setting.parse("fp16")
    with pytest.raises(ValueError, match=r"part 'mb0'"):
        rd.Setting.parse("s0.1-mb0")


def test_runner_resumes_without_rerunning_finished_runs(tmp_path):
    path = tmp_path / "dose.json"
    first = []
    with pytest.raises(KeyboardInterrupt):
        rd.run_grid(path, FIXED, SETTINGS, ARMS, 3, fake_run(first, fail_at=7), command="t")
    assert len(first) == 7
    stored = json.loads(path.read_text())
    assert sum(len(v) for v in stored["runs"].values()) == 7 and stored["complete"] is False
    # seeds outermost within a setting, arms innermost: 7 runs = seeds 0, 1 of every arm + seed 2 of none
    assert [k for k, c in stored["cells"].items() if c["complete"]] == ["bf16/none"]
    assert stored["comparisons"] == []  # no complete arm beside a complete none yet

    second = []
    result = rd.run_grid(path, FIXED, SETTINGS, ARMS, 3, fake_run(second), command="t")
    assert len(second) == 2 * 3 * 3 - 7 and not set(first) & set(second)  # only the missing runs
    assert result["complete"] is True and all(c["complete"] for c in result["cells"].values())
    third = []
    rd.run_grid(path, FIXED, SETTINGS, ARMS, 3, fake_run(third), command="t")
    assert third == []  # nothing left to run
    # more seeds extend the grid; the old cells become incomplete until the new seeds finish
    fourth = []
    with pytest.raises(KeyboardInterrupt):
        rd.run_grid(path, FIXED, SETTINGS, ARMS, 4, fake_run(fourth, fail_at=1), command="t")
    stored = json.loads(path.read_text())
    assert stored["complete"] is False and stored["cells"]["bf16/R3"]["complete"] is False
    with pytest.raises(SystemExit, match=r"stored grid has steps=8, this run asks 9"):
        rd.run_grid(path, {**FIXED, "steps": 9}, SETTINGS, ARMS, 3, fake_run([]), command="t")


def test_summary_equals_a_recompute_from_the_stored_records(tmp_path):
    path = tmp_path / "dose.json"
    rd.run_grid(path, FIXED, SETTINGS, ARMS, 3, fake_run([]), command="t")
    stored = json.loads(path.read_text())
    again = ds.summarize(stored["runs"], stored["seeds_wanted"], stored["run_provenance"])
    assert json.dumps(again, sort_keys=True) == json.dumps(
        {"cells": stored["cells"], "comparisons": stored["comparisons"]}, sort_keys=True)
    # by hand, one cell: final reward = mean over seeds of the last-quarter mean, with the t CI
    recs = stored["runs"]["s0.05-mb4/R3"]
    finals = [np.mean([r["reward"] for r in rs[-2:]]) for rs in recs.values()]
    cell = stored["cells"]["s0.05-mb4/R3"]
    assert cell["final_reward_mean"] == pytest.approx(np.mean(finals))
    assert cell["final_reward_ci95"] == pytest.approx(4.302653 * np.std(finals, ddof=1) / math.sqrt(3), rel=1e-3)
    assert cell["first_reward_mean"] == pytest.approx(np.mean([[r["reward"] for r in rs[:2]] for rs in recs.values()]))
    assert cell["first_reward_mean"] < cell["final_reward_mean"]  # the stand-in's reward rises 0.01 a step
    # the paired comparison is of the same seeds' runs
    comp = next(c for c in stored["comparisons"] if (c["setting"], c["arm"]) == ("s0.05-mb4", "R3"))
    base = stored["runs"]["s0.05-mb4/none"]
    diffs = [ds.final_reward(recs[s]) - ds.final_reward(base[s]) for s in recs]
    assert comp["final_reward_diff"] == pytest.approx(np.mean(diffs))
    assert comp["verdict"] == "R3 higher reward"  # the planted 0.2 lift
    assert comp["train_s_ratio"] == pytest.approx(1.1)
    # resummarize writes the same numbers back
    out = rd.resummarize(path)
    assert out["cells"] == stored["cells"] and out["comparisons"] == stored["comparisons"]
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_every_verdict_follows_from_its_ci(tmp_path):
    path = tmp_path / "dose.json"
    result = rd.run_grid(path, FIXED, SETTINGS, ARMS, 3, fake_run([]), command="t")
    assert len(result["comparisons"]) == len(SETTINGS) * (len(ARMS) - 1)
    seen = set()
    for c in result["comparisons"]:
        for key, ci, null in (("verdict", "ci95", 0.0), ("k3_verdict", "k3_ratio_ci95", 1.0),
                              ("p99_verdict", "p99_ci95", 0.0)):
            lo, hi = c[ci]
            v = c[key]
            if lo > null:
                assert "higher" in v, (key, c)
            elif hi < null:
                assert "lower" in v, (key, c)
            else:
                assert v.startswith("no measurable difference"), (key, c)
            seen.add(v.split()[1] if not v.startswith("no") else "none")
    assert {"higher", "lower", "none"} <= seen  # the planted effects give every kind of verdict
    assert ds.verdict(-0.1, 0.1, "h", "l") == ds.NEUTRAL
    hits = [c for c in result["comparisons"] if c["verdict"] != ds.NEUTRAL]
    assert ds.chance_line(result["comparisons"]).startswith(f"{len(hits)} of {len(result['comparisons'])} final-reward")
    assert f"about {len(result['comparisons']) / 20:.1f} of" in ds.tables(result)
    assert ds.verdict(float("nan"), float("nan"), "h", "l") == "one seed: no conclusion"


def test_wilson_interval_brackets_zero_and_full_rates():
    assert ds.wilson95(0, 5)[0] == 0.0 and 0.4 < ds.wilson95(0, 5)[1] < 0.5
    lo, hi = ds.wilson95(5, 5)
    assert hi == 1.0 and 0.5 < lo < 0.6


def test_every_minibatch_holds_real_rows():
    import types

    runner = rd.Runner(types.SimpleNamespace(prompts=4, samples=4))  # 16 trajectories per batch
    for name, devices in (("bf16", 8), ("mb4", 4), ("mb8", 2), ("mb16", 1)):
        assert math.prod(runner.mesh_for(rd.Setting.parse(name)).shape.values()) == devices, name
    with pytest.raises(SystemExit, match=r"--settings mb3: 16 trajectories per batch .* do not split into 3"):
        runner.mesh_for(rd.Setting.parse("mb3"))


def test_cost_ratios_compare_only_runs_of_one_commit():
    runs = {cell: {s: fake_run([])(SETTINGS[0], cell.split("/")[1], s) for s in range(3)}
            for cell in ("bf16/none", "bf16/R3")}
    for s, rs in runs["bf16/R3"].items():  # seed 0's R3 run was twice as slow (another invocation's load)
        for r in rs:
            r["train_s"] *= 2 if s == 0 else 1
    same = {c: {str(s): {"commit": "b"} for s in range(3)} for c in runs}
    mixed = {**same, "bf16/R3": {"0": {"commit": "a"}, "1": {"commit": "b"}, "2": {"commit": "b"}}}
    other = {**same, "bf16/R3": {str(s): {"commit": "a"} for s in range(3)}}
    ratio = lambda prov: ds.summarize(runs, 3, prov)["comparisons"][0]
    assert ratio(same)["train_s_ratio"] == pytest.approx((2.2 + 1.1 + 1.1) / 3) and ratio(same)["cost_seeds"] == 3
    assert ratio(mixed)["train_s_ratio"] == pytest.approx(1.1) and ratio(mixed)["cost_seeds"] == 2
    assert ratio(other)["train_s_ratio"] is None and ratio(other)["rollout_s_ratio"] is None
    assert "n/a (other invocations)" in ds.tables(ds.summarize(runs, 3, other))
    # the reward comparison still pairs every seed
    assert ratio(other)["seeds"] == 3 and ratio(other)["final_reward_diff"] == ratio(same)["final_reward_diff"]


def test_cells_are_grouped_by_setting_with_none_first_whatever_the_storage_order():
    recs = fake_run([])(SETTINGS[0], "none", 0)
    runs = {c: {"0": recs} for c in ("s0.05-mb4/R3", "bf16/R3", "s0.05-mb4/none", "bf16/TIS", "bf16/none")}
    assert list(ds.summarize(runs, 1)["cells"]) == ["s0.05-mb4/none", "s0.05-mb4/R3", "bf16/none", "bf16/R3",
                                                    "bf16/TIS"]
