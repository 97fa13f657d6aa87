"""How long ``python -m r3jax serve`` takes to be ready: cold (an empty compilation cache) and on
restart (the cache the cold start filled), as a user starts it.

    python -m experiments.serve_start [--model tiny] [--repeats 1] [--compilation-cache DIR] [-- SERVE ARGS]

Each start is a fresh process on this machine: ``python -m r3jax serve --model M --port 0
--compilation-cache DIR`` (plus any serve arguments after ``--``); ``wall_s`` runs from launching it to
the first ``/health`` 200 (every program compiled or loaded). ``/v1/stats`` ``warmup`` then says how many
programs the configuration has, how many XLA compiled and how many came from the cache, and the
server's own ``ready_s`` (from its process start). Cold uses a fresh temporary directory per repeat
(or ``--compilation-cache``, emptied first); restart reuses it. Goals: cold <= 30 s, restart <= 5 s.
The poller is one HTTP client every 20 ms (:func:`r3jax.serve.client.wait_healthy`): a new client per
poll costs about 20 ms of CPU, a core taken from the server it measures.

Then, in this process, the step time of every layout the server's engine could compile, with
``--mixed-decode-buckets`` at its largest (decode rows B, B/2, B/4 x prefill rows 0, 1, 4): the
median of ``--calls`` calls of each compiled program on zeroed inputs (a program's shapes fix its
work; a decode loop's rows get their full budget of steps, or the loop would end at once), and ``largest_over_this``: the call time of the largest decode size over this one's, what
padding this layout's decode rows up would cost it. It shows which programs pay for their compile
time: padding costs a step that prefills little (its cost is mostly the prefill's) and the decode
loop much more, so by default only the largest decode size gets the two mixed programs (5 programs,
not 9). ``--no-layouts`` skips it.
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
from r3jax.serve.client import wait_healthy

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
        while not url:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{''.join(lines)[-3000:]}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"serve not listening after {timeout} s:\n{''.join(lines)[-3000:]}")
            time.sleep(0.02)
        try:  # one client polling every 20 ms (wait_healthy): the poller must not take the server's CPU
            wait_healthy(url[0], timeout=timeout - (time.perf_counter() - t0), poll_s=0.02, proc=proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}:\n{''.join(lines)[-3000:]}") from None
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


def layout_times(model: str, serve_args: list[str], calls: int) -> list[dict]:
    """Median milliseconds per call of each program of the server's engine with every decode size
    also compiled for steps that prefill (zeroed inputs; the engine's own pool is not touched)."""
    import jax
    import numpy as np

    from r3jax.serve.server import build_engine, parse_args

    engine = build_engine(parse_args(["--model", model, *serve_args, "--mixed-decode-buckets", "3"]))

    zeros = lambda a: (jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)  # noqa: E731
                       if isinstance(a, (jax.ShapeDtypeStruct, jax.Array)) else a)
    rows, programs = [], []
    try:
        default = default_layouts(engine)
        for lay in engine.layouts():
            t0 = time.perf_counter()
            programs.append((engine.step_program(lay.decode_rows, lay.prefill_rows), engine._abstract_args(lay), []))
            rows.append({"decode_rows": lay.decode_rows, "prefill_rows": lay.prefill_rows,
                         "decode_steps": engine.steps_of(lay), "compile_s": round(time.perf_counter() - t0, 2),
                         "default": lay in default})
        for _ in range(calls + 1):  # round robin, so drift hits every program alike; the first round not counted
            for exe, abstract, times in programs:
                fresh = list(jax.tree.map(zeros, abstract))  # the pool is donated: fresh buffers
                if len(fresh) > 6:  # a decode loop's budgets and stop ids: every row runs every step
                    extra = np.full(abstract[6].shape, -1, np.int32)
                    extra[:, 0] = engine.decode_steps
                    fresh[6] = jax.device_put(extra, abstract[6].sharding)
                fresh = jax.block_until_ready(fresh)
                t0 = time.perf_counter()
                jax.block_until_ready(exe(*fresh))
                times.append(time.perf_counter() - t0)
        for row, (_, _, times) in zip(rows, programs):
            row["call_ms"] = round(1e3 * statistics.median(times[1:]), 2)
        top = max(r["decode_rows"] for r in rows)
        largest = {r["prefill_rows"]: r["call_ms"] for r in rows if r["decode_rows"] == top}
        for row in rows:  # what padding this layout's decode rows up to the largest size would cost it
            row["largest_over_this"] = round(largest[row["prefill_rows"]] / row["call_ms"], 3)
    finally:
        engine.close()
    return rows


def default_layouts(engine) -> list:
    """The layouts the default ``--mixed-decode-buckets 1`` compiles: every decode size's decode program
    and the largest decode size's mixed ones."""
    top = max(lay.decode_rows for lay in engine.layouts())
    return [lay for lay in engine.layouts() if lay.prefill_rows == 0 or lay.decode_rows == top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=1, help="cold + restart pairs (each cold on an empty cache)")
    ap.add_argument("--compilation-cache", default=None, help="cache directory to use (emptied before each cold start)")
    ap.add_argument("--calls", type=int, default=50, help="timed calls per program in the layout table")
    ap.add_argument("--no-layouts", action="store_true", help="skip the per-layout step times")
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
    layouts = [] if args.no_layouts else layout_times(args.model, args.serve_args, args.calls)
    if layouts:
        print(table(layouts, ["decode_rows", "prefill_rows", "decode_steps", "compile_s", "call_ms", "largest_over_this",
                              "default"]))
    print("wrote", write_json("serve_start", {"model": args.model, "serve_args": args.serve_args, "rows": rows,
                                              "summary": summary, "goals": GOALS, "layouts": layouts}))


if __name__ == "__main__":
    main()
