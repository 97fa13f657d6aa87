"""experiments.replay_learn: settings name their flags, the summary is a pure function of the stored
records (gains, paired differences from the no-replay arm), bad arms are refused."""

import numpy as np
import pytest

from experiments import replay_learn as rl


def _records(rewards, disagreement=0.1):
    return [{"reward": r, "live_routing_disagreement": disagreement, "k3_kl": 1e-6,
             **({"eval_reward": r + 0.5} if i in (0, len(rewards) - 1) else {})} for i, r in enumerate(rewards)]


def test_summary_from_records():
    rises = [0.2] * 4 + [0.3] * 4  # 8 steps: quarters of 2
    runs = {"bf16/none": {"0": _records(rises), "1": _records([r + 0.1 for r in rises])},
            "bf16/R3": {"0": _records([r + 0.05 for r in rises]), "1": _records([r + 0.15 for r in rises])},
            "noise0.25/none": {"0": _records(rises)}}
    s = rl.summarize(runs, seeds_wanted=2)
    c = s["cells"]["bf16/none"]
    assert c["complete"] and c["seeds"] == 2
    np.testing.assert_allclose(c["reward_first"][0], 0.25)
    np.testing.assert_allclose(c["reward_gain"], [0.1, 0.0], atol=1e-12)
    np.testing.assert_allclose(c["eval_last"][0], 0.85)
    assert not s["cells"]["noise0.25/none"]["complete"]
    [cmp] = s["comparisons"]  # R3 vs none on bf16: +0.05 on both seeds
    assert cmp["comparison"] == "R3 - none" and cmp["seeds"] == 2
    np.testing.assert_allclose(cmp["reward_last_diff"], [0.05, 0.0], atol=1e-12)
    assert cmp["verdict"] == "higher"  # the same +0.05 on both seeds: a zero-width CI above 0
    assert "| bf16 | R3 - none | 2 |" in rl.tables(s)


def test_settings_and_arms():
    assert rl.Setting("bf16").flags == [] and rl.Setting("noise0.25").flags == ["--router-noise", "0.25"]
    with pytest.raises(ValueError, match="setting 'fp9'"):
        rl.Setting("fp9").flags
    with pytest.raises(SystemExit):
        rl.parse_args(["--arms", "none,R9"])
    args = rl.parse_args(["--settings", "noise0.5", "--arms", "R3,IcePop"])
    assert [s.name for s in args.settings] == ["noise0.5"] and args.arms == ["R3", "IcePop"]
    assert rl.ARMS["IcePop"][-3:] == ["--icepop", "0.5", "5"]
