"""The continuous-batching engine against the static path it replaced, in one run on one machine.

    python -m experiments.bench_engine [--quick] [--skip-decode]

1. **Agents over HTTP.** ``python -m r3jax serve`` (tiny, 32 slots, prefix cache on) three times:
   continuous (default), ``--static`` (the old behaviour: a batch is admitted only when every slot is
   free and decodes to completion; same programs) and ``--decode-steps 1`` (one decode step a device
   call: what multi-step decoding changes); then continuous on ``small_100m``, whose decode calls take
   some 40x tiny's, so a turn's HTTP round trip weighs less against decoding. Async multi-turn agents
   (8 new user tokens a turn, greedy, routes returned incrementally from the last captured row) run
   against each: ``LONG`` long sessions (every turn ``LONG_GEN`` tokens) and ``MIXED`` agents whose
   every turn draws its length from a long-tailed mix (``TURN_GEN`` with probabilities ``TURN_P``),
   together and each kind alone. Figures:
   wall seconds, generated tokens/s, continuous ÷ static on the whole mix, mix ÷ the long sessions alone
   (how much the other agents slow the long sessions down), each kind's mean completion in the mix
   against the other kind's and against its own alone (how much the other kind slows it down), and the
   mix's sessions ranked by the tokens they generated, whatever their kind: the mean completion of the
   quarter that generated fewest ÷ that of the quarter that generated most (do short sessions finish
   first?).
2. **32 concurrent ÷ 1** (in process, warm): wall time of 32 requests submitted at once ÷ one request
   alone (20-token prompt, 64 new tokens).
3. **Time to first token** under that load (submit -> first token sampled at admission), p50 / p99.
4. **Compilation.** Warm-up seconds of the server (cold: empty persistent cache; restart: the static
   server, same programs, from ``--compilation-cache``) and programs compiled after warm-up over 1,000
   varied requests (lengths, max_tokens, stop tokens, sampling, routes on/off, prefix hits).
5. **Decode tokens/s** at B = 1, 8, 32 on tiny and small_100m (prompt 32, 64 new tokens, greedy, routes
   captured; an engine of B slots) ÷ Hugging Face ``generate`` on the same weights (see bench_decode).

Writes experiments/results/bench_engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# fresh (so the first warm-up is cold) unless R3JAX_BENCH_CACHE names one to reuse
CACHE = Path(os.environ.get("R3JAX_BENCH_CACHE") or tempfile.mkdtemp(prefix="r3jax-bench-engine-cache-"))
os.environ.update({"JAX_COMPILATION_CACHE_DIR": str(CACHE), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu"})

import httpx  # noqa: E402
from r3jax.serve.client import wait_healthy  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import table, write_json  # noqa: E402

SLOTS, MAX_SEQ = 32, 384
SERVER_ARGS = ["--model", "tiny", "--max-batch-size", str(SLOTS), "--max-seq-len", str(MAX_SEQ)]
FIRST, USER = 16, 8
LONG, LONG_TURNS, LONG_GEN = 4, 3, 96  # long sessions: every turn generates LONG_GEN tokens
MIXED, MIXED_TURNS = 28, 8  # the other agents: each turn's length drawn from a long-tailed mix
TURN_GEN, TURN_P = (8, 24, 96), (0.8, 0.12, 0.08)


class Server:
    """``python -m r3jax serve`` in a subprocess; its stdout is drained by a thread."""

    def __init__(self, *extra: str):
        cmd = [sys.executable, "-m", "r3jax", "serve", "--host", "127.0.0.1", "--port", "0",
               "--compilation-cache", str(CACHE), *SERVER_ARGS, *extra]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "XLA_FLAGS": ""})
        self.lines: list[str] = []
        self.url = None
        threading.Thread(target=self._drain, daemon=True).start()
        while self.url is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {''.join(self.lines)}")
            time.sleep(0.02)
        wait_healthy(self.url, proc=self.proc)
        self.ready_s = time.perf_counter() - t0
        self.warmup = httpx.get(self.url + "/v1/stats").json()["warmup"]

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "listening on" in line:
                self.url = line.strip().rsplit(" ", 1)[-1]

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/stats").json()

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)


async def agent(client: httpx.AsyncClient, url: str, seed: int, turns: int, gen: int | None) -> int:
    """One multi-turn session; ``gen=None`` draws each turn's length from TURN_GEN / TURN_P. Returns the
    tokens generated."""
    rng = np.random.default_rng(seed)
    history, captured, generated = rng.integers(0, 272, FIRST).tolist(), 0, 0
    for t in range(turns):
        if t:
            history += rng.integers(0, 272, USER).tolist()
        n = gen if gen is not None else int(rng.choice(TURN_GEN, p=TURN_P))
        if len(history) + n > MAX_SEQ:
            break  # the session is full
        body = {"prompt_ids": history, "return_routed_experts": True, "session_id": f"agent-{seed}",
                "sampling_params": {"max_tokens": n, "temperature": 0.0, "routed_experts_prompt_start": captured}}
        r = await client.post(url + "/v1/generate", json=body, timeout=600)
        r.raise_for_status()
        out = r.json()
        assert out["routed_experts"]["shape"][0] == len(history) - captured + len(out["output_ids"]) - 1
        captured = len(history) + len(out["output_ids"]) - 1
        history = history + out["output_ids"]
        generated += len(out["output_ids"])
    return generated


async def run_agents(url: str, kinds: list[tuple[int, int, int]]) -> dict:
    """kinds: (count, turns, gen or None) per kind of agent; all run concurrently."""
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(limits=limits) as client:
        jobs, seed, done = [], 0, {}
        t0 = time.perf_counter()
        sessions = []  # (tokens generated, completion seconds) of each session

        async def timed(kind, job):
            n = await job
            done.setdefault(kind, []).append(time.perf_counter() - t0)
            sessions.append((n, done[kind][-1]))
            return n

        for kind, (count, turns, gen) in enumerate(kinds):
            for _ in range(count):
                jobs.append(timed(kind, agent(client, url, seed, turns, gen)))
                seed += 1
        tokens = sum(await asyncio.gather(*jobs))
        wall = time.perf_counter() - t0
    # sessions by the tokens they generated, whatever their kind: the quarter that generated fewest
    # against the quarter that generated most (ties in token count split by order of completion)
    by_len = sorted(sessions)
    q = max(1, len(by_len) // 4)
    # completion_s: mean seconds from the start to each agent's last answer, per kind (kinds[0] first)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "completion_s": [float(np.mean(done[k])) for k in range(len(kinds))],
            "sessions": [[int(n), float(c)] for n, c in by_len],
            "short_quarter_over_long_quarter": float(np.mean([c for _, c in by_len[:q]]) /
                                                     np.mean([c for _, c in by_len[-q:]]))}


MODES = (("continuous", ()), ("static", ("--static",)), ("one_step", ("--decode-steps", "1")),
         ("small_100m", ("--model", "small_100m")))  # the last: continuous, a larger model


def bench_agents(quick: bool) -> tuple[list[dict], dict]:
    """The agents against each server mode (:data:`MODES`: the default; ``--static``; one decode step a
    call; the default on small_100m), each workload once: the mix, the long sessions alone, the mixed
    agents alone."""
    long_kind = (LONG, LONG_TURNS, LONG_GEN)
    short_kind = (MIXED, MIXED_TURNS if not quick else 4, None)
    rows, warm = [], {}
    for mode, extra in MODES:
        srv = Server(*extra)
        warm[mode] = {"ready_s": srv.ready_s, **srv.warmup}
        try:
            asyncio.run(run_agents(srv.url, [(2, 1, 4)]))  # untimed: connections, first admissions
            before = srv.stats()["engine"]["compiled_programs"]
            for workload, kinds in (("mix", [long_kind, short_kind]), ("long only", [long_kind]),
                                    ("mixed only", [short_kind])):
                e0 = srv.stats()["engine"]
                r = asyncio.run(run_agents(srv.url, kinds))
                e1 = srv.stats()["engine"]
                calls = e1["decode_calls"] - e0["decode_calls"]
                rows.append({"server": mode, "workload": workload, **r, "decode_calls": calls,
                             "mean_live_slots": (e1["decode_slot_steps"] - e0["decode_slot_steps"]) / max(calls, 1)})
                print(rows[-1], flush=True)
            warm[mode]["compiled_after_warmup"] = srv.stats()["engine"]["compiled_programs"] - before
        finally:
            srv.close()
    get = lambda m, w: next(r for r in rows if r["server"] == m and r["workload"] == w)
    summary = {
        "continuous_over_static_tok_s": get("continuous", "mix")["tok_s"] / get("static", "mix")["tok_s"],
        "static_over_continuous_wall": get("static", "mix")["wall_s"] / get("continuous", "mix")["wall_s"],
        "mix_over_long_alone_continuous": get("continuous", "mix")["wall_s"] / get("continuous", "long only")["wall_s"],
        "mix_over_long_alone_static": get("static", "mix")["wall_s"] / get("static", "long only")["wall_s"]}
    for m, _ in MODES:  # the mixed agents (mostly short turns) ÷ the long sessions, in the mix; each kind ÷ alone
        long_s, short_s = get(m, "mix")["completion_s"]
        summary[f"mix_short_over_long_{m}"] = short_s / long_s
        summary[f"long_in_mix_over_alone_{m}"] = long_s / get(m, "long only")["completion_s"][0]
        summary[f"short_in_mix_over_alone_{m}"] = short_s / get(m, "mixed only")["completion_s"][0]
        summary[f"mix_long_s_{m}"], summary[f"mix_short_s_{m}"] = long_s, short_s
        summary[f"mix_short_quarter_over_long_quarter_{m}"] = get(m, "mix")["short_quarter_over_long_quarter"]
    return rows, {**summary, "warmup": warm}


def bench_in_process(n_varied: int) -> dict:
    import jax
    from flax import nnx

    from models import MoeConfig, MoeTransformer
    from r3jax.engine import Engine, GenerateRequest

    model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
    engine = Engine(model, max_seq_len=MAX_SEQ, max_batch_size=SLOTS)  # the server's configuration
    warm = engine.warmup()  # from the persistent cache the servers filled
    rng = np.random.default_rng(0)
    req = lambda i: GenerateRequest(rng.integers(0, 272, 20).tolist(), max_tokens=64, temperature=0.0)
    engine.generate([req(0)])
    one = min(_timed(lambda: engine.generate([req(1)])) for _ in range(3))
    n0 = len(engine.recent_ttft())
    many = min(_timed(lambda: engine.generate([req(i) for i in range(32)])) for _ in range(3))
    ttft = np.asarray(engine.recent_ttft()[n0:])

    programs = engine.stats["compiled_programs"]
    compiles = []
    handler = _CompileLog(compiles)
    logging.getLogger("jax").addHandler(handler)
    prompts = [rng.integers(0, 272, n).tolist() for n in (30, 90, 200)]
    t0 = time.perf_counter()
    with jax.log_compiles(True):
        done = 0
        while done < n_varied:
            wave = [_varied(rng, prompts, GenerateRequest) for _ in range(min(int(rng.integers(1, 65)), n_varied - done))]
            futures = [engine.submit(r) for r in wave]
            if rng.random() < 0.3:
                futures[-1].cancel()
            for f in futures:
                if not f.cancelled():
                    f.result()
            done += len(wave)
    varied_s = time.perf_counter() - t0
    logging.getLogger("jax").removeHandler(handler)
    engine.close()
    return {"one_request_s": one, "32_concurrent_s": many, "32_concurrent_over_one": many / one,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "in_process_warmup": warm, "varied_requests": n_varied, "varied_wall_s": varied_s,
            "programs_compiled_after_warmup": engine.stats["compiled_programs"] - programs,
            "xla_compilations_after_warmup": len(compiles), "programs": programs,
            "prefix_cached_tokens": engine.stats["cached_tokens"]}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _CompileLog(logging.Handler):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def emit(self, record):
        if record.getMessage().startswith("Finished XLA compilation of"):
            self.sink.append(record.getMessage())


def _varied(rng, prompts, GenerateRequest):
    ids = prompts[int(rng.integers(len(prompts)))] + rng.integers(0, 272, int(rng.integers(0, 8))).tolist() \
        if rng.random() < 0.3 else rng.integers(0, 272, int(rng.integers(1, 250))).tolist()
    p = len(ids)
    return GenerateRequest(
        prompt_ids=ids, max_tokens=int(rng.integers(1, min(96, MAX_SEQ - p) + 1)),
        temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, 5])),
        top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(0, 2**40)),
        stop_token_ids=rng.integers(0, 272, int(rng.integers(0, 4))).tolist(),
        return_logprobs=bool(rng.random() < 0.7), return_routed_experts=bool(rng.random() < 0.7),
        routed_experts_prompt_start=int(rng.integers(0, p + 1)))


def bench_decode(configs, batches, new=64, prompt=32) -> list[dict]:
    from flax import nnx

    from experiments.bench_decode import _hf, _hf_threads, _load_hf
    from models import MoeConfig, MoeTransformer
    from r3jax.engine import Engine, GenerateRequest

    rows = []
    for name in configs:
        model = MoeTransformer(MoeConfig.preset(name), rngs=nnx.Rngs(0))
        hf = _load_hf(model)
        for b in batches:
            eng = Engine(model, max_seq_len=prompt + new, max_batch_size=b, prefix_cache_bytes=0,
                         prefill_chunk=prompt, prefill_rows=b)
            prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (b, prompt))
            reqs = [GenerateRequest(p.tolist(), max_tokens=new, temperature=0.0, return_routed_experts=True)
                    for p in prompts]
            outs = eng.generate(reqs)  # compiles what this shape uses
            ours = min(_timed(lambda: eng.generate(reqs)) for _ in range(3 if name == "tiny" else 2))
            threads = _hf_threads(hf, prompts)
            theirs, hf_ids = min((_hf(hf, prompts, new, threads) for _ in range(2)), key=lambda x: x[0])  # new ids
            same = float(np.mean([o.output_ids == list(h) for o, h in zip(outs, hf_ids.tolist())]))
            rows.append({"config": name, "moe_impl": eng.config.moe_impl, "B": b, "new_tokens": new,
                         "ours_tok_s": b * new / ours, "hf_tok_s": b * new / theirs, "ours_over_hf": theirs / ours,
                         "hf_threads": threads, "hf_same_tokens": same})
            print(rows[-1], flush=True)
            eng.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--agents-only", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    agent_rows, agents = bench_agents(args.quick)
    if args.agents_only:
        print(table(agent_rows, ["server", "workload", "wall_s", "tokens", "tok_s", "decode_calls", "mean_live_slots"]))
        print(agents)
        return
    proc = bench_in_process(200 if args.quick else 1000)
    decode = [] if args.skip_decode else bench_decode(("tiny",) if args.quick else ("tiny", "small_100m"),
                                                      (1, 8, 32))
    print(f"\n## Async multi-turn agents over HTTP (tiny, {SLOTS} slots; {LONG} long sessions of {LONG_TURNS} x "
          f"{LONG_GEN} tokens + {MIXED} agents x {MIXED_TURNS} turns of {TURN_GEN} tokens w.p. {TURN_P})")
    print(table(agent_rows, ["server", "workload", "wall_s", "tokens", "tok_s", "decode_calls", "mean_live_slots"]))
    print(f"\ncontinuous / static tokens/s (mix): {agents['continuous_over_static_tok_s']:.2f}x (goal >= 3)")
    print(f"mix / long agents alone (wall): continuous {agents['mix_over_long_alone_continuous']:.2f}x "
          f"(goal <= 1.3), static {agents['mix_over_long_alone_static']:.2f}x")
    for m, _ in MODES:
        print(f"{m}: mixed agents / long sessions completion in the mix {agents[f'mix_short_over_long_{m}']:.2f} "
              f"(goal <= 0.5; {agents[f'mix_short_s_{m}']:.2f} s / {agents[f'mix_long_s_{m}']:.2f} s); in the mix / "
              f"alone: long sessions {agents[f'long_in_mix_over_alone_{m}']:.2f} (goal <= 2), mixed agents "
              f"{agents[f'short_in_mix_over_alone_{m}']:.2f}; sessions of the mix by tokens generated, the "
              f"shortest quarter / the longest quarter: {agents[f'mix_short_quarter_over_long_quarter_{m}']:.2f}")
    for mode, w in agents["warmup"].items():
        print(f"{mode} server: {w.get('programs')} programs, warm-up {w.get('seconds', 0):.1f} s, ready after "
              f"{w['ready_s']:.1f} s, compiled after warm-up: {w.get('compiled_after_warmup')}")
    print("\n## In process (tiny, 32 slots, warm)")
    print(table([proc], ["one_request_s", "32_concurrent_s", "32_concurrent_over_one", "ttft_p50_s", "ttft_p99_s",
                         "varied_requests", "programs_compiled_after_warmup", "xla_compilations_after_warmup"]))
    if decode:
        print("\n## Decode tokens/s vs Hugging Face generate (prompt 32, 64 new, greedy, routes captured)")
        print(table(decode, ["config", "moe_impl", "B", "ours_tok_s", "hf_tok_s", "ours_over_hf", "hf_threads",
                             "hf_same_tokens"]))
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")
    write_json("bench_engine", {"quick": args.quick, "agents": agent_rows, "agents_summary": agents,
                                "in_process": proc, "decode": decode, "total_s": total,
                                "workload": {"slots": SLOTS, "max_seq_len": MAX_SEQ, "long": [LONG, LONG_TURNS, LONG_GEN],
                                             "mixed": [MIXED, MIXED_TURNS, TURN_GEN, TURN_P], "first": FIRST, "user": USER}})


if __name__ == "__main__":
    main()
