"""Renderers: one result file (a dict) -> the Markdown of its section of docs/measurements.md.

Each takes the result as ``experiments/results/<name>.json`` holds it and returns a table or a few
(and a sentence where a figure needs one); which results are quoted, and the page around them, is
:mod:`experiments.readme_tables`.
"""

from __future__ import annotations

import json

from experiments.common import RESULTS, is_clean, table


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _cols(rows: list[dict], wanted: list[str]) -> list[str]:
    """The wanted columns that the rows have (metric names may differ between runs)."""
    return [c for c in wanted if rows and c in rows[0]]


def _t(rows: list[dict], wanted: list[str]) -> str:
    return table(rows, _cols(rows, wanted)) if rows else "(no rows)"


def _pm(value):
    """``[mean, ci95]`` pairs as "m ± h"; seed lists as their count."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, float) for v in value):
        return f"{value[0]:.3g} ± {value[1]:.2g}"
    if isinstance(value, list):
        return len(value)
    return value


def _same_tokens_only(rows: list[dict], ratio: str, same: str = "hf_same_tokens") -> list[dict]:
    """A speed ratio against a peer counts only where the peer decoded the same tokens."""
    return [{**r, ratio: r[ratio] if r.get(same) == 1 else "tokens differ"} for r in rows]


# --- renderers: result dict -> Markdown ----------------------------------------------------------

def demo(d: dict) -> str:
    cols = ["run", "seeds", "steps", "reward_first", "reward_last", "reward_gain", "eval_first", "eval_last",
            "collapses", "k3_kl", "mean_abs_delta",
            "live_routing_disagreement"]
    rows = [{c: _pm(r.get(c)) for c in cols if c in r} for r in d["runs"]]
    out = _t(rows, cols)
    if d.get("wall_s"):
        out += f"\n\nThe whole run took {d['wall_s']:.0f} s of wall time ({d['wall_s'] / 60:.1f} min), server start included."
    e = d.get("replay_effect")
    if e:
        out += (f"\n\nReplay − no replay, {e['metric']}, paired over seeds {e['seeds']}: "
                f"{e['replay_minus_none']:+.3g} ± {e['ci95']:.2g} (95% CI): {e['verdict']}.")
    return out


def learn_pilot(d: dict) -> str:
    cols = ["setting", "seeds", "steps", "reward_first", "reward_last", "reward_gain", "eval_first", "eval_last",
            "eval_gain", "live_routing_disagreement", "collapses", "learns"]
    rows = [{c: _pm(r.get(c)) for c in cols} for r in d["rows"]]
    learned = [r["setting"] for r in d["rows"] if r["learns"]]
    return _t(rows, cols) + ("\n\nSettings whose reward gain is >= 0.1 with a 95% CI above 0: "
                             + (", ".join(learned) if learned else "none") + ".")


def _grid(d: dict, tables) -> str:
    """A resumable grid's tables (``tables`` of its experiment), complete cells only."""
    cells = {k: v for k, v in d["cells"].items() if v["complete"]}
    note = "" if d.get("complete") else "\n\nThe grid is not complete: cells with fewer seeds than asked are left out."
    return tables({"cells": cells, "comparisons": d["comparisons"]}) + note


def replay_learn(d: dict) -> str:
    from experiments.replay_learn import tables

    return _grid(d, tables)


def async_rl(d: dict) -> str:
    from experiments.async_rl import tables

    return _grid(d, tables)


def replay_rl(d: dict) -> str:
    rows = [{"arm": arm, "seeds": a["seeds"],
             "final_reward": f"{a['final_reward_mean']:.3f} ± {a['final_reward_ci95']:.3f}",
             "collapses": a["collapses"], "k3_kl median / p99": f"{a['k3_kl_median']:.2g} / {a['k3_kl_p99']:.2g}",
             "mean_abs_delta median / p99": f"{a['mean_abs_delta_median']:.3g} / {a['mean_abs_delta_p99']:.3g}",
             "clip_fraction": a["clip_fraction"], "grad_norm": a["grad_norm"],
             "live_routing_disagreement": a.get("live_routing_disagreement", "")} for arm, a in d["arms"].items()]
    paired = [{"precision": c["precision"], "comparison": c["comparison"], "seeds": c["seeds"],
               "final reward, arm − none": f"{c['final_reward_diff']:+.4f} ± {c['ci95']:.4f}: {c['verdict']}",
               "mean k3 KL, arm ÷ none": f"×{c['k3_ratio']:.2f} [{c['k3_ratio_ci95'][0]:.2f}, "
                                         f"{c['k3_ratio_ci95'][1]:.2f}]: {c['k3_verdict']}",
               "mean abs Δ, arm − none": f"{c['abs_delta_diff']:+.2e} ± {c['abs_delta_ci95']:.1e}: "
                                         f"{c['abs_delta_verdict']}"} for c in d.get("comparisons", [])]
    out = table(rows, list(rows[0]))
    if paired:
        out += "\n\n" + table(paired, list(paired[0]))
    return out + "\n\n![replay_rl](../experiments/results/replay_rl.png)"


def replay_dose(d: dict) -> str:
    from experiments.dose_summary import tables

    done = [c for c, v in d["cells"].items() if v["complete"]]
    todo = [c for c, v in d["cells"].items() if not v["complete"]]
    per_commit = {}
    for per in d.get("run_provenance", {}).values():
        for p in per.values():
            per_commit[p["commit"]] = per_commit.get(p["commit"], 0) + 1
    out = ("Runs per commit: " + ", ".join(f"`{c}` {n}" for c, n in per_commit.items()) + ". Time ratios pair "
           "only runs of one commit.\n\n" if len(per_commit) > 1 else "")
    out += tables(d) if done else "No cell has all its seeds yet."
    if todo:
        out += ("\n\nStill running (fewer seeds than asked, not quoted): " + ", ".join(f"`{c}`" for c in todo) + ".")
    return out + "\n\n![replay_dose](../experiments/results/replay_dose.png)"


MISMATCH = ["config", "rollout", "replay", "live_routing_disagreement", "live_token_any_disagreement",
            "mean_abs_delta", "k3_kl", "f2"]
STEP_COST = ["config", "tokens", "step_s_live", "step_s_replay", "replay_step_ratio", "ratio_of_min",
             "xla_flops_ratio", "xla_bytes_ratio", "reps"]


def replay_mismatch(d: dict) -> str:
    out = (_t(d["rows"], MISMATCH) + "\n\nTrain step with replay ÷ without (wall time in interleaved pairs, "
           "and XLA's cost analysis of the two compiled programs):\n\n" + _t(d.get("timing", []), STEP_COST))
    head = [r for r in d.get("summary", []) if "head_fp32_over_bf16" in r]
    if head:
        out += ("\n\nThe LM head in fp32 (the engine's default) against a bf16 head, bf16 rollouts under replay "
                "(mean |Δ logprob|; same seeds, same_tokens = trajectories both sampled alike):\n\n"
                + _t(head, ["config", "mean_abs_delta_replay_fp32_head", "mean_abs_delta_replay_bf16_head",
                            "head_fp32_over_bf16", "same_tokens"])
                + "\n\nThe fp32 head changes that mismatch by "
                + ", ".join(f"{100 * (r['head_fp32_over_bf16'] - 1):+.1f}% ({r['config']})" for r in head)
                + "; the rest is the bf16 network's own rounding.")
    return out


def routers(d: dict) -> str:
    return (_t(d["mismatch"], MISMATCH) + "\n\n" + _t(d.get("timing", []), STEP_COST) + "\n\nRoute bytes per "
            "token row by preset:\n\n" + _t(d.get("route_bytes", []), ["preset", "moe_layers", "E", "K", "dtype",
                                                                      "bytes_per_row", "mib_per_32k_tokens"]))


def bench_model(d: dict) -> str:
    return _t(d["rows"], ["config", "moe_impl", "B", "T", "live_tok_s", "replay_tok_s", "replay_overhead"])


def bench_decode(d: dict) -> str:
    rows = _same_tokens_only(d["decode"], "ours_over_hf")
    rows = [_same_tokens_only([r], "ours_over_tunix", "tunix_same_tokens")[0] if "tunix_tok_s" in r else
            {**r, "tunix_tok_s": None, "ours_over_tunix": None} for r in rows]
    return (_t(rows, ["config", "moe_impl", "B", "prompt_tokens", "new_tokens", "ours_capture_on_tok_s",
                      "ours_capture_off_tok_s", "capture_on_over_off", "capture_on_over_off_paired", "hf_tok_s",
                      "ours_over_hf", "hf_same_tokens",
                      "tunix_tok_s", "ours_over_tunix"])
            + "\n\nExpert kernels inside the engine (tokens/s):\n\n"
            + _t(d["kernels"], ["config", "moe_impl", "B", "tok_s"])
            + "\n\nPrefix cache over a growing conversation (cumulative prefill tokens):\n\n"
            + _t([m for m in d["multiturn"] if m["turn"] in (1, 2, 4, 8, 16)],
                 ["turn", "prompt_tokens", "cached_tokens", "prefill_tokens_with_cache",
                  "prefill_tokens_without_cache"]))


def bench_engine(d: dict) -> str:
    ip = d["in_process"]
    facts = [{"measure": "32 concurrent requests ÷ one request (in process)", "value": ip["32_concurrent_over_one"]},
             {"measure": "time to first token p50 / p99, s", "value": f"{ip['ttft_p50_s']:.3g} / {ip['ttft_p99_s']:.3g}"},
             {"measure": f"programs compiled after warm-up over {ip['varied_requests']} varied requests",
              "value": ip["programs_compiled_after_warmup"]},
             {"measure": "warm-up in process: programs / s",
              "value": f"{ip['in_process_warmup']['programs']} / {ip['in_process_warmup']['seconds']:.3g}"}]
    a = d.get("agents_summary", {})
    prefix = "mix_short_over_long_"  # one per server mode the run had (bench_engine.MODES), in its order
    for m in reversed([k[len(prefix):] for k in a if k.startswith(prefix)]):
        quarter = a.get(f"mix_short_quarter_over_long_quarter_{m}")
        if quarter is not None:
            facts.insert(0, {"measure": f"{m}: sessions of the mix by tokens generated, shortest quarter ÷ longest "
                                        "quarter, completion", "value": quarter})
        alone = a.get(f"short_in_mix_over_alone_{m}")
        facts.insert(0, {"measure": f"{m}: mixed agents ÷ long sessions, completion in the mix (goal ≤ 0.5) / "
                                    "long sessions in the mix ÷ alone (goal ≤ 2)"
                                    + (" / mixed agents in the mix ÷ alone" if alone is not None else ""),
                         "value": f"{a[f'mix_short_over_long_{m}']:.3g} / {a[f'long_in_mix_over_alone_{m}']:.3g}"
                                  + (f" / {alone:.3g}" if alone is not None else "")})
    for m, w in a.get("warmup", {}).items():
        facts.append({"measure": f"{m} server: programs / ready after, s (cold persistent cache for the first)",
                      "value": f"{w.get('programs')} / {w['ready_s']:.3g}"})
    agents = [{**r, "ms_per_call": 1e3 * r["wall_s"] / max(r["decode_calls"], 1)} for r in d["agents"]]
    out = (_t(agents, ["server", "workload", "wall_s", "tokens", "tok_s", "decode_calls", "ms_per_call",
                       "mean_live_slots"])
           + "\n\n" + table(facts, ["measure", "value"]))
    if d.get("decode"):
        out += ("\n\nDecode against Hugging Face `generate` on the same weights:\n\n"
                + _t(_same_tokens_only(d["decode"], "ours_over_hf"), ["config", "moe_impl", "B", "new_tokens",
                                                                     "ours_tok_s", "hf_tok_s", "ours_over_hf",
                                                                     "hf_same_tokens"]))
    return out


def decode_bytes(d: dict) -> str:
    from experiments.decode_bytes import COLUMNS

    return _t([{c: r.get(c) for c in COLUMNS} for r in d["rows"]], COLUMNS)


def bench_weight_sync(d: dict) -> str:
    rows = d.get("rows", [])
    cols = [c for c in ["preset", "case", "GB", "s", "s_per_GB", "export_s", "post_s", "read_s"]
            if any(c in r for r in rows)]
    return _t([{c: r.get(c) for c in cols} for r in rows], cols)


def bench_step(d: dict) -> str:
    return _t(d["rows"], ["config", "layers", "B", "steps", "wall_ms", "plan_ms", "dispatch_ms", "wait_ms",
                          "process_ms", "device_ms", "host_over_device", "tok_s"])


def bench_trace(d: dict) -> str:
    return (_t(d["append"], ["turns", "MiB", "trace_ms", "naive_ms", "trace_us_per_turn", "naive_us_per_turn",
                             "naive_over_trace"])
            + "\n\nBytes on the wire per route row:\n\n"
            + _t([w for w in d["wire"] if w["rows"] > 1], ["model", "dtype", "raw_B_row", "json_b64_B_row",
                                                         "binary_B_row", "json_over_raw", "binary_over_raw",
                                                         "sglang_over_raw"])
            + "\n\nPadded vs packed batches on a long-tailed length mix:\n\n"
            + _t(d["fill"], ["layout", "trajectories", "rows", "fill_ratio", "slots_vs_padded"]))


def bench_serve(d: dict) -> str:
    return (_t(d["throughput"], ["concurrency", "requests", "http_req_s", "http_tok_s", "engine_req_s",
                                 "http_vs_engine", "mean_server_batch", "vs_serial"]) + "\n\n"
            + _t(d["wire"], ["model", "raw_B_per_row", "json_B_per_row", "binary_B_per_row", "json_vs_raw",
                             "binary_vs_raw"]) + _streaming(d.get("streaming")))


def _streaming(s: dict | None) -> str:
    if not s:
        return ""
    return (f"\n\nStreaming: {s['requests']} concurrent streams of `/v1/completions` (`stream: true`, {s['new_tokens']} "
            f"new tokens, routes on the last chunk) against {s['requests']} concurrent plain requests: "
            f"{s['streamed_tok_s']:.0f} / {s['plain_tok_s']:.0f} tokens/s = **{s['streamed_over_plain']:.2f}×** "
            f"(goal ≥ 0.9).")


def transfer_cost(d: dict) -> str:
    last = max(x["T"] for x in d["rows"])
    return (_t(d["ratios"], ["wire", "T", "expected_(T+1)/2", "rows_ratio", "wire_route_bytes_ratio",
                             "server_gather_ratio", "server_encode_ratio", "client_decode_ratio"])
            + f"\n\nAt T = {last} (absolute):\n\n"
            + _t([r for r in d["rows"] if r["T"] == last], ["wire", "T", "mode", "rows", "raw_bytes",
                                                           "wire_route_bytes", "server_gather_ms",
                                                           "server_encode_ms", "client_decode_ms"]))


def interop(d: dict) -> str:
    return (_t(d["codec"], ["model", "protocol", "raw_B_row", "route_B_row", "over_raw", "route_B_row_vs_r3jax",
                            "encode_us_row", "encode_us_row_vs_r3jax", "decode_us_row", "decode_us_row_vs_r3jax"])
            + "\n\n" + _t(d["http"], ["protocol", "requests", "concurrency", "req_s", "req_s_vs_r3jax"]))


def bench_scan(d: dict) -> str:
    return (_t(d["summary"], ["depth", "layout", "unrolled_compile_s", "scanned_compile_s", "ratio",
                              "unrolled_cpu_s", "scanned_cpu_s", "cpu_ratio"])
            + "\n\nDecode through the KV cache:\n\n"
            + _t(d.get("decode", []), ["depth", "layout", "B", "S", "ms_per_step", "scanned_over_unrolled"]))


def bench_ep(d: dict) -> str:
    return (_t(d["cost"], ["kernel", "mesh", "layer", "flops_ratio", "bytes_ratio"]) + "\n\nStep wall time:\n\n"
            + _t(d["wall"], ["run", "step_s", "vs_data8_replicated"]))


def bench_dp(d: dict) -> str:
    same = "equal" if d.get("same_answers") else "NOT equal"
    return (_t(d["rows"], ["data", "max_batch_size", "tokens_per_s", "over_data1", "decode_share", "mixed_share"])
            + f"\n\nTokens and route rows of every D: {same} to D = 1's.")


def bench_multiprocess(d: dict) -> str:
    return _t(d["results"], ["mesh", "B", "S", "one_ms", "one_gloo_ms", "two_ms", "ratio", "ratio_gloo"])


def bench_attention(d: dict) -> str:
    short, long_ = d["seq_lengths"]
    mem = [{"impl": m["impl"], f"temp_MiB_{short}": m[f"temp_{short}"] / 2**20,
            f"temp_MiB_{long_}": m[f"temp_{long_}"] / 2**20, f"{long_}÷{short}": m["ratio"]} for m in d["memory"]]
    return (_t(mem, ["impl", f"temp_MiB_{short}", f"temp_MiB_{long_}", f"{long_}÷{short}"])
            + "\n\nThe whole train step at 2048 tokens, blockwise ÷ einsum (CPU):\n\n"
            + _t(d.get("train_step", []), ["preset", "tokens", "xla_s", "blockwise_s", "ratio"])
            + "\n\nThe attention alone (every layer's forward + backward at 2048 tokens), per block size:\n\n"
            + _t(d["timing"], ["preset", "impl", "block", "seconds", "ratio"]))


def bench_logits(d: dict) -> str:
    return (_t(d["train"], ["vocab", "tokens", "chunk", "logits_f32_mib", "full_temp_mib", "chunked_temp_mib",
                            "chunked_over_full", "full_head_mib", "chunked_head_mib", "head_chunked_over_full"]))


def bench_paged(d: dict) -> str:
    keys = ["programs", "cold_warmup_s", "new_programs_after_warmup", "short_ttft_p50_s", "short_ttft_p99_s",
            "long_ttft_p50_s", "mix_wall_s", "mix_short_over_long", "mix_long_over_long_alone",
            "subprocess_cold_warmup_s", "restart_warmup_s"]
    paged = d["summary"] if "paged" not in d["summary"] else d["summary"]["paged"]
    old = load(d.get("slot_results", "bench_paged_slot")) or {}
    slot = old.get("summary", {}).get("slot", {})
    rows = [{"metric": k, "paged": paged.get(k), "fixed slots": slot.get(k),
             "paged ÷ slots": paged[k] / slot[k] if paged.get(k) and slot.get(k) else None} for k in keys]
    m, r = d["memory"], d.get("restart_warmup") or {}
    out = _t(rows, ["metric", "paged", "fixed slots", "paged ÷ slots"])
    if old:
        out += (f"\n\nThe fixed-slot engine's column: `{old['command']}` on commit `{old['commit']}` "
                f"(experiments/results/bench_paged_slot.json), the same streams.")
    out += (f"\n\nKV + route memory per live token at the mix's peak ({m['live_tokens']} live tokens): paged "
            f"{m['paged_bytes_per_live_token']:.0f} B ({m['pages_in_use']} pages of {m['page_bytes']} B in use) "
            f"against {m['slot_bytes_per_live_token']:.0f} B that fixed slots of max_seq_len reserve: "
            f"**{m['paged_over_slot']:.2f}×**.")
    sm = d.get("samples")
    if sm:
        out += (f"\n\n{sm['samples']} samples of one {sm['prompt_tokens']}-token prompt submitted together: "
                f"{sm['prefill_tokens_fed']} prompt tokens fed, **{sm['prefill_over_prompt']:.2f}×** the prompt "
                f"(goal ≤ 1.5); every sample's prompt route rows equal the first one's: "
                f"{'yes' if sm['prompt_route_rows_equal'] else 'no'}.")
    b = d.get("behind")
    if b:
        out += (f"\n\nA short request ({b['short_prompt']} + {b['new_tokens']} tokens) submitted right behind a "
                f"{b['long_prompt']:,}-token prompt finishes in {b['short_completion_s']:.3f} s, the long one in "
                f"{b['long_completion_s']:.3f} s: **{b['short_over_long']:.2f}×** (goal ≤ 0.5).")
    if r and "phases" in r.get("cold", {}):
        one = d.get("restart_warmup_one_decode_bucket") or {}
        c, w = r["cold"]["phases"], r["restart"]["phases"]
        out += (f"\n\nWarm-up of the paged engine in a fresh process ({r['cold']['programs']} programs): cold "
                f"{sum(c.values()):.1f} s = trace {c['trace_s']:.1f} + lower {c['lower_s']:.1f} + XLA compile "
                f"{c['compile_s']:.1f} s; restart on the persistent compilation cache {r['restart']['seconds']:.1f} s "
                f"(trace {w['trace_s']:.1f} + lower {w['lower_s']:.1f} + load {w['compile_s']:.1f} s).")
        if one:
            out += (f" With `Engine(decode_buckets=1)` ({one['cold']['programs']} programs, every step padded to "
                    f"{d['max_batch_size']} decode rows): cold {sum(one['cold']['phases'].values()):.1f} s, restart "
                    f"{one['restart']['seconds']:.1f} s.")
    return out


def serve_start(d: dict) -> str:
    sm = d["summary"]
    return (_t(d["rows"], ["repeat", "start", "wall_s", "ready_s", "warmup_s", "programs", "compiled", "loaded"])
            + f"\n\nMedian cold start **{sm['cold_s']:.1f} s** (goal ≤ {d['goals']['cold_s']:.0f} s), restart "
            f"**{sm['restart_s']:.1f} s** (goal ≤ {d['goals']['restart_s']:.0f} s), {sm['programs']} programs."
            + (("\n\nEvery layout the engine could compile (`--mixed-decode-buckets 3`), timed in one process on "
                "zeroed inputs (a decode loop's rows run all its steps), programs taking turns (median ms per "
                "call; `largest_over_this`: the largest decode "
                "size's call time over this one's, what padding up to it costs; `default`: compiled by the default "
                "`--mixed-decode-buckets 1`):\n\n"
                + _t(d["layouts"], ["decode_rows", "prefill_rows", "decode_steps", "compile_s", "call_ms",
                                   "largest_over_this", "default"]))
               if d.get("layouts") else ""))


def bench_dtype(d: dict) -> str:
    cols = ["config", "dtype", "pool_dtype", "round_s", "steps", "step_ms", "tokens_per_s", "host_wait_ms",
            "bf16_over_fp32"]
    return (_t(d["rows"], cols) + f"\n\n{d['batch']} requests × {d['new']} sampled tokens ({d['prompt']}-token "
            f"prompts, routes returned) a round; median of {d['rounds']} rounds per engine, the engines taking turns.")


def suite_time(d: dict) -> str:
    """docs/testing.md's block: the suite on a fresh clone, parallel (and serial where measured)."""
    keys = [k for k in ("parallel", "serial") if k in d] + sorted(k for k in d if "@" in k)
    runs = {k: d[k] for k in keys if is_clean(d[k])}  # "<mode>@<rev>": an earlier commit, for comparison
    if not runs:
        return "Not measured on a released commit yet: run `python -m experiments.suite_time`."
    out = []
    for key, r in runs.items():
        flags = (" --serial" if r["mode"] == "serial" else "") + (f" --commit {key.split('@')[1]}" if "@" in key else "")
        out.append(f"- `python -m experiments.suite_time{flags}` on a fresh clone of `{r['commit']}` ({r['cores']} "
                   f"CPU cores): `make venv` {r['venv_s']:.0f} s, the tests ({r['mode']}) {r['tests_s']:.0f} s, "
                   f"{r['passed']} passed, {r['skipped']} skipped, {r['failed']} failed.")
    first = next(iter(runs.values()))
    folders = {f for r in runs.values() for f in r["per_folder_s"]}
    rows = [{"folder": f, **{f"{r['mode']} `{r['commit']}` s": r["per_folder_s"].get(f, "") for r in runs.values()}}
            for f in sorted(folders, key=lambda f: -first["per_folder_s"].get(f, 0))]
    rows.append({"folder": "all", **{f"{r['mode']} `{r['commit']}` s": round(sum(r["per_folder_s"].values()))
                                     for r in runs.values()}})
    runs = list(runs.values())
    slow = runs[0]["slowest"][:15]
    return ("\n".join(out) + "\n\nSeconds per folder (setup + call + teardown, summed over the workers):\n\n"
            + table(rows, list(rows[0])) + f"\n\nThe slowest tests ({runs[0]['mode']}):\n\n"
            + table(slow, ["seconds", "phase", "test"]))
