"""experiments.async_rl: schedules name their flags, throughput leaves step 1 out, the summary is a pure
function of the stored records (paired throughput ratios and reward differences against sync), and one
real quick cell runs the demo's asynchronous loop within its staleness bound."""

import numpy as np
import pytest

from experiments import async_rl as ar


def _records(rewards, seconds_per_step, lag=0.0, masked=0):
    # elapsed_s: step 1 also compiled for 5 s, which the throughput leaves out
    return [{"reward": r, "k3_kl": 1e-6, "samples": 8, "elapsed_s": 5.0 + seconds_per_step * (i + 1),
             "version_lag_mean": lag, "version_lag_max": int(np.ceil(lag)), "stale_masked": masked}
            for i, r in enumerate(rewards)]


def test_summary_from_records():
    rises = [0.2] * 4 + [0.3] * 4  # 8 steps: quarters of 2
    runs = {"sync/none": {"0": _records(rises, 2.0), "1": _records(rises, 2.0)},
            "async1/none": {"0": _records([r + 0.1 for r in rises], 1.0, 0.5), "1": _records(rises, 1.0, 0.5)},
            "async4/R3": {"0": _records(rises, 1.0, 2.0)}}
    s = ar.summarize(runs, seeds_wanted=2)
    c = s["cells"]["async1/none"]
    assert c["complete"] and c["seeds"] == 2 and c["version_lag_max"] == 1 and c["stale_masked"] == 0
    np.testing.assert_allclose(c["samples_per_s"], [8.0, 0.0])  # 7 later steps x 8 samples in 7 s (step 1 left out)
    np.testing.assert_allclose(s["cells"]["sync/none"]["samples_per_s"], [4.0, 0.0])
    assert not s["cells"]["async4/R3"]["complete"]
    [cmp] = s["comparisons"]  # async4/R3 has no sync/R3 to pair with
    assert (cmp["arm"], cmp["comparison"], cmp["seeds"]) == ("none", "async1 vs sync", 2)
    np.testing.assert_allclose(cmp["throughput_ratio"], [2.0, 0.0])
    np.testing.assert_allclose(cmp["reward_last_diff"][0], 0.05)
    assert cmp["reward_verdict"] == "no measurable difference"  # +0.1 and 0 over 2 seeds
    assert "| none | async1 vs sync | 2 | 2 ± 0 |" in ar.tables(s)


def test_schedules_and_arms():
    assert ar.Schedule("sync").flags == [] and ar.Schedule("async4").flags == ["--async", "--max-staleness", "4"]
    for bad in ("asyncx", "later"):
        with pytest.raises(ValueError, match=f"schedule '{bad}'"):
            ar.Schedule(bad).flags
    with pytest.raises(SystemExit):
        ar.parse_args(["--arms", "none,R9"])
    args = ar.parse_args(["--schedules", "async0,async2", "--arms", "R3"])
    assert [s.name for s in args.schedules] == ["async0", "async2"] and args.arms == ["R3"]


def test_one_quick_async_cell_stays_within_its_bound():
    # the demo tests' small configuration (tests/r3jax/demo/test_demo.py): the same compiled programs
    small = ["--steps", "3", "--prompts", "2", "--samples", "2", "--warmup-steps", "2", "--max-turns", "2",
             "--max-tokens", "3", "--max-seq-len", "64", "--decode-buckets", "1", "--eval-every", "0"]
    recs = ar.run_one(small, ar.Schedule("async1"), "R3", 0)
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["samples"] == 4 for r in recs)
    assert all(r["version_lag_max"] <= 1 and r["stale_masked"] == 0 for r in recs)
    assert recs[0]["elapsed_s"] < recs[1]["elapsed_s"] < recs[2]["elapsed_s"] and ar.throughput(recs) > 0
