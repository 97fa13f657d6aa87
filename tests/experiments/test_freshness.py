"""A published result is current only while the code it measures is unchanged since its commit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from experiments import freshness, readme_tables


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _commit(root: Path) -> str:
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    return _git(root, "rev-parse", "--short", "HEAD")


@pytest.fixture
def repo(tmp_path):
    """A repository with an experiment importing r3jax.a (which imports models.b inside a function),
    naming r3jax/serve.py in MEASURES, beside a module nothing imports."""
    files = {
        "experiments/__init__.py": "",
        "experiments/exp.py": 'MEASURES = ("r3jax/serve.py",)\nfrom r3jax.a import f\nprint(f())\n',
        "r3jax/__init__.py": "import r3jax.unrelated\n",
        "r3jax/a.py": '"""Doc."""\n\n\ndef f():\n    from models import b\n    return b.G  # why\n',
        "r3jax/serve.py": "PORT = 1\n",
        "r3jax/__main__.py": "def main():\n    import r3jax.serve\n",
        "experiments/spawn.py": 'import sys\nCMD = [sys.executable, "-m", "r3jax", "serve"]\n',
        "r3jax/unrelated.py": "X = 1\n",
        "models/__init__.py": "",
        "models/b.py": "G = 2\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    _git(tmp_path, "init", "-q")
    return tmp_path, _commit(tmp_path)


def test_measured_files_follow_imports_and_measures(repo):
    root, _ = repo
    # r3jax/__init__.py is not the module imported (r3jax.a is), so r3jax/unrelated.py is not measured
    assert freshness.measured_files("exp", root) == [
        "experiments/exp.py", "models/__init__.py", "models/b.py", "r3jax/a.py", "r3jax/serve.py"]
    # a command line running r3jax in another process measures what python -m r3jax runs
    assert freshness.measured_files("spawn", root) == ["experiments/spawn.py", "r3jax/__main__.py", "r3jax/serve.py"]
    with pytest.raises(ValueError, match="experiments.nope: no such experiment module"):
        freshness.measured_files("nope", root)
    (root / "experiments" / "exp.py").write_text('MEASURES = ("r3jax/gone.py",)\n')
    with pytest.raises(ValueError, match="MEASURES names r3jax/gone.py, which does not exist"):
        freshness.measured_files("exp", root)


def test_docstrings_comments_and_other_files_leave_a_result_current(repo):
    root, commit = repo
    (root / "r3jax" / "a.py").write_text('"""Another doc."""\n\n\ndef f():\n    """New."""\n'
                                         '    from models import b\n\n    return b.G  # another reason\n')
    (root / "r3jax" / "unrelated.py").write_text("X = 2\n")
    assert freshness.stale({"commit": commit}, "exp", root) == []
    _commit(root)
    assert freshness.stale({"commit": commit}, "exp", root) == []  # committed or not, the same answer


def test_a_code_change_anywhere_it_reaches_makes_a_result_stale(repo):
    root, commit = repo
    (root / "models" / "b.py").write_text("G = 3\n")  # imported inside a function, two steps away
    assert freshness.stale({"commit": commit}, "exp", root) == ["models/b.py"]
    later = _commit(root)
    (root / "r3jax" / "serve.py").write_text("PORT = 2\n")  # named by MEASURES only
    assert freshness.stale({"commit": later}, "exp", root) == ["r3jax/serve.py"]
    # a grid filled over several commits is stale for the changes since each of them
    assert freshness.stale({"commits": [commit, later]}, "exp", root) == ["models/b.py", "r3jax/serve.py"]
    (root / "models" / "c.py").write_text("H = 1\n")  # a new module the experiment starts to import
    (root / "r3jax" / "a.py").write_text("from models import c\n\n\ndef f():\n    return c.H\n")
    assert set(freshness.stale({"commit": later}, "exp", root)) == {"models/c.py", "r3jax/a.py", "r3jax/serve.py"}


def test_every_experiment_names_existing_measured_files():
    for s in readme_tables.SECTIONS:
        files = freshness.measured_files(s.module)
        assert f"experiments/{s.module}.py" in files, s.name
        assert all((freshness.REPO / f).is_file() for f in files), s.name
    assert "r3jax/serve/server.py" in freshness.measured_files("serve_start")
    assert "r3jax/trace.py" in freshness.measured_files("bench_trace")


def test_a_stale_result_is_not_quoted(monkeypatch):
    d = {"commit": "abc1234", "dirty": False, "rows": [{"config": "tiny", "moe_impl": "dense", "B": 1, "T": 8,
                                                       "live_tok_s": 1.5, "replay_tok_s": 1.25,
                                                       "replay_overhead": 0.8333}]}
    files = {"bench_model": d, "demo_summary": {"commit": "abc1234", "dirty": False, "runs": []}}
    monkeypatch.setattr(readme_tables, "load", lambda name: files.get(name))
    model = lambda: readme_tables.measurements().split("## Model forward: replay overhead")[1].split("\n## ")[0]
    assert "| tiny | dense |" in model()
    files["stale"] = {"stale": ["bench_model", "demo_summary"]}
    body = model()
    assert "|---|" not in body and "Last measured on commit `abc1234`; the code it measures has changed" in body
    assert "- Model forward: replay overhead: `python -m experiments.bench_model`" in readme_tables.measurements()
    assert readme_tables.readme_blocks()["DEMO_RESULTS"].startswith("Last measured on commit `abc1234`; the code")


def test_the_pages_know_which_results_are_stale():
    """No table in README.md or docs/measurements.md quotes a result whose measured code changed since
    its commit: experiments/results/stale.json (what the pages render from) equals what git says now."""
    commits = set()
    for name in [s.name for s in readme_tables.SECTIONS] + ["scale_plan"]:
        d = readme_tables.load(name) or {}
        for r in d.get("cells", [d]):
            if readme_tables.is_clean(r):
                commits.update(r.get("commits") or [r["commit"]])
    missing = sorted(c for c in commits if not freshness.has_commit(c))
    if missing:
        pytest.skip(f"this clone lacks the history of commits {missing[:3]}: cannot tell what changed since")
    recorded = json.loads((readme_tables.RESULTS / "stale.json").read_text())["stale"]
    now = readme_tables.find_stale()
    assert sorted(now) == sorted(recorded), (
        f"quoted but stale now: {sorted(set(now) - set(recorded))} (re-run them on a clean commit, or run "
        f"python -m experiments.readme_tables --write to stop quoting them); current again: "
        f"{sorted(set(recorded) - set(now))} (run python -m experiments.readme_tables --write)")


def test_commands_re_run_every_result_not_current(capsys, monkeypatch):
    """--commands prints one line per result that is stale or never published, and none for the others;
    a grid's line first moves its stored file aside (its runs would be kept)."""
    stale = {s.name for s in readme_tables.SECTIONS if s.name in ("bench_trace", "replay_learn")}
    monkeypatch.setattr(freshness, "stale", lambda d, module, root=freshness.REPO:
                        ["x.py"] if any(module == s.module for s in readme_tables.SECTIONS if s.name in stale) else [])
    monkeypatch.setattr(readme_tables, "load", lambda name: {"commit": "abc1234", "dirty": False,
                                                             **({"commits": ["abc1234"]} if name == "replay_learn" else {}),
                                                             **({"command": "python -m experiments.bench_trace --x"}
                                                                if name == "bench_trace" else {})}
                        if name != "bench_multiprocess" else None)
    freshness.main(["--commands"])
    assert capsys.readouterr().out.splitlines() == [
        "mv experiments/results/replay_learn.json /tmp/replay_learn.old.json && python -m experiments.replay_learn",
        "python -m experiments.bench_trace --x",
        "python -m experiments.bench_multiprocess"]
