"""Wall time of the test suite as a new user meets it: a fresh clone of HEAD, then CI's entry point.

    python -m experiments.suite_time [--serial] [--commit REV] [--keep]

Clones this repository's HEAD into a temporary directory (no .venv, no .pytest_cache: nothing
compiled or installed before) and runs ``.ci/run`` there (``make test`` without a persistent
compilation cache), timing the venv bootstrap (``make venv``) and the tests apart. ``--serial`` runs
the same suite in one process (``XDIST=`` for the Makefile), for comparison; ``--commit REV`` measures
an earlier commit instead of HEAD (stored as ``<mode>@<rev>``). Prints a table and writes
``experiments/results/suite_time.json`` (one record per mode): the seconds, pytest's counts
(passed / skipped / failed), the seconds per folder and per file (setup + call + teardown, summed over
workers, from a JUnit XML report), and the slowest tests as ``make test`` printed them. Commit first:
the clone is of HEAD.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from experiments.common import REPO, RESULTS, provenance, table

BUDGET_S = 600  # the goal: a fresh clone's `make test`, bootstrap included, within 10 minutes


def _timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.returncode, proc.stdout + proc.stderr


def counts(output: str) -> dict:
    """pytest's final tally: ``{"passed": n, "skipped": n, ...}`` (0 for outcomes it does not name)."""
    tally = {k: 0 for k in ("passed", "skipped", "failed", "errors", "deselected")}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    for n, what in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary[-1] if summary else ""):
        tally["errors" if what.startswith("error") else what] = int(n)
    return tally


def slowest(output: str) -> list[dict]:
    return [{"seconds": float(s), "phase": phase, "test": test}
            for s, phase, test in re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$", output, re.M)]


def per_file(junit: Path) -> dict[str, dict]:
    """``{"tests/.../test_x.py": {"seconds": s, "tests": n}}`` from a pytest JUnit XML report (its
    ``time`` is setup + call + teardown of a test)."""
    files: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "tests": 0})
    for case in ET.parse(junit).getroot().iter("testcase"):
        # classname "tests.r3jax.engine.test_paged" or "tests.models.test_x.TestClass"
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        name = "/".join(parts) + ".py" if parts else "?"
        files[name]["seconds"] += float(case.get("time", 0.0))
        files[name]["tests"] += 1
    return {k: {"seconds": round(v["seconds"], 1), "tests": v["tests"]}
            for k, v in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])}


def per_folder(files: dict[str, dict]) -> dict[str, float]:
    """Seconds per folder under tests/ (``tests/r3jax/serve``; files directly under it count as ``tests``)."""
    folders: dict[str, float] = defaultdict(float)
    for name, v in files.items():
        folders[name.rsplit("/", 1)[0] if "/" in name else "tests"] += v["seconds"]
    return {k: round(v, 1) for k, v in sorted(folders.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serial", action="store_true", help="one pytest process (no pytest-xdist workers)")
    ap.add_argument("--commit", help="measure this commit instead of HEAD")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = ap.parse_args(argv)
    mode = "serial" if args.serial else "parallel"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "XLA_", "JAX_", "PYTHON", "PYTEST", "XDIST"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    tmp = Path(tempfile.mkdtemp(prefix="r3jax-suite-"))
    clone, junit = tmp / "r3jax", tmp / "junit.xml"
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        if args.commit:
            subprocess.run(["git", "checkout", "-q", args.commit], cwd=clone, check=True)
        head = provenance(clone)["commit"]
        print(f"fresh clone of {head} in {clone}: make venv, then .ci/run ({mode})", flush=True)
        venv_s, rc_venv, out_venv = _timed(["make", "venv"], clone, env)
        if rc_venv:
            sys.exit(f"make venv failed ({rc_venv}):\n{out_venv[-4000:]}")
        test_env = {**env, "PYTEST_ADDOPTS": f"--junitxml={junit}"}  # pytest reads it whatever the Makefile says
        if args.serial:
            test_env["XDIST"] = ""  # the Makefile's pytest-xdist options, empty
        test_s, rc, out = _timed([str(clone / ".ci" / "run")], clone, test_env)
        (tmp / "ci.log").write_text(out)
        files = per_file(junit) if junit.exists() else {}
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    tally = counts(out)
    folders = per_folder(files)
    total = venv_s + test_s
    print(table([{"phase": "make venv", "seconds": round(venv_s)}, {"phase": f"tests (.ci/run, {mode})",
                                                                    "seconds": round(test_s)},
                 {"phase": "total", "seconds": round(total)}, {"phase": "budget", "seconds": BUDGET_S}],
                ["phase", "seconds"]))
    print(table([{"folder": k, "seconds": v} for k, v in folders.items()], ["folder", "seconds"]))
    print(", ".join(f"{n} {k}" for k, n in tally.items() if n), f"(exit status {rc})")
    record = {"commit": head, "dirty": False, "mode": mode, "venv_s": round(venv_s, 1), "tests_s": round(test_s, 1),
              "total_s": round(total, 1), "budget_s": BUDGET_S, "within_budget": total <= BUDGET_S and rc == 0,
              "exit_status": rc, **tally, "cores": os.cpu_count(), "per_folder_s": folders, "per_file": files,
              "slowest": slowest(out), "output_tail": out[-3000:]}
    path = RESULTS / "suite_time.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    key = mode if not args.commit else f"{mode}@{args.commit}"
    stored[key] = record  # the clone's commit is the provenance: this working tree may be dirty
    path.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"wrote {path} [{key}]")
    if rc:
        print(out[-4000:])
    return record


if __name__ == "__main__":
    main()
