"""Memory and compile plan on real TPU topologies: per chip, what the R3 train step and the engine's
decode step of each MoE preset need, from an ahead-of-time compile with abstract inputs.

    python -m experiments.scale_plan [--models ...] [--topologies ...] [--programs train decode]
        [--backend auto|tpu|cpu] [--cell-timeout S] [--rerun] [--quick]
    make scale-plan          # builds .venv-tpu (the tpu-aot extra: jax[tpu] + libtpu) and runs this

With the ``tpu-aot`` extra installed, every (model, topology, program) cell is compiled by libtpu for
that slice on this CPU-only host (experiments/topologies.py): XLA reports ``peak_memory_in_bytes``
per chip and refuses a program that does not fit HBM with RESOURCE_EXHAUSTED, exactly as it would on
the slice; no weight or batch is allocated (experiments/aot_cells.py). Without the extra, the meshes
are simulated CPU devices and the figures are XLA:CPU's estimate (nothing is refused).

Workload: an RL batch of ``--rl-batch`` sequences x ``--seq-len`` tokens (default 256 x 8192).
- train: the trainer's jitted R3 step (``make_train_step(replay="rollout")``, AdamW) at a PPO
  minibatch of ``--rows-per-chip`` sequences per batch shard; route bytes are those of the whole RL
  batch ``[B, S, L, K]`` placed as ``shard_batch`` places it. On TPU the cell tries the trainer's
  layouts (``aot_cells.train_layouts``: all chips on fsdp, then more data parallelism) and keeps the
  first that fits, listing every try in ``layouts_tried``.
- decode: the engine's decode program (its decode loop: ``decode_steps`` tokens per row per call) with
  ``--rl-batch`` rows, every row live, attention over the whole ``--seq-len`` cache; routes are the
  call's route rows. On TPU the cell tries the engine's layouts best first (lane-aligned expert shares,
  then the fewest resident bytes per chip; at most ``DECODE_TRIES``) and keeps the first that fits
  with the headroom, listing every try in ``layouts_tried``. The layout's ``data`` is engine cores as the server runs them (``--mesh D,T,E``):
  each core holds the model on its ``tensor x expert`` chips, ``--rl-batch / data`` rows and a page
  pool of its own, so the program compiled is one core's (``aot_cells.decode_program``). A layout that
  replicates an array (an MLA latent pool over tensor) competes on bytes too, and the cell's
  ``replicated`` says what (serving it takes ``--allow-replication``).

Each cell runs in its own process with a time limit (a 48-layer model can take long to compile on 2
cores); results are written to experiments/results/scale_plan.json after every cell, and a rerun skips
the cells already there (``--rerun`` recomputes them). ``--cell`` runs one cell in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT = "scale_plan"
HEADROOM = 0.10  # a slice counts as fitting when the peak leaves this fraction of HBM free
DECODE_TRIES = 6  # layouts a TPU decode cell compiles at most, best first
BEFORE = "scale_plan_einsum"  # the plan with einsum attention, full-vocabulary logits and the expanded MLA cache
MODELS = ("qwen3_30b_a3b", "olmoe_1b_7b", "mixtral_8x7b")
LARGE_MODELS = ("glm4_5_air", "qwen3_235b_a22b", "deepseek_v3", "kimi_k2")  # issue 13's presets
TOPOLOGIES = ("v5e:4x4", "v5p:2x2x1", "v5p:2x2x4", "v5e:16x16", "v5p:4x4x4")
_MARK = "SCALE_PLAN_CELL "


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS),
                    help=f"presets (models/config.py); 'large' adds {', '.join(LARGE_MODELS)}")
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    ap.add_argument("--programs", nargs="+", default=["train", "decode"], choices=["train", "decode"])
    ap.add_argument("--backend", default="auto", choices=["auto", "tpu", "cpu"],
                    help="auto: tpu when libtpu is importable, else simulated CPU devices")
    ap.add_argument("--rl-batch", type=int, default=256, help="sequences in the RL batch (and decode slots)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rows-per-chip", type=int, default=1, help="train minibatch rows per batch shard")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--remat", default="full",
                    help="MoeConfig.remat of the train step where the model has it (per-layer activation "
                         "checkpointing; the decode step never differentiates)")
    ap.add_argument("--attention", default=None,
                    help="MoeConfig.attention_impl of every cell (default: splash for a TPU compile, blockwise "
                         "on simulated CPU meshes; xla is the reference einsum)")
    ap.add_argument("--stop-at-fit", action="store_true",
                    help="per model and program, skip the topologies with more chips than the first that fits "
                         "with the headroom (topologies are visited by chip count)")
    ap.add_argument("--cell-timeout", type=float, default=1200.0, help="seconds per cell (its own process)")
    ap.add_argument("--rerun", action="store_true", help="recompute cells already in the results file")
    ap.add_argument("--retry-failed", action="store_true", help="recompute cells that timed out or errored")
    ap.add_argument("--quick", action="store_true", help="olmoe_1b_7b on v5e:4x4 only, seq 2048")
    ap.add_argument("--out", default=None, help="results file (default experiments/results/scale_plan.json)")
    ap.add_argument("--before", default=None,
                    help=f"an earlier plan for the peak before÷after column (default experiments/results/{BEFORE}.json)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                    help="write the cells of these results files (e.g. two runs over disjoint models) into --out "
                         "and print the table; each cell keeps the commit it ran on; a later file's cell replaces "
                         "an earlier one with the same key")
    ap.add_argument("--cell", default=None, help="MODEL,TOPOLOGY,PROGRAM: run one cell here, print its JSON")
    a = ap.parse_args(argv)
    if a.quick:
        a.models, a.topologies, a.seq_len = ["olmoe_1b_7b"], ["v5e:4x4"], 2048
    if "large" in a.models:
        a.models = [m for m in a.models if m != "large"] + list(LARGE_MODELS)
    return a


def resolve_backend(backend: str) -> str:
    from experiments.topologies import tpu_aot_available

    if backend == "auto":
        return "tpu" if tpu_aot_available() else "cpu"
    return backend


def with_field(cfg, name: str, value):
    """``cfg`` with ``name=value`` where MoeConfig has that field, else unchanged."""
    import dataclasses

    if value is None or name not in {f.name for f in dataclasses.fields(cfg)}:
        return cfg
    return cfg.replace(**{name: value})


def with_remat(cfg, remat: str | None):
    """``cfg`` with ``remat`` where MoeConfig has that field (scanned layers), else unchanged."""
    return with_field(cfg, "remat", remat)


def attention_for(backend: str, attention: str | None) -> str | None:
    """The attention kernel a cell compiles: ``attention`` if given, else Pallas splash attention for a
    TPU compile (``"auto"`` decides by the *host's* default backend, which is the CPU here) and the
    blockwise XLA kernel for simulated CPU meshes."""
    if attention is not None:
        return attention
    return "splash" if backend == "tpu" else "blockwise"


def run_cell(cfg, topo_name: str, program: str, *, backend: str, rl_batch: int, seq_len: int,
             rows_per_chip: int = 1, decode_steps: int = 8, layout=None, remat: str | None = None,
             attention: str | None = None) -> dict:
    """One cell in this process: build the abstract program, compile it, report per chip.

    ``cfg`` is a MoeConfig (or a preset name). The result has the cell's key fields, the mesh, the
    per-chip bytes of the inputs (experiments.aot_cells) and what the compiler said."""
    from models import MoeConfig
    from models.axes import MESH_AXES, ReplicationError
    from experiments import aot_cells, topologies

    name = cfg if isinstance(cfg, str) else None
    cfg = MoeConfig.preset(cfg) if isinstance(cfg, str) else cfg
    if program == "train":
        cfg = with_remat(cfg, remat)
    cfg = with_field(cfg, "attention_impl", attention_for(backend, attention))
    topo = topologies.topology(topo_name)
    t0 = time.perf_counter()
    devs = topologies.devices(topo, backend)
    tried = []
    if program == "train":
        # On TPU a layout that runs out of HBM is refused within seconds, so the cell tries the trainer's
        # layouts from the most parameter-sharded (all chips on fsdp) towards more data parallelism
        # (smaller expert-parallel groups, so fewer tokens gathered per chip) and keeps the first that
        # fits; XLA:CPU refuses nothing, so there only the first is compiled.
        layouts = [tuple(layout)] if layout is not None else aot_cells.train_layouts(cfg, topo.chips)
        if backend != "tpu":
            layouts = layouts[:1]
        best = None
        for lay in layouts:
            try:
                fn, args, info = aot_cells.train_program(cfg, devs, rows=min(rl_batch, rows_per_chip * topo.chips),
                                                         seq_len=seq_len, rl_batch=rl_batch, layout=lay)
            except ReplicationError as e:  # an array no mesh axis splits (models.axes): not a layout to compile
                tried.append({"mesh": dict(zip(MESH_AXES["train"], lay)), "status": "replicates", "compile_s": 0.0,
                              "error": str(e)[:300]})
                continue
            build_s = time.perf_counter() - t0
            resident = info["params_bytes"] + info["optimizer_bytes"]
            if backend == "tpu" and resident > topo.hbm_bytes:
                # parameters + AdamW state alone exceed HBM on this layout: no program can fit, and
                # libtpu takes minutes to say so for a 671B model (more data parallelism only adds)
                report = resident_report(resident, topo.hbm_bytes)
            else:
                report = aot_cells.compile_report(fn, args)
            tried.append({"mesh": info["mesh"], "status": report["status"], "compile_s": report["compile_s"],
                          "peak_bytes": report.get("peak_bytes") or report.get("required_bytes"),
                          **({"error": report["error"][:300]} if report["status"] == "error" else {})})
            need = report.get("peak_bytes") or report.get("required_bytes") or float("inf")
            if best is None or report["status"] == "fits" or need < best[0]:
                best = (need, info, report, build_s)
            if report["status"] == "fits" or report.get("not_compiled"):
                break  # RESOURCE_EXHAUSTED or a compiler error (libtpu 0.0.42 has layout bugs): try the next
        if best is None:
            raise ReplicationError("layout", layouts, "a layout that replicates no array",
                                   f"every train layout tried replicates an array: {tried}")
        _, info, report, build_s = best
        report = {**report, "compile_s": sum(t["compile_s"] for t in tried)}
    elif program == "decode":
        # On TPU the cell tries the engine's layouts best first (aot_cells.decode_order: lane-aligned expert
        # shares, then the fewest resident bytes) and keeps the first that fits with HEADROOM free, as the
        # train cell does (a layout's temporaries show only when compiled); XLA:CPU refuses nothing, so
        # there only the first is compiled. An MLA latent pool over tensor is replicated (the server's
        # --allow-replication): such layouts compete, and the cell's "replicated" names what they replicate.
        if layout is not None:
            layouts = [tuple(layout)]
        else:
            layouts = aot_cells.decode_order(cfg, devs, slots=rl_batch, seq_len=seq_len, allow_replication=True)
        if backend != "tpu":
            layouts = layouts[:1]
        best = None
        for lay in layouts[:DECODE_TRIES]:
            fn, args, info = aot_cells.decode_program(cfg, devs, slots=rl_batch, seq_len=seq_len,
                                                      decode_steps=decode_steps, layout=lay, allow_replication=True)
            build_s = time.perf_counter() - t0
            resident = info["params_bytes"] + info["slot_state_bytes"]
            if backend == "tpu" and resident > topo.hbm_bytes:
                report = resident_report(resident, topo.hbm_bytes)
            else:
                report = aot_cells.compile_report(fn, args)
            need = report.get("peak_bytes") or report.get("required_bytes") or float("inf")
            tried.append({"mesh": info["mesh"], "status": report["status"], "compile_s": report.get("compile_s", 0.0),
                          "peak_bytes": report.get("peak_bytes") or report.get("required_bytes"),
                          **({"error": report["error"][:300]} if report["status"] == "error" else {})})
            rank = (report["status"] != "fits", need)  # a fitting layout first, then the smaller peak
            if best is None or rank < best[0]:
                best = (rank, info, report, build_s)
            if report["status"] == "fits" and need <= (1 - HEADROOM) * topo.hbm_bytes:
                break
        _, info, report, build_s = best
        report = {**report, "compile_s": sum(t["compile_s"] for t in tried)}
    else:
        raise ValueError(f"program={program!r}: expected one of {aot_cells.PROGRAMS}")
    if backend == "cpu" and report["status"] == "fits":
        # XLA:CPU refuses nothing: judge its peak against the chip's nominal HBM, and say it is an estimate
        report["status"] = "fits" if report["peak_bytes"] <= topo.hbm_bytes else "exceeds_hbm_estimate"
        report["estimate"] = "XLA:CPU peak on simulated devices; not a TPU compile"
    return {"model": name or "custom", "topology": topo.name, "program": program, "backend": backend,
            "commit": _commit(),
            "chips": topo.chips, "hbm_bytes": topo.hbm_bytes, "rl_batch": rl_batch, "seq_len": seq_len,
            "remat": getattr(cfg, "remat", None), "attention_impl": getattr(cfg, "attention_impl", None),
            "mla_cache": getattr(cfg, "mla_cache", None) if cfg.attention == "mla" else None,
            "scan_layers": getattr(cfg, "scan_layers", None),
            "num_moe_layers": cfg.num_moe_layers, "top_k": cfg.top_k, "num_experts": cfg.num_experts,
            "build_s": build_s, "layouts_tried": tried, **info, **report}


def resident_report(resident: int, hbm: int) -> dict:
    """A cell not compiled because the arrays it keeps resident (parameters + optimizer state, or
    parameters + the engine's slot state) already exceed one chip's HBM: the lower bound of its peak."""
    return {"status": "RESOURCE_EXHAUSTED", "compile_s": 0.0, "required_bytes": resident, "available_bytes": hbm,
            "not_compiled": "resident arrays (parameters + optimizer or slot state) exceed HBM"}


def _commit() -> str:
    """The code's git commit (+ "-dirty" with uncommitted changes): cells of other code differ. Result
    files are outputs, not code (:func:`experiments.common.provenance`): a fresh result of another
    experiment does not make a cell dirty."""
    from experiments.common import provenance

    p = provenance()
    return p["commit"] + ("-dirty" if p["dirty"] and p["commit"] != "unknown" else "")


def cell_key(c: dict) -> tuple:
    return (c["model"], c["topology"], c["program"], c["backend"], c["rl_batch"], c["seq_len"])


# ---- driver --------------------------------------------------------------------------------------
def _child_env(backend: str, chips: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # libtpu compiles for the topology; no TPU is opened
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile seconds are measured: no persistent cache
    if backend == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={chips}").strip()
    return env


def _spawn(a, backend: str, model: str, topo, program: str) -> dict:
    cmd = [sys.executable, "-m", "experiments.scale_plan", "--cell", f"{model},{topo.name},{program}",
           "--backend", backend, "--rl-batch", str(a.rl_batch), "--seq-len", str(a.seq_len),
           "--rows-per-chip", str(a.rows_per_chip), "--decode-steps", str(a.decode_steps), "--remat", a.remat]
    if a.attention:
        cmd += ["--attention", a.attention]
    base = {"model": model, "topology": topo.name, "program": program, "backend": backend, "chips": topo.chips,
            "hbm_bytes": topo.hbm_bytes, "rl_batch": a.rl_batch, "seq_len": a.seq_len}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.cell_timeout,
                           env=_child_env(backend, topo.chips), cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "compile_s": time.perf_counter() - t0, "timeout_s": a.cell_timeout}
    for line in p.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    return {**base, "status": "error", "compile_s": time.perf_counter() - t0, "returncode": p.returncode,
            "error": (p.stderr or p.stdout)[-2000:]}


def _gib(b) -> str:
    return "" if b is None else f"{b / (1 << 30):.2f}"


def peak_of(c: dict) -> tuple[float | None, bool]:
    """(peak bytes per chip, whether that is a lower bound: libtpu's "required" of a refused program)."""
    peak = c.get("peak_bytes") or c.get("required_bytes")
    return peak, c["status"] == "RESOURCE_EXHAUSTED"


def saving(c: dict, before: dict | None) -> str:
    """Peak before ÷ after for the same (model, topology, program): ``>`` where only "before" was refused
    (its figure is a lower bound, so is the ratio); empty where it cannot be bounded."""
    if before is None:
        return ""
    (b, b_low), (a, a_low) = peak_of(before), peak_of(c)
    if not a or not b or a_low:
        return ""
    return (">" if b_low else "") + f"{b / a:.1f}"


def summary_rows(cells: list[dict], before: list[dict] | None = None) -> list[dict]:
    """One table row per cell; ``before``: the same cells from an earlier plan, for the peak ratio."""
    prior = {(c["model"], c["topology"], c["program"]): c for c in before or []}
    rows = []
    for c in cells:
        mesh = c.get("mesh") or {}
        peak = c.get("peak_bytes") or c.get("required_bytes")
        rows.append({"model": c["model"], "topology": c["topology"], "chips": c["chips"], "program": c["program"],
                     "mesh": "x".join(f"{k[0]}{v}" for k, v in mesh.items()) if mesh else "",
                     "params GiB/chip": _gib(c.get("params_bytes")), "opt GiB/chip": _gib(c.get("optimizer_bytes")),
                     "peak GiB/chip": (">" if c["status"] == "RESOURCE_EXHAUSTED" else "") + _gib(peak),
                     "HBM GiB": _gib(c["hbm_bytes"]),
                     "% HBM": "" if c["status"] != "fits" else f"{100 * peak / c['hbm_bytes']:.0f}",
                     "status": c["status"],
                     "peak before÷after": saving(c, prior.get((c["model"], c["topology"], c["program"]))),
                     "compile s": round(c.get("compile_s", 0.0), 1),
                     "routes MiB/chip": "" if c.get("routes_bytes") is None else f"{c['routes_bytes'] / 2**20:.1f}",
                     "routes [B,S,L,K]/chip": "x".join(map(str, (c.get("routes_sharding") or {}).get("chip_shape", [])))})
    rows.sort(key=lambda r: (r["model"], r["program"], r["chips"], r["topology"]))
    return rows


COLUMNS = ["model", "topology", "chips", "program", "mesh", "params GiB/chip", "opt GiB/chip", "peak GiB/chip",
           "HBM GiB", "% HBM", "status", "peak before÷after", "compile s", "routes MiB/chip", "routes [B,S,L,K]/chip"]


def with_headroom(c: dict) -> bool:
    """Whether a cell fits with :data:`HEADROOM` of its HBM free."""
    return c["status"] == "fits" and c["peak_bytes"] <= (1 - HEADROOM) * c["hbm_bytes"]


def smallest_fitting(cells: list[dict]) -> dict[str, dict]:
    """Per (model, program): the fitting topology with the fewest chips (then least total HBM) whose peak
    leaves :data:`HEADROOM` of HBM free (a program at 99% of HBM fits the compiler, not a real run), the
    topologies that failed with RESOURCE_EXHAUSTED, and those that fit above the headroom."""
    out: dict[str, dict] = {}
    for c in cells:
        entry = out.setdefault(f"{c['model']}/{c['program']}", {"smallest": None, "resource_exhausted": [],
                                                               "not_compiled": [], "above_headroom": []})
        if c["status"] == "fits" and not with_headroom(c):
            entry["above_headroom"].append(c["topology"])
        elif c["status"] == "fits":
            best = entry["smallest"]
            key = (c["chips"], c["chips"] * c["hbm_bytes"])
            if best is None or key < (best["chips"], best["chips"] * best["hbm_bytes"]):
                entry["smallest"] = {"topology": c["topology"], "chips": c["chips"], "hbm_bytes": c["hbm_bytes"],
                                     "peak_bytes": c["peak_bytes"]}
        elif c["status"] == "RESOURCE_EXHAUSTED":
            entry["resource_exhausted"].append(c["topology"])
        else:
            entry["not_compiled"].append(f"{c['topology']} ({c['status']})")
    return out


def smallest_lines(cells: list[dict]) -> list[str]:
    """One sentence per (model, program): the smallest topology it fits and where it ran out of HBM."""
    lines = []
    for k, v in smallest_fitting(cells).items():
        s = v["smallest"]
        where = f"{s['topology']} ({s['chips']} chips)" if s else "none of those compiled"
        lines.append(f"{k}: smallest fitting {where} (peak <= {100 - 100 * HEADROOM:.0f}% of HBM); "
                     f"RESOURCE_EXHAUSTED on {', '.join(v['resource_exhausted']) or 'none'}"
                     + (f"; fits above {100 - 100 * HEADROOM:.0f}% of HBM on {', '.join(v['above_headroom'])}"
                        if v["above_headroom"] else "")
                     + (f"; not compiled: {', '.join(v['not_compiled'])}" if v["not_compiled"] else ""))
    return lines


def _load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return json.loads(path.read_text()).get("cells", [])


def _write(path: Path, a, backend: str, cells: list[dict]) -> None:
    from experiments.common import environment

    payload = {"environment": environment(), "backend": backend,
               "settings": {"rl_batch": a.rl_batch, "seq_len": a.seq_len, "rows_per_chip": a.rows_per_chip,
                            "decode_steps": a.decode_steps, "remat": a.remat, "cell_timeout_s": a.cell_timeout,
                            "optimizer": "optax.adamw (mu, nu in the parameter dtype)", "replay": "rollout (R3)"},
               "note": "compile seconds on a shared 2-core CPU host (other jobs running): an upper bound",
               "cells": cells, "smallest_fitting": smallest_fitting(cells)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)


def main(argv=None) -> int:
    a = _args(argv)
    backend = resolve_backend(a.backend)
    if a.cell:
        model, topo, program = a.cell.split(",")
        c = run_cell(model, topo, program, backend=backend, rl_batch=a.rl_batch, seq_len=a.seq_len,
                     rows_per_chip=a.rows_per_chip, decode_steps=a.decode_steps, remat=a.remat,
                     attention=a.attention)
        print(_MARK + json.dumps(c, default=str), flush=True)
        return 0
    from experiments.common import RESULTS, table
    from experiments.topologies import topology

    path = Path(a.out) if a.out else RESULTS / f"{RESULT}.json"
    if a.merge:
        merged: dict[tuple, dict] = {}
        for f in a.merge:
            merged.update({cell_key(c): c for c in _load(Path(f))})
        cells = list(merged.values())
        _write(path, a, backend, cells)
        a.models, a.topologies = [], []  # nothing to compute: print the merged table below
    else:
        cells = _load(path)
    done = {cell_key(c): i for i, c in enumerate(cells)}
    topos = [topology(n) for n in a.topologies]
    if a.stop_at_fit:
        topos.sort(key=lambda t: (t.chips, t.total_hbm_bytes))
    for model in a.models:
        fitted: dict[str, int] = {}  # program -> chips of the first topology it fits (--stop-at-fit)
        for topo in topos:
            for program in a.programs:
                key = (model, topo.name, program, backend, a.rl_batch, a.seq_len)
                old = cells[done[key]] if key in done else None
                if a.stop_at_fit and program in fitted and topo.chips > fitted[program]:
                    continue
                if old is not None and with_headroom(old):
                    fitted.setdefault(program, topo.chips)
                if old is not None and not a.rerun and not (a.retry_failed and old["status"] in ("timeout", "error")):
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] {model} {topo.name} {program} ({backend}) ...", flush=True)
                c = _spawn(a, backend, model, topo, program)
                if with_headroom(c):
                    fitted.setdefault(program, topo.chips)
                print(f"    {c['status']} in {c.get('compile_s', 0):.0f} s, peak "
                      f"{_gib(c.get('peak_bytes') or c.get('required_bytes'))} GiB/chip", flush=True)
                if old is not None:
                    cells[done[key]] = c
                else:
                    done[key] = len(cells)
                    cells.append(c)
                _write(path, a, backend, cells)
    _write(path, a, backend, cells)
    before = _load(Path(a.before) if a.before else RESULTS / f"{BEFORE}.json")
    print(table(summary_rows(cells, before), COLUMNS))
    print("\n".join(smallest_lines(cells)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
