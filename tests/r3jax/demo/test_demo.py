"""Smoke tests of the main job (``python -m r3jax demo``): both rollout paths write metrics,
checkpoints and plots; --resume continues from the saved step."""

import json
import os
import shutil
import time

import numpy as np
import pytest

from r3jax.demo import main
from r3jax.demo.report import COLUMNS, summarize, table

SMALL = ["--steps", "2", "--prompts", "2", "--samples", "2", "--warmup-steps", "2", "--max-turns", "2",
         "--max-tokens", "3", "--max-seq-len", "64", "--save-every", "1", "--no-progress", "--seeds", "1",
         "--decode-buckets", "1"]  # a third of the engine's programs


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_in_process_run_writes_outputs_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    t0 = time.perf_counter()
    main(SMALL + ["--in-process", "--replay", "rollout", "--out", str(out), "--tensorboard", str(tmp_path / "tb"),
                  "--eval-prompts", "3"])
    wall = time.perf_counter() - t0
    printed = capsys.readouterr().out.strip().splitlines()
    recs = _records(out / "rollout" / "seed0" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    # TensorBoard's own reader reads the same scalars back from the run's event file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "rollout-seed0"))
    events.Reload()
    for tag in ("reward", "k3_kl", "route_bytes", "live_routing_disagreement"):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in recs], tag
    assert all(r["fallback_fraction"] == 0.0 for r in recs)  # every target's predicting row was captured
    assert all(0.0 <= r["live_routing_disagreement"] <= 1.0 for r in recs)  # measured: routes were captured
    assert all(r["route_rows"] > 0 and r["route_bytes"] > 0 for r in recs)
    assert sorted(int(p.name) for p in (out / "rollout" / "seed0" / "ckpt").iterdir() if p.name.isdigit()) == [1, 2]
    assert (out / "demo.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"][0]["steps"] == 2 and summary["runs"][0]["seeds"] == [0]
    # held-out greedy evaluation after step 1 and after the last; the gains are the paired differences
    assert all(0.0 <= r["eval_reward"] <= 1.0 for r in recs)
    row = summary["runs"][0]
    assert row["eval_first"][0] == recs[0]["eval_reward"] and row["eval_last"][0] == recs[1]["eval_reward"]
    assert row["eval_gain"][0] == pytest.approx(recs[1]["eval_reward"] - recs[0]["eval_reward"])
    assert row["reward_gain"][0] == pytest.approx(recs[1]["reward"] - recs[0]["reward"])  # quarters of 1 step
    assert summary["replay_effect"] is None  # one mode: nothing to compare
    assert 0 < summary["wall_s"] <= wall + 0.1  # the run's own total, printed last
    assert printed[-1] == f"r3jax demo: done in {summary['wall_s']:.0f} s ({summary['wall_s'] / 60:.1f} min) of wall time"
    inc, full = summary["transfer_bytes_per_turn"]["incremental"], summary["transfer_bytes_per_turn"]["full_regather"]
    assert inc[0] == full[0] and inc[1] < full[1]  # turn 2 re-sends the whole prefix without the start

    # "crash" after step 2 was logged but before its checkpoint landed: resume re-runs step 2 from the
    # step-1 checkpoint and the log keeps each step once; a changed learning rate is allowed and reported
    shutil.rmtree(out / "rollout" / "seed0" / "ckpt" / "2")
    capsys.readouterr()
    main(SMALL[2:] + ["--steps", "3", "--in-process", "--replay", "rollout", "--out", str(out), "--resume",
                      "--lr", "5e-4"])
    assert ("resuming from the step-1 checkpoint in " + str(out / "rollout" / "seed0" / "ckpt")
            + " with changed settings: --lr 0.001 -> 0.0005") in capsys.readouterr().out
    recs = _records(out / "rollout" / "seed0" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["weight_version"] for r in recs] == [2, 3, 4]  # the resumed run numbers versions on from its step
    assert 3 in [int(p.name) for p in (out / "rollout" / "seed0" / "ckpt").iterdir() if p.name.isdigit()]


def test_server_run_with_and_without_replay_over_seeds(tmp_path, capsys, monkeypatch):
    # the server subprocess on one device (it inherits this environment; the trainer here keeps 8)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("R3JAX_TEST_XLA_FLAGS", ""))
    out = tmp_path / "demo"
    summary = main(SMALL + ["--steps", "1", "--replay", "both", "--out", str(out), "--seeds", "2", "--seed", "3"])
    for mode in ("rollout", "none"):
        for seed in (3, 4):
            recs = _records(out / mode / f"seed{seed}" / "metrics.jsonl")
            assert len(recs) == 1 and recs[0]["weight_version"] >= 1 and recs[0]["seed"] == seed
            assert (out / mode / f"seed{seed}" / "ckpt" / "1").is_dir()
    assert (out / "server.log").exists() and (out / "demo.png").exists()
    assert json.loads((out / "summary.json").read_text()) == summary
    runs = summary["runs"]
    assert [r["run"] for r in runs] == ["with replay (R3)", "without replay"]
    assert [r["seeds"] for r in runs] == [[3, 4], [3, 4]]
    for r in runs:  # every statistic is [mean over seeds, 95% CI half-width]
        for key in ("reward_first", "reward_last", "k3_kl", "mean_abs_delta", "clip_fraction", "grad_norm"):
            mean, half = r[key]
            assert np.isfinite(mean) and np.isfinite(half) and half >= 0.0, (key, r[key])
        lo, hi = min(r["reward_last_per_seed"]), max(r["reward_last_per_seed"])
        assert lo <= r["reward_last"][0] <= hi
    for r in runs:  # the router's own disagreement is reported; the replayed (forced) routes are not
        assert np.isfinite(r["live_routing_disagreement"][0]) and "routing_disagreement" not in r
    effect = summary["replay_effect"]
    assert effect["seeds"] == [3, 4] and len(effect["per_seed"]) == 2
    assert np.isclose(effect["replay_minus_none"], np.mean(effect["per_seed"]))
    assert np.isclose(effect["ci95"], 12.706 * np.std(effect["per_seed"], ddof=1) / np.sqrt(2))
    printed = capsys.readouterr().out
    assert f"{effect['replay_minus_none']:+.4f} ± {effect['ci95']:.4f} (95% CI, 2 paired seeds)" in printed


def test_unmeasured_metric_is_absent_and_prints_na():
    """A run whose steps captured no route has NaN disagreement in its log: the summary leaves it
    out (None), never 0, and the table prints n/a; steps that did measure it are averaged alone."""
    def recs(dis):
        return [{"reward": 0.5, "route_bytes": 0, "k3_kl": 1e-3, "live_routing_disagreement": d} for d in dis]
    nan = float("nan")
    rows = summarize({"rollout": {0: recs([nan, nan]), 1: recs([nan, nan])},
                      "none": {0: recs([0.25, nan]), 1: recs([nan, 0.75])}})
    assert rows[0]["live_routing_disagreement"] is None
    assert rows[1]["live_routing_disagreement"][0] == 0.5
    line = table(rows[:1], COLUMNS).splitlines()[-1].split(" | ")
    assert line[COLUMNS.index("live_routing_disagreement")] == "n/a"
    assert line[COLUMNS.index("seeds")] == "[0, 1]" and line[COLUMNS.index("k3_kl")] == "0.001 ± 0"


def test_router_noise_reaches_the_rollout_engine_and_the_server_command(tmp_path):
    """``--router-noise`` (the demo's mismatch knob) builds the in-process engine with that noise and
    passes it to the server it starts; the model itself stays noiseless (the trainer routes cleanly)."""
    import contextlib

    from flax import nnx

    from models import MoeConfig, MoeTransformer
    from r3jax.demo import parse_args
    from r3jax.demo.rollouts import Rollouts
    from r3jax.serve.server import parse_args as serve_args

    args = parse_args(SMALL + ["--in-process", "--router-noise", "0.5", "--out", str(tmp_path)])
    model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
    with contextlib.ExitStack() as stack:
        rollouts = Rollouts(args, model, tmp_path, stack)
        assert rollouts.generator.config.router_noise == 0.5 and model.config.router_noise == 0.0
        rollouts.generator.close()
    assert serve_args(["--router-noise", "0.5"]).router_noise == 0.5 and serve_args([]).router_noise is None


@pytest.mark.parametrize("bound", [0, 2])
def test_async_run_samples_ahead_within_the_staleness_bound(tmp_path, bound):
    """``--async``: rollouts are sampled while the trainer steps, at most ``--max-staleness`` steps ahead,
    and weights are pushed with mode "keep" as version ``optimizer steps + 1``. Each step says how many
    versions old its tokens were: never more than the bound, so nothing is masked; bound 0 waits for each
    step's weights (lag 0, as synchronous RL), bound 2 runs ahead (the first train step compiles meanwhile)."""
    out = tmp_path / "demo"
    main(SMALL + ["--steps", "4", "--in-process", "--replay", "rollout", "--out", str(out), "--async",
                  "--max-staleness", str(bound), "--eval-every", "0"])
    recs = _records(out / "rollout" / "seed0" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in recs] == [2, 3, 4, 5]  # after k steps: version k + 1
    assert recs[0]["version_lag_max"] == 0  # step 1 is sampled on the first pushed weights
    for r in recs:
        assert 0 <= r["version_lag_mean"] <= r["version_lag_max"] <= bound and r["stale_masked"] == 0
    ran_ahead = max(r["version_lag_max"] for r in recs)
    assert ran_ahead == 0 if bound == 0 else ran_ahead >= 1


def test_r2_and_the_importance_corrections_run_in_the_demo(tmp_path):
    """``--replay trainer`` (R2) trains on the trainer's recorded routes; ``--tis-cap`` and ``--icepop`` reach
    the loss (its metrics say so); bad values are refused naming the field."""
    out = tmp_path / "demo"
    main(SMALL + ["--in-process", "--replay", "trainer", "--icepop", "0.5", "2.0", "--eval-every", "0",
                  "--out", str(out)])
    [rec] = _records(out / "trainer" / "seed0" / "metrics.jsonl")[-1:]
    assert 0.0 <= rec["icepop_masked"] <= 1.0 and rec["importance_weight"] > 0
    main(SMALL + ["--in-process", "--replay", "rollout", "--tis-cap", "2.0", "--eval-every", "0",
                  "--out", str(tmp_path / "tis")])
    [rec] = _records(tmp_path / "tis" / "rollout" / "seed0" / "metrics.jsonl")[-1:]
    assert "icepop_masked" not in rec and 0 < rec["importance_weight"] <= 2.0
    with pytest.raises(SystemExit):
        main(SMALL + ["--icepop", "2.0", "5.0", "--out", str(tmp_path / "bad")])
