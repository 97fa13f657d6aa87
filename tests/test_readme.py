"""The README's quickstart runs as written, and the documentation quotes only what it can back.

The quickstart's code blocks run in a fresh interpreter on CPU (one device, as a user's first run
would be), so the page a newcomer follows cannot rot. The generated pages must equal what
``experiments.readme_tables`` renders from the result files on disk.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import readme_tables, renderers
from experiments.common import is_clean

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def quickstart_code(text: str) -> str:
    """The ```python blocks of the ``## Quickstart`` section, in order, joined."""
    m = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
    if m is None:
        raise AssertionError("README.md has no '## Quickstart' section")
    blocks = re.findall(r"^```python\n(.*?)^```", m.group(1), re.S | re.M)
    if not blocks:
        raise AssertionError("the Quickstart section has no ```python block")
    return "\n".join(blocks)


def test_quickstart_runs_in_a_fresh_interpreter(tmp_path):
    code = quickstart_code(README.read_text())
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    # A fresh user's environment: CPU, one device (no simulated-device flags from this test run).
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    # (the suite's codegen flags: compiling is most of this test's time)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=os.environ.get("R3JAX_TEST_XLA_FLAGS", ""))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"quickstart failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # Turn 0: P = 3, s = 0, G = 6 -> 8 rows; turn 1: P = 11, s = 8, G = 6 -> 8 rows (P - s + G - 1).
    assert "turn 0: 8 new route rows" in proc.stdout
    assert "turn 1: 8 new route rows" in proc.stdout
    assert "engine weight version: 1" in proc.stdout


def test_quickstart_code_is_found_in_order():
    text = "## Quickstart\n\ntext\n\n```python\na = 1\n```\n\n```bash\nno\n```\n\n```python\nb = a\n```\n\n## Next\n"
    assert quickstart_code(text) == "a = 1\n\nb = a\n"
    with pytest.raises(AssertionError, match="no '## Quickstart' section"):
        quickstart_code("## Other\n")


def user_pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def test_pages_name_no_issue_numbers_or_outside_files():
    for page in user_pages():
        text = page.read_text()
        for pattern in (r"[Ii]ssue [0-9]", r"\.\./shared", r"DESIGN\.md"):
            hits = [i + 1 for i, line in enumerate(text.splitlines()) if re.search(pattern, line)]
            assert not hits, f"{page.name} lines {hits} match {pattern!r}"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for needed in ("make demo", "make test", "make bench", "make scale-plan", "## Quickstart"):
        assert needed in text, needed


def test_generated_pages_match_the_result_files():
    assert (DOCS / "measurements.md").read_text() == readme_tables.measurements(), \
        "docs/measurements.md is stale: run python -m experiments.readme_tables --write"
    assert readme_tables.fill_markers(README.read_text(), readme_tables.readme_blocks()) == README.read_text(), \
        "README.md's generated blocks are stale: run python -m experiments.readme_tables --write"
    testing = (DOCS / "testing.md").read_text()
    assert readme_tables.fill_markers(testing, readme_tables.testing_blocks()) == testing, \
        "docs/testing.md's generated block is stale: run python -m experiments.readme_tables --write"


def test_only_clean_results_are_quoted(monkeypatch):
    clean = {"commit": "abc1234", "dirty": False, "rows": [{"config": "tiny", "moe_impl": "dense", "B": 1,
                                                             "T": 8, "live_tok_s": 1.5, "replay_tok_s": 1.25,
                                                             "replay_overhead": 0.8333}]}
    files = {"bench_model": clean, "bench_scan": {**clean, "dirty": True},
             "bench_ep": {k: v for k, v in clean.items() if k != "commit"},
             "scale_plan": {"cells": [{"commit": "abc1234-dirty"}]}}
    monkeypatch.setattr(readme_tables, "load", lambda name: files.get(name))
    page = readme_tables.measurements()
    model = page.split("## Model forward: replay overhead")[1].split("\n## ")[0]
    assert "on commit `abc1234`" in model and "| tiny | dense | 1 | 8 | 1.5 | 1.25 | 0.8333 |" in model
    for title in ("Scanned layers: compile time against depth", "Expert parallelism",
                  "Memory and compile plan on TPU slices", "Decode"):
        body = page.split(f"## {title}\n")[1].split("\n## ")[0]
        assert "Not measured on a released commit yet: run `" in body, title
        assert "|---|" not in body, title


def test_no_result_file_comes_from_a_dirty_tree():
    """Every experiments/results/*.json, and every cell or run inside one, says a clean commit (or
    none: files written before commits were recorded)."""
    import json

    def commits(obj):
        if isinstance(obj, dict):
            if obj.get("dirty") is True:
                yield "dirty: true"
            if isinstance(obj.get("commit"), str):
                yield obj["commit"]
            for v in obj.values():
                yield from commits(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from commits(v)

    results = Path(readme_tables.RESULTS)
    bad = {f.name: c for f in sorted(results.glob("*.json")) for c in commits(json.loads(f.read_text()))
           if c == "dirty: true" or c.endswith("-dirty")}
    assert bad == {}


def test_speed_ratios_only_where_the_peer_decoded_the_same_tokens():
    rows = [{"B": 1, "ours_over_hf": 18.0, "hf_same_tokens": 0.0}, {"B": 8, "ours_over_hf": 4.5, "hf_same_tokens": 1}]
    out = renderers._same_tokens_only(rows, "ours_over_hf")
    assert [r["ours_over_hf"] for r in out] == ["tokens differ", 4.5]


def test_is_clean():
    assert is_clean({"commit": "abc1234", "dirty": False})
    assert is_clean({"commit": "abc1234"})                 # a scale-plan cell
    assert not is_clean({"commit": "abc1234-dirty"})
    assert not is_clean({"commit": "abc1234", "dirty": True})
    assert not is_clean({"commit": "unknown", "dirty": False})
    assert not is_clean({"rows": []})                      # no record: unproven


def test_scale_plan_quotes_clean_cells_and_no_smallest_slice_from_a_subset(monkeypatch):
    def cell(topology, commit):
        return {"model": "m", "topology": topology, "chips": 4, "program": "train", "commit": commit,
                "mesh": {"data": 1, "fsdp": 4, "expert": 1}, "params_bytes": 2**30, "optimizer_bytes": 2**31,
                "peak_bytes": 3 * 2**30, "hbm_bytes": 16 * 2**30, "status": "fits", "compile_s": 1.0,
                "routes_bytes": 2**20, "routes_sharding": {"chip_shape": [1, 8, 2, 2]}}

    cells = [cell("v5e:2x2", "abc1234"), cell("v5p:2x2x1", "abc1234-dirty")]
    monkeypatch.setattr(readme_tables, "load", lambda name: {"cells": cells} if name == "scale_plan" else None)
    md, quoted = readme_tables.scale_plan()
    assert quoted and "(1 of 2 cells)" in md and "| m | v5e:2x2 |" in md
    assert "v5p:2x2x1" not in md and "smallest fitting" not in md
    cells[1]["commit"] = "abc1234"
    md, _ = readme_tables.scale_plan()
    assert "- m/train: smallest fitting v5e:2x2 (4 chips)" in md


def test_provenance_marks_code_changes_but_not_fresh_results(tmp_path):
    from experiments.common import provenance

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "experiments" / "results" / "x.json").write_text("{}\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert provenance(tmp_path)["dirty"] is False
    (tmp_path / "experiments" / "results" / "x.json").write_text('{"new": 1}\n')  # a run's output
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert provenance(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("a = 2\n")
    prov = provenance(tmp_path)
    assert prov["dirty"] is True and len(prov["commit"]) >= 7
    assert provenance(tmp_path / "experiments") == prov  # the whole tree, wherever git runs
    assert provenance(Path("/"))["dirty"] is True  # not a repository: cannot be traced
