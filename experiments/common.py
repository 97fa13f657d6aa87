"""Shared helpers for experiment scripts: timing, tables, JSON output with provenance.

Every result file records the git commit of the code that wrote it and whether the tree had
uncommitted changes (``commit``, ``dirty``). The measurement pages quote only clean files
(:func:`is_clean`); a dirty or unrecorded file is listed as still to be run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax

from r3jax.demo.report import table  # noqa: F401  (one table formatter for scripts and the demo)

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def provenance(root: Path = REPO) -> dict:
    """``{"commit": short hash or "unknown", "dirty": bool}`` of the git tree at ``root``.

    dirty: tracked files differ from the commit (``git status --porcelain --untracked-files=no``),
    or git could not tell (no repository, no git): a figure then cannot be traced to a commit.
    Result files themselves (experiments/results/) are outputs, not code: one experiment's fresh
    results do not make the next experiment of ``make bench`` dirty.
    """
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                 f":(top,exclude){RESULTS.relative_to(REPO).as_posix()}"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": True}
    if head.returncode or status.returncode or not head.stdout.strip():
        return {"commit": "unknown", "dirty": True}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


# The tree when the script started: a run whose code changed under it is marked dirty at the end.
_AT_START = provenance()


def run_provenance() -> dict:
    """Provenance of this run: dirty if the tree was dirty at start or at the end, or the commit moved."""
    now = provenance()
    moved = now["commit"] != _AT_START["commit"]
    return {"commit": now["commit"], "dirty": now["dirty"] or _AT_START["dirty"] or moved}


def is_clean(record: dict | None) -> bool:
    """True for a result (or one cell) that names a commit and was written on a clean tree.

    Accepts both forms in use: ``{"commit": "abc1234", "dirty": False}`` and the scale plan's
    per-cell ``"commit": "abc1234"`` / ``"abc1234-dirty"``. A record without a commit is unproven.
    """
    if not isinstance(record, dict):
        return False
    commit = record.get("commit")
    if not isinstance(commit, str) or not commit or commit == "unknown" or commit.endswith("-dirty"):
        return False
    return record.get("dirty", False) is False


def timeit(fn, *, warmup: int = 1, repeats: int = 5) -> float:
    """Median wall seconds of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block(tree):
    return jax.block_until_ready(tree)


def environment() -> dict:
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()][:2], "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def command() -> str:
    """The command line that is running, as a user would type it (``python -m experiments.X ...``)."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None and spec.name else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def write_json(name: str, payload: dict) -> Path:
    """Write ``experiments/results/<name>.json``: the payload plus ``commit``, ``dirty``, ``command``
    and ``environment``. A dirty tree is recorded as such (and its figures are never quoted)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    prov = run_provenance()
    if prov["dirty"]:
        print(f"warning: {path.name} is written from a tree with uncommitted changes (commit "
              f"{prov['commit']}); its figures will not be quoted. Commit and re-run to publish them.")
    record = {**prov, "command": payload.get("command", command()), "environment": environment(),
              **{k: v for k, v in payload.items() if k != "command"}}
    path.write_text(json.dumps(record, indent=2, default=str))
    return path
