"""Shared helpers for experiment scripts: timing, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax

from r3jax.demo.report import table  # noqa: F401  (one table formatter for scripts and the demo)

RESULTS = Path(__file__).resolve().parent / "results"


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


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2, default=str))
    return path
