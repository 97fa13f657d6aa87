"""Bytes the engine's decode step moves on a TPU chip, against the bytes it must read, from libtpu's
ahead-of-time compile on this CPU host (nothing is allocated).

    .venv-tpu/bin/python -m experiments.decode_bytes [--quick]      # or: make decode-bytes

The program is the engine's mixed step with decode rows only (:func:`experiments.aot_cells.decode_program`:
``--slots`` requests, each with a page table of ``--seq-len`` tokens, every page of the pool live), on
the layout with the fewest resident bytes per chip. "Must read" per chip = the parameters a chip holds
+ its share of the live KV pool: a decode step has to read each once. ``bytes_accessed`` is XLA's cost
estimate of the compiled program, per chip: it counts a while loop's body once and a Pallas kernel's own
DMAs not at all, so the models are compiled with their layers unrolled and few of them (``--layers``,
the preset's shapes otherwise), and the attention runs twice: ``auto`` (on TPU the ragged paged attention
kernel; the figure is then everything *outside* the kernel, e.g. re-laying the pages out for it) and
``xla`` (our gather-over-pages loop; its loop over key blocks is counted once, so the figure is a
lower bound). Writes experiments/results/decode_bytes.json.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles for the topology; no TPU is opened

MODELS = ("qwen3_30b_a3b", "olmoe_1b_7b", "mixtral_8x7b", "deepseek_v3")
TOPOLOGY = {"qwen3_30b_a3b": "v5p:2x2x1", "olmoe_1b_7b": "v5p:2x2x1", "mixtral_8x7b": "v5p:2x2x1",
            "deepseek_v3": "v5p:2x2x1"}


def cell(name: str, topo_name: str, impl: str, *, layers: int, slots: int, seq_len: int) -> dict:
    from models import MoeConfig
    from experiments import aot_cells, topologies

    base = MoeConfig.preset(name)
    # keep at least one MoE layer after the preset's dense ones
    n = max(layers, base.first_dense_layers + 1)
    cfg = base.replace(num_layers=n, scan_layers=False, attention_impl=impl)
    topo = topologies.topology(topo_name)
    devs = topologies.devices(topo, "tpu")
    t0 = time.perf_counter()
    fn, args, info = aot_cells.decode_program(cfg, devs, slots=slots, seq_len=seq_len)
    report = aot_cells.compile_report(fn, args)
    must = info["params_bytes"] + info["kv_cache_bytes"]
    row = {"model": name, "layers": n, "topology": topo_name, "attention": impl, "slots": slots, "seq_len": seq_len,
           "mesh": info["mesh"], "params_bytes": info["params_bytes"], "kv_cache_bytes": info["kv_cache_bytes"],
           "must_read_bytes": must, "status": report["status"], "compile_s": time.perf_counter() - t0}
    if report["status"] == "fits":
        row.update(bytes_accessed=report["bytes_accessed"], accessed_over_must_read=report["bytes_accessed"] / must,
                   peak_bytes=report["peak_bytes"])
    else:
        row["error"] = report.get("error", "")[:300]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--layers", type=int, default=2, help="layers per model (unrolled; see the docstring)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="olmoe_1b_7b only")
    args = ap.parse_args()
    from experiments.common import table, write_json
    from experiments.topologies import tpu_aot_available

    if not tpu_aot_available():
        raise SystemExit("decode_bytes needs libtpu (the tpu-aot extra): run it with .venv-tpu/bin/python "
                         "(make scale-plan creates that venv)")
    models = ["olmoe_1b_7b"] if args.quick else args.models
    rows = []
    for name in models:
        for impl in ("auto", "xla"):  # "auto" takes the Pallas kernel on TPU where it applies
            rows.append(cell(name, TOPOLOGY.get(name, "v5p:2x2x1"), impl, layers=args.layers, slots=args.slots,
                             seq_len=args.seq_len))
            print({k: v for k, v in rows[-1].items() if k != "mesh"}, flush=True)
    for r in rows:
        for k, mib in (("params_bytes", "params_mib"), ("kv_cache_bytes", "kv_cache_mib"),
                       ("must_read_bytes", "must_read_mib"), ("bytes_accessed", "accessed_mib")):
            if k in r:
                r[mib] = r[k] / 2**20
    print(table(rows, ["model", "layers", "topology", "attention", "params_mib", "kv_cache_mib", "must_read_mib",
                       "accessed_mib", "accessed_over_must_read", "status"]))
    path = write_json("decode_bytes", {"quick": args.quick, "layers": args.layers, "slots": args.slots,
                                       "seq_len": args.seq_len, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
