"""How long ``python -m r3jax serve`` takes to be ready: cold (an empty compilation cache) and on
restart (the cache the cold start filled), as a user starts it.

    python -m experiments.serve_start [--model tiny] [--repeats 1] [--compilation-cache DIR] [-- SERVE ARGS]

Each start is a fresh process on this machine: ``python -m r3jax serve --model M --port 0
--compilation-cache DIR`` (plus any serve arguments after ``--``); ``wall_s`` runs from launching it to
the first ``/health`` 200 (every program compiled or loaded). ``/v1/stats`` ``warmup`` then says how many
programs the configuration has, how many XLA compiled and how many came from the cache, and the
server's own ``ready_s`` (from its process start). Cold uses a fresh temporary directory per repeat
(or ``--compilation-cache``, emptied first); restart reuses it. Goals: cold <= 30 s, restart <= 5 s.
Writes experiments/results/serve_start.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from experiments.common import table, write_json

GOALS = {"cold_s": 30.0, "restart_s": 5.0}


def start(model: str, cache: str, extra: list[str], timeout: float = 600.0) -> dict:
    """One server start: launch, wait for /health 200, read /v1/stats, stop it."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "r3jax", "serve", "--model", model, "--port", "0",
                             "--compilation-cache", cache, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    url: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "listening on " in line and not url:
                url.append(line.split("listening on ", 1)[1].strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{''.join(lines)[-3000:]}")
            if url:
                try:
                    if httpx.get(url[0] + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.02)
        else:
            raise TimeoutError(f"serve not healthy after {timeout} s:\n{''.join(lines)[-3000:]}")
        wall = time.perf_counter() - t0
        warm = httpx.get(url[0] + "/v1/stats", timeout=10).json()["warmup"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"wall_s": wall, "ready_s": warm["ready_s"], "programs": warm["programs"],
            "compiled": warm["compiled"], "loaded": warm["loaded"], "warmup_s": warm["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=1, help="cold + restart pairs (each cold on an empty cache)")
    ap.add_argument("--compilation-cache", default=None, help="cache directory to use (emptied before each cold start)")
    ap.add_argument("serve_args", nargs="*", help="arguments passed to `python -m r3jax serve` (after --)")
    args = ap.parse_args()
    rows = []
    for i in range(args.repeats):
        cache = args.compilation_cache or tempfile.mkdtemp(prefix="r3jax-serve-start-")
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
        for when in ("cold", "restart"):
            r = start(args.model, cache, args.serve_args)
            rows.append({"repeat": i, "start": when, **r})
            print(rows[-1], flush=True)
        if args.compilation_cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    summary = {f"{w}_s": statistics.median(r["wall_s"] for r in rows if r["start"] == w) for w in ("cold", "restart")}
    summary["programs"] = rows[0]["programs"]
    summary["meets_goals"] = all(summary[k] <= v for k, v in GOALS.items())
    print(table(rows, ["repeat", "start", "wall_s", "ready_s", "warmup_s", "programs", "compiled", "loaded"]))
    print(f"median cold {summary['cold_s']:.1f} s (goal {GOALS['cold_s']:.0f}), restart {summary['restart_s']:.1f} s "
          f"(goal {GOALS['restart_s']:.0f}), {summary['programs']} programs")
    print("wrote", write_json("serve_start", {"model": args.model, "serve_args": args.serve_args, "rows": rows,
                                              "summary": summary, "goals": GOALS}))


if __name__ == "__main__":
    main()
