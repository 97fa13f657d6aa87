"""Weight sync, trainer to rollout engine: seconds per GB, in process and over HTTP.

    python -m experiments.bench_weight_sync [--quick] [--presets tiny,small_100m] [--repeats N] [--mesh]

For each preset (random-init weights: every ``nnx.Param`` plus router biases, GB = their bytes / 1e9):

1. In process: ``r3jax.train.weight_sync.push_to_engine(engine, state)`` until the engine's new
   params are ready (``block_until_ready`` on them): a device-to-device copy onto the engine's
   placement.
2. Remote: ``push_to_server(url, dir, state)`` against a real uvicorn server this script starts in a
   thread (same process, loopback), split into ``export_s`` (``export_params``: the orbax directory
   written) and ``post_s`` (``POST /v1/weights``: the server reads the directory into host arrays
   and the engine places them), plus ``read_s`` (that read alone, best of its own) and the whole
   call ``push_s``.
3. ``--mesh`` (8 simulated CPU devices, set before JAX starts; the whole run then has 8 devices and
   the one-device cases use the first): the trainer's weights sharded over devices 0-3 (first axis
   divisible by 4, else replicated) pushed in process to an engine on a (data, tensor, expert) =
   (1, 2, 2) mesh of devices 4-7.

Each figure is the best of N repeats (the first push, which compiles the engine's copy program, is a
warm-up); pushes alternate between two weight sets so every one moves new values. On a CPU host
"device" memory is host memory: the figures price the copies and the file I/O, not a PCIe or ICI link.
"""

from __future__ import annotations

import os
import sys

if "--mesh" in sys.argv:  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
from r3jax.serve.client import wait_healthy  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from experiments.common import table, write_json  # noqa: E402
from models import MoeConfig, MoeTransformer  # noqa: E402
from r3jax.engine import Engine  # noqa: E402
from r3jax.params_io import export_params, weights_of  # noqa: E402
from r3jax.serve import create_app  # noqa: E402
from r3jax.serve.server import bind, build_mesh  # noqa: E402
from r3jax.serve.weights import load_state  # noqa: E402
from r3jax.train.weight_sync import push_to_engine, push_to_server  # noqa: E402

# a small engine: weight sync does not depend on the pool or the step programs (none are compiled)
ENGINE_KW = dict(max_seq_len=64, max_batch_size=2, block_size=16, prefill_chunk=32, prefill_rows=1,
                 prefix_cache_bytes=0)


def nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def best(fn, repeats: int) -> tuple[float, dict]:
    """``fn() -> dict of seconds`` run 1 + repeats times (the first a warm-up); the run with the
    least ``total`` seconds."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return min(runs, key=lambda r: r["total"]), runs


def two_weight_sets(model):
    a = weights_of(model)
    return a, jax.tree.map(lambda x: -x, a)


@contextlib.contextmanager
def thread_server(app):
    """uvicorn serving ``app`` on a free loopback port in a daemon thread; yields its URL once
    ``/health`` answers 200."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_healthy(url, timeout=120)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def in_process(engine, sets, repeats: int) -> dict:
    k = iter(range(10**9))

    def once():
        state = sets[next(k) % 2]
        t0 = time.perf_counter()
        push_to_engine(engine, state)
        jax.block_until_ready(engine._params)  # the engine's own arrays (private: a benchmark's view)
        return {"total": time.perf_counter() - t0}

    return best(once, repeats)[0]


def remote(engine, sets, repeats: int, workdir: Path) -> dict:
    k = iter(range(10**9))
    with thread_server(create_app(engine, warmup=False)) as url, httpx.Client(timeout=600) as client:
        def split():  # push_to_server's two steps, timed apart
            state = sets[next(k) % 2]
            t0 = time.perf_counter()
            path = export_params(workdir / "split", state)
            t1 = time.perf_counter()
            r = client.post(url + "/v1/weights", json={"path": str(path), "format": "orbax"})
            r.raise_for_status()
            jax.block_until_ready(engine._params)
            t2 = time.perf_counter()
            t_read = time.perf_counter()
            load_state(str(path), "orbax", engine)  # the server's read alone (host arrays)
            t3 = time.perf_counter()
            return {"total": t2 - t0, "export_s": t1 - t0, "post_s": t2 - t1, "read_s": t3 - t_read}

        def whole():
            state = sets[next(k) % 2]
            t0 = time.perf_counter()
            push_to_server(url, workdir / "whole", state, client=client)
            jax.block_until_ready(engine._params)
            return {"total": time.perf_counter() - t0}

        parts, runs = best(split, repeats)
        push, _ = best(whole, repeats)
    return {**parts, "read_s": min(r["read_s"] for r in runs), "push_s": push["total"]}


def trainer_sharded(sets, devices):
    """The weights sharded over ``devices`` as a trainer would hold them (first axis split when it
    divides, else replicated)."""
    mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices)

    def put(x):
        spec = P("fsdp") if x.ndim and x.shape[0] % len(devices) == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return tuple(jax.tree.map(put, s) for s in sets)


def run_preset(name: str, repeats: int, mesh: bool, workdir: Path) -> list[dict]:
    cfg = MoeConfig.preset(name)
    t0 = time.perf_counter()
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    sets = two_weight_sets(model)
    size = nbytes(sets[0])
    gb = size / 1e9
    print(f"{name}: {size / 2**20:.1f} MiB of weights, {len(jax.tree.leaves(sets[0]))} arrays "
          f"(init {time.perf_counter() - t0:.1f} s)", flush=True)
    rows = []
    engine = Engine(model, **ENGINE_KW)
    try:
        r = in_process(engine, sets, repeats)
        rows.append({"preset": name, "case": "in process, 1 device", "GB": gb, "s": r["total"],
                     "s_per_GB": r["total"] / gb})
        print(rows[-1], flush=True)
        r = remote(engine, sets, repeats, workdir)
        rows.append({"preset": name, "case": "HTTP orbax, 1 device", "GB": gb, "s": r["total"],
                     "s_per_GB": r["total"] / gb, "export_s": r["export_s"], "post_s": r["post_s"],
                     "read_s": r["read_s"], "push_s": r["push_s"], "push_s_per_GB": r["push_s"] / gb})
        print(rows[-1], flush=True)
    finally:
        engine.close()
    if mesh:
        devices = jax.devices()
        if len(devices) < 8:
            raise SystemExit(f"--mesh: {len(devices)} devices, expected 8 (XLA_FLAGS set too late?)")
        engine = Engine(model, mesh=build_mesh((1, 2, 2), devices=devices[4:8]), **ENGINE_KW)
        try:
            r = in_process(engine, trainer_sharded(sets, devices[:4]), repeats)
            rows.append({"preset": name, "case": "in process, trainer 4 dev -> engine (1,2,2) on 4 others",
                         "GB": gb, "s": r["total"], "s_per_GB": r["total"] / gb})
            print(rows[-1], flush=True)
        finally:
            engine.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    ap.add_argument("--presets", default="tiny,small_100m", help="comma-separated MoeConfig presets")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (best of them)")
    ap.add_argument("--mesh", action="store_true",
                    help="also push from a trainer on 4 simulated CPU devices to an engine on 4 others")
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    if repeats < 1:
        ap.error(f"--repeats={repeats}: expected >= 1")
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        for name in args.presets.split(","):
            rows += run_preset(name.strip(), repeats, args.mesh, Path(tmp))
    print(f"\n## Weight sync, best of {repeats} (s per GB of weights; HTTP: export + POST, "
          "read_s = the server's read of the directory alone)")
    print(table(rows, ["preset", "case", "GB", "s", "s_per_GB", "export_s", "post_s", "read_s", "push_s",
                       "push_s_per_GB"]))
    path = write_json("bench_weight_sync", {"quick": args.quick, "repeats": repeats, "mesh": args.mesh,
                                            "engine": ENGINE_KW, "rows": rows, "wall_s": time.perf_counter() - t0})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
