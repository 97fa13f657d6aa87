"""Render the README's measurement tables from experiments/results/*.json (the latest runs).

    python -m experiments.readme_tables [--write]

Prints the Markdown for every placeholder; ``--write`` replaces the tables between the
``<!-- NAME -->`` / ``<!-- /NAME -->`` markers in README.md, so the README always shows the
numbers of the JSON files on disk.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from experiments.common import RESULTS, table

README = Path(__file__).resolve().parent.parent / "README.md"


def _load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _pm(value):
    """``[mean, ci95]`` pairs (multi-seed summaries) as "m ± h"; seed lists as their count."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, float) for v in value):
        return f"{value[0]:.3g} ± {value[1]:.2g}"
    if isinstance(value, list):
        return len(value)
    return value


def _t(rows, cols):
    return table(rows, cols) if rows else "(not run yet)"


def tables() -> dict[str, str]:
    out = {}
    d = _load("bench_model")
    if d:
        out["BENCH_MODEL"] = _t(d["rows"], ["config", "moe_impl", "B", "T", "live_tok_s", "replay_tok_s",
                                            "replay_overhead"])
    d = _load("bench_decode")
    if d:
        out["BENCH_DECODE"] = _t(d["decode"], ["config", "moe_impl", "B", "ours_capture_on_tok_s",
                                               "ours_capture_off_tok_s", "capture_on_over_off", "hf_tok_s",
                                               "ours_over_hf", "hf_same_tokens"])
        out["BENCH_KERNELS"] = _t(d["kernels"], ["config", "moe_impl", "B", "tok_s"])
        out["BENCH_MULTITURN"] = _t([m for m in d["multiturn"] if m["turn"] in (1, 2, 4, 8, 16)],
                                    ["turn", "prompt_tokens", "cached_tokens", "prefill_tokens_with_cache",
                                     "prefill_tokens_without_cache"])
    d = _load("bench_trace")
    if d:
        out["BENCH_TRACE_TIME"] = _t(d["append"], ["turns", "MiB", "trace_ms", "naive_ms", "trace_us_per_turn",
                                                   "naive_us_per_turn", "naive_over_trace"])
        out["BENCH_TRACE_WIRE"] = _t([w for w in d["wire"] if w["rows"] > 1],
                                     ["model", "dtype", "raw_B_row", "json_b64_B_row", "binary_B_row",
                                      "json_over_raw", "binary_over_raw", "sglang_over_raw"])
        out["BENCH_TRACE_FILL"] = _t(d["fill"], ["layout", "trajectories", "rows", "fill_ratio", "slots_vs_padded"])
    d = _load("bench_serve")
    if d:
        out["BENCH_SERVE"] = (_t(d["throughput"], ["concurrency", "requests", "http_req_s", "http_tok_s",
                                                  "engine_req_s", "http_vs_engine", "mean_server_batch",
                                                  "vs_serial"]) + "\n\n"
                              + _t(d["wire"], ["model", "raw_B_per_row", "json_B_per_row", "binary_B_per_row",
                                               "json_vs_raw", "binary_vs_raw"]))
    d = _load("transfer_cost_route_heavy") or _load("transfer_cost")
    if d:
        out["BENCH_TRANSFER"] = _t(d["ratios"], ["wire", "T", "expected_(T+1)/2", "rows_ratio",
                                                 "wire_route_bytes_ratio", "server_gather_ratio",
                                                 "server_encode_ratio", "client_decode_ratio"])
        out["BENCH_TRANSFER_ABS"] = _t([r for r in d["rows"] if r["T"] == max(x["T"] for x in d["rows"])],
                                       ["wire", "T", "mode", "rows", "raw_bytes", "wire_route_bytes",
                                        "server_gather_ms", "server_encode_ms", "client_decode_ms"])
    d = _load("bench_ep")
    if d:
        out["BENCH_EP"] = _t(d["cost"], ["kernel", "mesh", "layer", "flops_ratio", "bytes_ratio"])
        out["BENCH_EP_TIME"] = _t(d["wall"], ["run", "step_s", "vs_data8_replicated"])
    d = _load("replay_mismatch")
    if d:
        # not routing_disagreement / token_any_disagreement: in older results those compare the routes
        # replay used (the rollout's) with the rollout's, 0 under replay by construction
        out["BENCH_REPLAY"] = _t(d["rows"], ["config", "rollout", "replay", "live_routing_disagreement",
                                             "mean_abs_delta", "k3_kl", "f2"])
        out["BENCH_REPLAY_TIME"] = ("Train step with replay ÷ without (fp32, bf16 batch; target ≤ 1.03): wall "
                                    "time in interleaved pairs, and XLA's cost analysis of the two compiled "
                                    "programs.\n\n" + _t(d.get("timing", []), [
                                        "config", "tokens", "step_s_live", "step_s_replay", "replay_step_ratio",
                                        "ratio_of_min", "xla_flops_ratio", "xla_bytes_ratio", "reps"]))
    d = _load("interop")
    if d:
        out["INTEROP_CODEC"] = _t(d["codec"], ["model", "protocol", "raw_B_row", "route_B_row", "over_raw",
                                               "route_B_row_vs_r3jax", "encode_us_row", "encode_us_row_vs_r3jax",
                                               "decode_us_row", "decode_us_row_vs_r3jax"])
        out["INTEROP_HTTP"] = _t(d["http"], ["protocol", "requests", "concurrency", "req_s", "req_s_vs_r3jax"])
    d = _load("replay_rl")
    if d and d.get("complete"):
        rows = [{"arm": arm, "seeds": a["seeds"],
                 "final_reward": f"{a['final_reward_mean']:.3f} ± {a['final_reward_ci95']:.3f}",
                 "collapses": a["collapses"], "k3_kl median / p99": f"{a['k3_kl_median']:.2g} / {a['k3_kl_p99']:.2g}",
                 "mean_abs_delta median / p99": f"{a['mean_abs_delta_median']:.3g} / {a['mean_abs_delta_p99']:.3g}",
                 "clip_fraction": a["clip_fraction"], "grad_norm": a["grad_norm"],
                 "live_routing_disagreement": a["live_routing_disagreement"]} for arm, a in d["arms"].items()]
        paired = [{"precision": c["precision"], "comparison": c["comparison"], "seeds": c["seeds"],
                   "final reward, arm − none": f"{c['final_reward_diff']:+.4f} ± {c['ci95']:.4f}: {c['verdict']}",
                   "mean k3 KL, arm ÷ none": f"×{c['k3_ratio']:.2f} [{c['k3_ratio_ci95'][0]:.2f}, "
                                             f"{c['k3_ratio_ci95'][1]:.2f}]: {c['k3_verdict']}",
                   "mean abs Δ, arm − none": f"{c['abs_delta_diff']:+.2e} ± {c['abs_delta_ci95']:.1e}: "
                                             f"{c['abs_delta_verdict']}"} for c in d["comparisons"]]
        out["REPLAY_RL"] = _t(rows, list(rows[0])) + "\n\n" + _t(paired, list(paired[0]))
    d = _load("bench_scan")
    if d:
        out["BENCH_SCAN"] = _t(d["summary"], ["depth", "layout", "unrolled_compile_s", "scanned_compile_s", "ratio",
                                              "unrolled_cpu_s", "scanned_cpu_s", "cpu_ratio"])
        out["BENCH_SCAN_DECODE"] = _t(d.get("decode", []), ["depth", "layout", "B", "S", "ms_per_step",
                                                            "scanned_over_unrolled"])
    d = _load("bench_multiprocess")
    if d:
        out["BENCH_MULTIPROCESS"] = _t(d["results"], ["mesh", "B", "S", "one_ms", "one_gloo_ms", "two_ms",
                                                      "ratio", "ratio_gloo"])
    d = _load("scale_plan")
    if d:
        from experiments.scale_plan import COLUMNS, smallest_lines, summary_rows

        out["SCALE_PLAN"] = _t(summary_rows(d["cells"]), COLUMNS) + "\n\n" + "\n".join(
            f"- {line}" for line in smallest_lines(d["cells"]))
    d = _load("demo_summary")
    if d:
        cols = ["run", "seeds", "steps", "reward_first", "reward_last", "collapses", "k3_kl", "mean_abs_delta",
                "live_routing_disagreement"]
        rows = [{c: _pm(r.get(c)) for c in cols} for r in d["runs"]]
        effect = d.get("replay_effect")
        out["DEMO_RESULTS"] = _t(rows, cols) + ("" if not effect else (
            f"\n\nReplay − no replay, {effect['metric']}, paired over seeds {effect['seeds']}: "
            f"{effect['replay_minus_none']:+.3g} ± {effect['ci95']:.2g} (95% CI): {effect['verdict']}."))
    return out


def write(readme: Path = README) -> None:
    text = readme.read_text()
    for name, md in tables().items():
        block = f"<!-- {name} -->\n{md}\n<!-- /{name} -->"
        pattern = re.compile(rf"<!-- {name} -->.*?<!-- /{name} -->", re.S)
        text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.replace(name, block, 1)
    readme.write_text(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="update README.md in place")
    args = ap.parse_args()
    if args.write:
        write()
    for name, md in tables().items():
        print(f"## {name}\n{md}\n")


if __name__ == "__main__":
    main()
