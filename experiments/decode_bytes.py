"""Bytes the engine's decode step moves on a TPU chip, against the bytes it must read, from libtpu's
ahead-of-time compile on this CPU host (nothing is allocated).

    .venv-tpu/bin/python -m experiments.decode_bytes [--quick]      # or: make decode-bytes

The program is the engine's decode call with decode rows only (:func:`experiments.aot_cells.decode_program`:
``--slots`` requests, each with a page table of ``--seq-len`` tokens, every page of the pool live), on
the scale plan's first layout. "Must read" per chip = the parameters a chip holds + its share of the
live KV pool: a decode step has to read each once. ``bytes_accessed`` is XLA's cost estimate of the
compiled program, per chip. It counts a while loop's body once, a Pallas kernel's own DMAs not at all, a
conditional as its costliest branch, and an in-place scatter into the layers' stacked pool as more
than the rows it writes (a share that grows with the stack). So each model is compiled with its layers
unrolled and few of them (``--layers``, at least one MoE layer after its dense ones; the preset's shapes
otherwise), and once more with one MoE layer more on the same layout. Per cell:

- ``accessed_over_must_read``: the ``n``-layer program as compiled. The LM head and the sampler weigh
  as much there as ``L / n`` times what they would in the preset's ``L`` layers.
- ``full_depth_ratio``: the program as compiled with the preset's ``L`` layers, all unrolled, on the
  same layout (``full_depth_layers``): what the deployed step moves ÷ what it must read. Compiled only
  where a chip of the slice holds that must-read (``full_depth_status`` says why not otherwise).
- ``sampler_mib``: the sampler alone (:func:`r3jax.engine.sampling.sample_with_logprobs`) on the step's
  logits, sharded as the head's vocabulary, compiled by itself. Its costliest branch is the
  full-vocabulary sort, which runs only when a row's top-k/top-p set spills past the sort-free path's
  candidates; ``without_sampler_ratio`` is (accessed - sampler) ÷ must-read, an estimate (the sampler
  fuses a little differently inside the step).
- ``greedy_ratio`` and ``sampled_ratio``: the ``n``-layer program again, each traced as a call of
  one kind runs it, ÷ must-read: with every row greedy (the sampler's conditional replaced by its greedy
  branch: an argmax and a log-softmax), and with rows sampling at a temperature without top-k/top-p
  (the random draw, the filter's conditional replaced by its pass-through branch: what an RL rollout
  at temperature 1 runs). The engine compiles one program for every mix of sampling parameters and
  picks the branch on device, so these are the bytes such a call moves, which the program's own
  estimate (costliest branches) cannot show.
- ``per_layer_ratio``: the extra layer's accessed ÷ its must-read (its weights and its share of the
  pool): what a layer moves, free of the embedding, head and sampler (with the kernel, its reads of the
  pool are not counted, so the figure can fall below 1; the scatter's share makes it grow slowly with
  the stack).

The attention runs both ways: ``auto`` (on TPU the ragged paged attention kernel; the figure is then
everything *outside* the kernel, e.g. re-laying the pages out for it) and ``xla`` (our
gather-over-pages loop; its loop over key blocks is counted once, so the figure is a lower bound).
Writes experiments/results/decode_bytes.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

# the printed table's columns, and the measurements page's (experiments/renderers.py imports them)
COLUMNS = ["model", "layers", "attention", "params_mib", "kv_cache_mib", "must_read_mib", "accessed_mib",
           "accessed_over_must_read", "full_depth_ratio", "sampler_mib", "without_sampler_ratio", "greedy_ratio",
           "sampled_ratio", "per_layer_ratio", "status"]
MODELS = ("qwen3_30b_a3b", "olmoe_1b_7b", "mixtral_8x7b", "deepseek_v3")
TOPOLOGY = {"qwen3_30b_a3b": "v5p:2x2x1", "olmoe_1b_7b": "v5p:2x2x1", "mixtral_8x7b": "v5p:2x2x1",
            "deepseek_v3": "v5p:2x2x1"}


def cell(name: str, topo_name: str, impl: str, *, layers: int, slots: int, seq_len: int) -> dict:
    from models import MoeConfig
    from experiments import aot_cells, topologies

    base = MoeConfig.preset(name)
    # keep at least one MoE layer after the preset's dense ones; the second compile adds one more
    n = max(layers, base.first_dense_layers + 1)
    devs = topologies.devices(topologies.topology(topo_name), "tpu")
    t0 = time.perf_counter()
    runs, layout = [], None
    for depth in (n, n + 1):
        cfg = base.replace(num_layers=depth, scan_layers=False, attention_impl=impl)
        fn, args, info = aot_cells.decode_program(cfg, devs, slots=slots, seq_len=seq_len, layout=layout)
        layout = tuple(info["mesh"][a] for a in aot_cells.ENGINE_AXES)  # the same layout for the second
        report = aot_cells.compile_report(fn, args)
        runs.append((info, report))
        if report["status"] != "fits":
            break
    if runs[-1][1]["status"] == "fits":
        for kind in CALL_KINDS:  # the n-layer program as a call of each kind runs it
            with call_kind(kind):
                fn, args_k, _ = aot_cells.decode_program(base.replace(num_layers=n, scan_layers=False,
                                                                      attention_impl=impl),
                                                         devs, slots=slots, seq_len=seq_len, layout=layout)
                runs.append((kind, aot_cells.compile_report(fn, args_k)))
            if runs[-1][1]["status"] != "fits":
                break
    info, report = runs[0]
    must = info["params_bytes"] + info["kv_cache_bytes"]
    row = {"model": name, "layers": n, "topology": topo_name, "attention": impl,
           "slots": slots, "seq_len": seq_len, "mesh": info["mesh"], "params_bytes": info["params_bytes"],
           "kv_cache_bytes": info["kv_cache_bytes"], "must_read_bytes": must, "status": report["status"]}
    if any(r["status"] != "fits" for _, r in runs):
        bad = next(r for _, r in runs if r["status"] != "fits")
        row.update(status=bad["status"], error=bad.get("error", "")[:300], compile_s=time.perf_counter() - t0)
        return row
    info2, report2 = runs[1]
    kinds = {kind: r["bytes_accessed"] for kind, r in runs[2:]}
    acc, layer_acc = report["bytes_accessed"], report2["bytes_accessed"] - report["bytes_accessed"]
    layer_must = info2["params_bytes"] + info2["kv_cache_bytes"] - must
    sampler = sampler_bytes(args, base.vocab_size, info["core_slots"])
    row.update(bytes_accessed=acc, accessed_over_must_read=acc / must, peak_bytes=report["peak_bytes"],
               sampler_bytes=sampler, without_sampler_ratio=(acc - sampler) / must,
               greedy_bytes=kinds["greedy"], greedy_ratio=kinds["greedy"] / must,
               sampled_bytes=kinds["sampled"], sampled_ratio=kinds["sampled"] / must,
               layer_accessed_bytes=layer_acc, layer_must_read_bytes=layer_must, per_layer_ratio=layer_acc / layer_must)
    row.update(full_depth(base, devs, impl, layout, must + (base.num_layers - n) * layer_must, slots=slots,
                          seq_len=seq_len, hbm_bytes=topologies.topology(topo_name).hbm_bytes),
               compile_s=time.perf_counter() - t0)
    return row


def full_depth(base, devs, impl: str, layout, must_estimate: float, *, slots: int, seq_len: int,
               hbm_bytes: int) -> dict:
    """The program as compiled at the preset's own depth (its layers unrolled, the same layout), where a
    chip holds what it must read (``must_estimate``: the n-layer must-read plus the extra layers' at the
    measured per-layer size); its sampler and head then weigh what they do in the deployed model."""
    from experiments import aot_cells

    out = {"full_depth_layers": base.num_layers}
    if must_estimate > hbm_bytes:
        return out | {"full_depth_status": f"not compiled: must-read {must_estimate / 2**30:.0f} GiB a chip, "
                                           f"more than its {hbm_bytes / 2**30:.0f} GiB"}
    cfg = base.replace(scan_layers=False, attention_impl=impl)
    fn, args, info = aot_cells.decode_program(cfg, devs, slots=slots, seq_len=seq_len, layout=layout)
    report = aot_cells.compile_report(fn, args)
    if report["status"] != "fits":
        return out | {"full_depth_status": report["status"], "full_depth_error": report.get("error", "")[:300]}
    must = info["params_bytes"] + info["kv_cache_bytes"]
    return out | {"full_depth_status": "fits", "full_depth_must_read_bytes": must,
                  "full_depth_accessed_bytes": report["bytes_accessed"],
                  "full_depth_ratio": report["bytes_accessed"] / must}


CALL_KINDS = ("greedy", "sampled")


@contextlib.contextmanager
def call_kind(kind: str):
    """Trace the engine's step as a call of ``kind`` runs it: "greedy" (every row greedy: the sampler's
    greedy branch) or "sampled" (rows at a temperature, no top-k/top-p: the sampling branch with the
    filter's pass-through). Patches the names the step and the sampler look up at trace time."""
    from unittest import mock

    from r3jax.engine import sampling, step

    if kind == "greedy":
        patch = mock.patch.object(step, "sample_with_logprobs", sampling._greedy)
    elif kind == "sampled":
        patch = mock.patch.object(step, "sample_with_logprobs", sampling._sample_hot)
    else:
        raise ValueError(f"call kind {kind!r}: expected one of {CALL_KINDS}")
    unfiltered = mock.patch.object(sampling, "filter_logits", lambda scaled, *a, **k: scaled)
    with patch, unfiltered:
        yield


def sampler_bytes(args, vocab: int, rows: int) -> float:
    """XLA's bytes accessed of the sampler alone on ``[rows, vocab]`` f32 logits sharded as the LM head's
    vocabulary dim (``args``: the decode program's; params first, the step inputs last but one)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from r3jax.engine.sampling import sample_with_logprobs

    params, x = args[0], args[5]
    mesh = x.temperature.sharding.mesh
    head = params["lm_head"] if "lm_head" in params else None
    vocab_axes = (head.get_value().sharding.spec[1] if head is not None
                  else params["embed"].get_value().sharding.spec[0])
    sds = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    logits = sds((rows, vocab), jnp.float32, P(None, vocab_axes))
    inputs = (logits, sds((rows, 2), jnp.uint32), sds((rows,), jnp.int32), sds((rows,), jnp.float32),
              sds((rows,), jnp.int32), sds((rows,), jnp.float32), sds((rows,), jnp.bool_))
    cost = jax.jit(sample_with_logprobs).lower(*inputs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["bytes accessed"])


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX loads: libtpu compiles for the topology, opens no TPU
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
                       ("must_read_bytes", "must_read_mib"), ("bytes_accessed", "accessed_mib"),
                       ("sampler_bytes", "sampler_mib")):
            if k in r:
                r[mib] = r[k] / 2**20
    print(table(rows, COLUMNS))
    path = write_json("decode_bytes", {"quick": args.quick, "layers": args.layers, "slots": args.slots,
                                       "seq_len": args.seq_len, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
