"""The paged engine (:class:`r3jax.engine.Engine`) on the tiny model: compilation, time to first token,
a long-tailed mix, KV memory per live token, and one prompt's samples sharing its prefill.

    python -m experiments.bench_paged [--quick] [--compilation-cache DIR] [--no-progress]

The engine: ``max_seq_len`` 512, ``max_batch_size`` 8, prefix cache off (random prompts hit nothing,
and cached pages would count as pages in use), greedy, routes captured, a seeded request stream. The
fixed-slot engine it replaced was measured the same way; its figures are kept in
experiments/results/bench_paged_slot.json and shown beside these in docs/measurements.md.

1. **Compilation.** Programs compiled by ``warmup()`` and its cold seconds (this process has no
   persistent cache). With a compilation cache (``--compilation-cache DIR``; a fresh temporary one by
   default outside ``--quick``), the engine's warm-up runs in a fresh subprocess twice: cold (empty
   cache), then restart (the same cache), each first timing the trace / lower / compile phases of every
   program (``cold_compile_s``: XLA compiling; ``restart_compile_s``: loading from the cache), and again
   with ``decode_buckets=1``. Goals: <= 12 programs, cold <= 30 s, restart <= 5 s.
2. **Time to first token** of short requests (8-token prompt, 8 new tokens) submitted while long
   prompts (400 tokens) prefill: p50 / p99 of the engine's own submit -> first token seconds, of the
   short requests only.
3. **Long-tailed mix.** Most requests short, a few long prompts, a few long generations, submitted at
   once; mean short completion ÷ mean long completion, and the long requests' mean completion in the
   mix ÷ the same long requests alone.
4. **KV memory per live token** over the mix: peak pages in use x page bytes ÷ the peak live tokens
   (prompt + generated of admitted requests, sampled while it runs), against a fixed-slot reservation
   (max_batch_size x max_seq_len x bytes per token, KV + routes) ÷ the same tokens.
5. **Samples of one prompt.** 8 samples (seeds 0..7, temperature 1) of one 512-token prompt
   submitted together to an engine with its prefix cache on: prompt tokens fed ÷ the prompt (goal
   <= 1.5), and whether every sample's prompt route rows equal the first one's.

6. **A short request behind a long prompt.** A 3,500-token prompt (8 new tokens) submitted, then a short
   request (8 + 8 tokens) right behind it, on an engine of max_seq_len 3,584: the short request's
   completion ÷ the long one's (goal <= 0.5: it does not wait for the long prefill).

Writes experiments/results/bench_paged.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.common import table, write_json  # noqa: E402
from models import MoeConfig, MoeTransformer  # noqa: E402
from models.cache import cache_bytes_per_token  # noqa: E402
from r3jax.engine import Engine, GenerateRequest  # noqa: E402
from r3jax.routes import route_dtype  # noqa: E402

MAX_SEQ, BATCH = 512, 8
SHORT_P, SHORT_G, LONG_P, LONG_G = 8, 8, 400, 96
SAMPLES, SAMPLE_P, SAMPLE_G = 8, 512, 16
BEHIND_P = 3500  # section 6's long prompt
SLOT_RESULTS = "bench_paged_slot"  # the fixed-slot engine's figures (experiments/results/<name>.json)


def build(model, **kw):
    return Engine(model, **{**dict(max_seq_len=MAX_SEQ, max_batch_size=BATCH, prefix_cache_bytes=0, seed=0), **kw})


def request(rng, prompt: int, gen: int, vocab: int) -> GenerateRequest:
    return GenerateRequest(prompt_ids=rng.integers(0, vocab, prompt).tolist(), max_tokens=gen, temperature=0.0,
                           return_routed_experts=True)


def ttft_stream(quick: bool, vocab: int) -> list[tuple[str, GenerateRequest]]:
    """Long prompts first, then the short requests submitted one by one while they prefill."""
    rng = np.random.default_rng(1)
    longs, shorts = (2, 8) if quick else (4, 24)
    return ([("long", request(rng, LONG_P, SHORT_G, vocab)) for _ in range(longs)]
            + [("short", request(rng, SHORT_P, SHORT_G, vocab)) for _ in range(shorts)])


def mix_stream(quick: bool, vocab: int) -> list[tuple[str, GenerateRequest]]:
    """Long-tailed: ~80% short, ~10% long prompts, ~10% long generations, in a seeded random order."""
    rng = np.random.default_rng(2)
    n = 20 if quick else 48
    kinds = rng.choice(["short", "long_prompt", "long_gen"], size=n, p=[0.8, 0.1, 0.1]).tolist()
    kinds[:2] = ["long_prompt", "long_gen"]  # at least one of each long kind
    shapes = {"short": (SHORT_P, SHORT_G), "long_prompt": (LONG_P, SHORT_G), "long_gen": (16, LONG_G)}
    return [(k, request(rng, *shapes[k], vocab)) for k in kinds]


class TaggedTTFT(list):
    """Stands in for the engine's ``_ttft`` list: each submit -> first token value the engine records is
    also kept with the request it belongs to (read from the recording frame's ``seq``), so the short
    requests' values can be told from the long ones'."""

    def __init__(self, values=()):
        super().__init__(values)
        self.by_request: dict[int, float] = {}

    def append(self, value):
        seq = sys._getframe(1).f_locals.get("seq")
        if seq is not None:
            self.by_request[id(seq.job.request)] = value
        super().append(value)


def live_tokens(engine) -> int:
    """Prompt + generated tokens of the requests admitted and not finished (paged engine)."""
    return sum(len(s.job.prompt) + len(s.tokens) for s in list(engine._sched.seqs))


def run_stream(engine, stream, *, gap_s: float = 0.0, sample: bool = False) -> dict:
    """Submit ``stream`` (``gap_s`` apart), wait for all; per request: kind, completion seconds, output ids,
    engine TTFT. ``sample``: also the peak pages in use / live tokens, polled while it runs."""
    engine._ttft = TaggedTTFT(engine._ttft)
    done: dict[int, float] = {}
    peak = {"pages_in_use": 0, "pages_reserved": 0, "live_tokens": 0, "samples": 0}
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            st = engine.stats
            peak["pages_in_use"] = max(peak["pages_in_use"], st["pages_in_use"])
            peak["pages_reserved"] = max(peak["pages_reserved"], st["pages_reserved"])
            peak["live_tokens"] = max(peak["live_tokens"], live_tokens(engine))
            peak["samples"] += 1
            stop.wait(0.002)

    thread = threading.Thread(target=sampler, daemon=True) if sample else None
    if thread:
        thread.start()
    t0 = time.perf_counter()
    futures = []
    for i, (_, req) in enumerate(stream):
        f = engine.submit(req)
        f.add_done_callback(lambda _f, i=i: done.setdefault(i, time.perf_counter()))
        futures.append((f, time.perf_counter()))
        if gap_s:
            time.sleep(gap_s)
    outs = [f.result() for f, _ in futures]
    wall = time.perf_counter() - t0
    stop.set()
    if thread:
        thread.join()
    rows = [{"kind": kind, "completion_s": done[i] - sub, "ttft_s": engine._ttft.by_request.get(id(req)),
             "output_ids": out.output_ids} for i, ((kind, req), (_, sub), out) in enumerate(zip(stream, futures, outs))]
    return {"wall_s": wall, "rows": rows, **({"peak": peak} if sample else {})}


def mean_of(rows, kinds, key="completion_s") -> float:
    vals = [r[key] for r in rows if r["kind"] in kinds]
    return float(np.mean(vals)) if vals else float("nan")


def pct(vals, q) -> float | None:
    vals = [v for v in vals if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def samples_run(model, vocab: int) -> dict:
    """Section 5: one prompt's samples submitted together, on an engine with its prefix cache on."""
    eng = build(model, max_seq_len=SAMPLE_P + 2 * SAMPLE_G, max_batch_size=SAMPLES, decode_buckets=1,
                prefix_cache_bytes=64 << 20)
    try:
        prompt = np.random.default_rng(3).integers(0, vocab, SAMPLE_P).tolist()
        reqs = [GenerateRequest(prompt, max_tokens=SAMPLE_G, temperature=1.0, seed=i, return_routed_experts=True)
                for i in range(SAMPLES)]
        before = eng.stats["prefill_tokens"]
        t0 = time.perf_counter()
        outs = eng.generate(reqs)
        wall = time.perf_counter() - t0
        fed = eng.stats["prefill_tokens"] - before
    finally:
        eng.close()
    first = outs[0].routed_experts[:SAMPLE_P]
    return {"samples": SAMPLES, "prompt_tokens": SAMPLE_P, "max_tokens": SAMPLE_G, "prefill_tokens_fed": fed,
            "prefill_over_prompt": fed / SAMPLE_P, "cached_tokens": [o.cached_tokens for o in outs],
            "prompt_route_rows_equal": all(np.array_equal(o.routed_experts[:SAMPLE_P], first) for o in outs),
            "distinct_outputs": len({tuple(o.output_ids) for o in outs}), "wall_s": wall}


def behind_run(model, vocab: int) -> dict:
    """Section 6: a short request submitted right behind a long prompt; completions from submit."""
    eng = build(model, max_seq_len=BEHIND_P + 84, max_batch_size=2, decode_buckets=1)
    try:
        eng.warmup()
        rng = np.random.default_rng(5)
        warm = [request(rng, SHORT_P, SHORT_G, vocab) for _ in range(2)]
        eng.generate(warm)  # untimed: first dispatches
        long_req, short_req = request(rng, BEHIND_P, SHORT_G, vocab), request(rng, SHORT_P, SHORT_G, vocab)
        r = run_stream(eng, [("long", long_req), ("short", short_req)])
    finally:
        eng.close()
    long_s, short_s = (next(x["completion_s"] for x in r["rows"] if x["kind"] == k) for k in ("long", "short"))
    return {"long_prompt": BEHIND_P, "short_prompt": SHORT_P, "new_tokens": SHORT_G, "long_completion_s": long_s,
            "short_completion_s": short_s, "short_over_long": short_s / long_s}


def warmup_child(decode_buckets: int) -> None:
    """Subprocess mode: build the paged engine, warm it up, print the result as one JSON line."""
    t0 = time.perf_counter()
    eng = build(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)), decode_buckets=decode_buckets)
    phases = program_phases(eng)
    w = eng.warmup()
    eng.close()
    print(json.dumps({**w, "process_s": time.perf_counter() - t0, "phases": phases}))


def program_phases(eng) -> dict:
    """Seconds of tracing, lowering and compiling (or loading from the persistent cache) each of the
    engine's step programs, as ``warmup()`` does them, summed; done before ``warmup()``, which then
    finds each program in the persistent cache."""
    import jax

    out = {"trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0}
    for lay in eng.layouts():
        fn, kw = eng._build(lay, eng.steps_of(lay) > 1)
        t0 = time.perf_counter()
        traced = jax.jit(fn, **kw).trace(*eng._abstract_args(lay))
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        for key, dt in (("trace_s", t1 - t0), ("lower_s", t2 - t1), ("compile_s", t3 - t2)):
            out[key] += dt
    return out


def restart_warmup(cache: str, decode_buckets: int = 3) -> dict:
    """Cold then restart warm-up of the paged engine, each in a fresh process on the persistent cache
    (a directory of its own per ``decode_buckets``, so the first run is cold)."""
    cache = os.path.join(cache, f"decode-buckets-{decode_buckets}")
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    out = {}
    for name in ("cold", "restart"):
        p = subprocess.run([sys.executable, "-m", "experiments.bench_paged", "--warmup-child",
                            "--decode-buckets", str(decode_buckets)], env=env,
                           capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise RuntimeError(f"warm-up subprocess ({name}) failed:\n{p.stderr[-4000:]}")
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, no subprocess warm-ups (~1 minute)")
    ap.add_argument("--compilation-cache", default=None,
                    help="persistent cache dir for the restart warm-up (default: a fresh temporary one; "
                         "with --quick the subprocess warm-ups run only when this is given)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--warmup-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--decode-buckets", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warmup_child:
        return warmup_child(args.decode_buckets)
    cache_dir = args.compilation_cache
    if cache_dir is not None and os.path.isdir(cache_dir) and os.listdir(cache_dir):
        # its programs would make the "cold" warm-up a restart
        ap.error(f"--compilation-cache {cache_dir}: expected a missing or empty directory (the cold warm-up "
                 "must compile everything); give a new one")

    cfg = MoeConfig.tiny()
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    ttft_reqs, mix_reqs = ttft_stream(args.quick, cfg.vocab_size), mix_stream(args.quick, cfg.vocab_size)
    long_reqs = [(k, r) for k, r in mix_reqs if k != "short"]
    with tqdm(total=7, desc="bench_paged", disable=args.no_progress) as bar:
        eng = build(model)
        try:
            w = eng.warmup()
            bar.update()
            run_stream(eng, ttft_stream(True, cfg.vocab_size)[:3])  # untimed: first dispatches, threads
            before = eng.stats["compiled_programs"]
            r = {"warmup": w, "ttft": run_stream(eng, ttft_reqs, gap_s=0.01)}
            bar.update()
            r["mix"] = run_stream(eng, mix_reqs, sample=True)
            bar.update()
            r["long_alone"] = run_stream(eng, long_reqs)
            bar.update()
            r["stats"] = {k: v for k, v in eng.stats.items()}
            r["new_programs_after_warmup"] = eng.stats["compiled_programs"] - before
            r["page_bytes"] = eng.page_bytes
        finally:
            eng.close()
        shared = samples_run(model, cfg.vocab_size)
        behind = behind_run(model, cfg.vocab_size)
        bar.update()
        cache = args.compilation_cache or (None if args.quick else tempfile.mkdtemp(prefix="r3jax-bench-paged-cache-"))
        restart = restart_warmup(cache) if cache else None
        # the same with one decode bucket (Engine(decode_buckets=1): 3 programs, every step padded to B rows)
        restart_one = restart_warmup(cache, decode_buckets=1) if cache else None
        bar.update(2)

    # KV + route bytes per token: a fixed-slot engine reserves max_batch_size x max_seq_len of them
    route_row = cfg.num_moe_layers * cfg.top_k * route_dtype(cfg.num_experts).itemsize
    per_token = cache_bytes_per_token(cfg) + route_row
    peak = r["mix"]["peak"]
    live = max(peak["live_tokens"], 1)
    paged_per_tok = peak["pages_in_use"] * r["page_bytes"] / live
    slot_per_tok = BATCH * MAX_SEQ * per_token / live
    memory = {"bytes_per_token": per_token, "page_bytes": r["page_bytes"], **peak,
              "paged_bytes_per_live_token": paged_per_tok, "slot_bytes_per_live_token": slot_per_tok,
              "paged_over_slot": paged_per_tok / slot_per_tok}

    short_ttft = [x["ttft_s"] for x in r["ttft"]["rows"] if x["kind"] == "short"]
    mix = r["mix"]["rows"]
    summary = {"programs": r["warmup"]["programs"], "cold_warmup_s": r["warmup"]["seconds"],
               "new_programs_after_warmup": r["new_programs_after_warmup"],
               "short_ttft_p50_s": pct(short_ttft, 50), "short_ttft_p99_s": pct(short_ttft, 99),
               "long_ttft_p50_s": pct([x["ttft_s"] for x in r["ttft"]["rows"] if x["kind"] == "long"], 50),
               "short_completion_p50_s": pct([x["completion_s"] for x in r["ttft"]["rows"] if x["kind"] == "short"], 50),
               "mix_wall_s": r["mix"]["wall_s"],
               "mix_short_over_long": mean_of(mix, {"short"}) / mean_of(mix, {"long_prompt", "long_gen"}),
               "mix_long_over_long_alone": mean_of(mix, {"long_prompt", "long_gen"})
               / mean_of(r["long_alone"]["rows"], {"long_prompt", "long_gen"}),
               "samples_prefill_over_prompt": shared["prefill_over_prompt"],
               "short_behind_long_prompt": behind["short_over_long"]}
    if restart:
        # cold: the phases' seconds (the warm-up after them finds every program in the cache)
        cold_s = lambda x: sum(x["cold"]["phases"].values())
        summary["subprocess_cold_warmup_s"] = cold_s(restart)
        summary["restart_warmup_s"] = restart["restart"]["seconds"]
        for when in ("cold", "restart"):  # where the seconds go (module docstring)
            for phase, sec in restart[when]["phases"].items():
                summary[f"{when}_{phase}"] = sec
        summary["one_decode_bucket_programs"] = restart_one["cold"]["programs"]
        summary["one_decode_bucket_cold_warmup_s"] = cold_s(restart_one)
        summary["one_decode_bucket_restart_warmup_s"] = restart_one["restart"]["seconds"]

    print()
    print(table([{"metric": k, "paged": v} for k, v in summary.items()], ["metric", "paged"]))
    print(f"\nKV+route memory per live token over the mix (peak {peak['live_tokens']} live tokens, "
          f"{peak['pages_in_use']} pages in use of {r['stats']['pages_total']}): paged {paged_per_tok:.0f} B, "
          f"fixed slots {slot_per_tok:.0f} B, paged ÷ slots {memory['paged_over_slot']:.3f}")
    print(f"{SAMPLES} samples of one {SAMPLE_P}-token prompt: {shared['prefill_tokens_fed']} prompt tokens fed "
          f"({shared['prefill_over_prompt']:.3f}x the prompt), prompt route rows equal: "
          f"{shared['prompt_route_rows_equal']}, cached tokens {shared['cached_tokens']}")
    print(f"a short request right behind a {BEHIND_P}-token prompt: {behind['short_completion_s']:.3f} s against "
          f"{behind['long_completion_s']:.3f} s, short ÷ long {behind['short_over_long']:.3f}")
    if restart:
        print(f"warm-up in a fresh process: cold {sum(restart['cold']['phases'].values()):.1f} s "
              f"({restart['cold']['programs']} programs), restart on the cache {restart['restart']['seconds']:.1f} s; "
              f"decode_buckets=1: cold {sum(restart_one['cold']['phases'].values()):.1f} s ({restart_one['cold']['programs']} "
              f"programs), restart {restart_one['restart']['seconds']:.1f} s")
    for w in ("ttft", "mix", "long_alone"):  # output ids are long and the per-request rows repeat the summary
        for x in r[w]["rows"]:
            x.pop("output_ids")
    path = write_json("bench_paged", {"quick": args.quick, "max_seq_len": MAX_SEQ, "max_batch_size": BATCH,
                                      "summary": summary, "memory": memory, "samples": shared, "behind": behind,
                                      "restart_warmup": restart, "restart_warmup_one_decode_bucket": restart_one,
                                      "run": r, "slot_results": SLOT_RESULTS,
                                      "goals": {"programs": 12, "cold_warmup_s": 30, "restart_warmup_s": 5,
                                                "samples_prefill_over_prompt": 1.5, "short_behind_long_prompt": 0.5}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
