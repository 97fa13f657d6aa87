"""HTTP serving throughput vs the in-process engine, and route bytes on the wire.

    python -m experiments.bench_serve [--quick]

One run measures both sides with the same weights (tiny model, seed 0) and the same workload: N
requests of random 20-token prompts, ``max_tokens`` new tokens (sampled, fixed seeds, no stop
token), routes for every row (s = 0), binary route framing. Both engines run without the prefix
cache (independent requests; repeated passes must not turn into cache hits) and are warmed up
(``Engine.warmup``: every program of the configuration; the server does it before /health is 200), so
no pass compiles.

- HTTP: ``python -m r3jax serve`` in a subprocess (max batch 32); one long-lived
  ``RemoteInferenceClient`` per c (``max_concurrency`` = c, connections kept alive across passes)
  sends all N requests; the server's dynamic batcher gathers what is in flight.
- In process: ``Engine.generate`` on batches of c requests (the best batching c concurrent callers
  could get). ratio = HTTP requests/s ÷ in-process requests/s at the same c.
- ``vs_serial`` at c > 1: HTTP wall time ÷ (N × the c = 1 HTTP time per request): how much less than
  "one request after another" concurrency costs.
One untimed pass of the workload per level follows; medians of ``--repeats`` interleaved passes; the
programs compiled during the timed passes are reported (0 expected). Wire bytes: one response per route format, measured on
the actual HTTP body, per route row, against the raw array (rows × L × K × itemsize); the same
encoders on a Qwen3-30B-A3B-shaped array (L = 48, K = 8) show the ratio at real size.

Streaming: 32 requests of the same workload sent at once to vLLM's ``/v1/completions`` (routes and
token ids returned), streamed (``stream: true``, server-sent events) and not, in interleaved passes
after an untimed one of each: tokens/s streamed ÷ not (goal >= 0.9: streaming costs nothing
measurable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CACHE = Path(tempfile.gettempdir()) / "r3jax-bench-serve-jax-cache"
ENV = {"JAX_COMPILATION_CACHE_DIR": str(CACHE), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu"}
os.environ.update(ENV)  # before JAX starts: server and in-process engine share compiled programs

import httpx  # noqa: E402
from r3jax.serve.client import wait_healthy  # noqa: E402

from experiments.common import table, write_json  # noqa: E402
from r3jax.engine import Engine, GenerateRequest  # noqa: E402
from r3jax.serve import RemoteInferenceClient  # noqa: E402
from r3jax.serve.protocol import BINARY_MEDIA_TYPE  # noqa: E402

MAX_BATCH, MAX_SEQ, PROMPT = 32, 128, 20
STREAMS = 32  # concurrent streams in the streaming comparison


def start_server(max_tokens: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "r3jax", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", "0",
           "--max-batch-size", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ), "--prefix-cache-mb", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "XLA_FLAGS": ""})
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
    url = line.strip().rsplit(" ", 1)[-1]
    wait_healthy(url, proc=proc)
    return proc, url


def workload(n: int, max_tokens: int, vocab: int) -> list[GenerateRequest]:
    rng = np.random.default_rng(0)
    return [GenerateRequest(rng.integers(0, vocab, PROMPT).tolist(), max_tokens=max_tokens,
                            temperature=1.0, seed=i, return_routed_experts=True) for i in range(n)]


def http_pass(loop, client: RemoteInferenceClient, reqs) -> float:
    """One pass through a long-lived client (its keep-alive connections are reused across passes,
    as in a rollout loop), on a long-lived event loop."""
    t0 = time.perf_counter()
    outs = loop.run_until_complete(client.agenerate(reqs))
    dt = time.perf_counter() - t0
    assert all(len(o.output_ids) == r.max_tokens for o, r in zip(outs, reqs))
    return dt


async def completions_pass(client: httpx.AsyncClient, url: str, reqs, *, stream: bool) -> float:
    """Every request through vLLM's /v1/completions at once (the client's connection limit is the
    concurrency), streamed (server-sent events, tokens counted from the chunks) or not; seconds."""
    async def one(r) -> int:
        body = {"prompt": list(r.prompt_ids), "max_tokens": r.max_tokens, "temperature": 1.0, "seed": r.seed,
                "return_token_ids": True, "return_routed_experts": True, "stream": stream}
        if not stream:
            resp = await client.post(url + "/v1/completions", json=body)
            return len(resp.json()["choices"][0]["token_ids"])
        got = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    got += sum(len(c["token_ids"] or []) for c in json.loads(line[6:])["choices"])
        return got

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(r) for r in reqs))
    dt = time.perf_counter() - t0
    assert counts == [r.max_tokens for r in reqs], counts
    return dt


def engine_pass(engine: Engine, reqs, c: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), c):
        engine.generate(reqs[i:i + c])
    return time.perf_counter() - t0


def wire_bytes(url: str, info: dict) -> list[dict]:
    from r3jax.routes import encode, encode_binary

    body = {"prompt_ids": list(range(1, 25)), "return_routed_experts": True,
            "sampling_params": {"max_tokens": 40, "temperature": 0.0}}
    raw_row = info["num_moe_layers"] * info["top_k"] * 1  # uint8 for E <= 256
    js = httpx.post(url + "/v1/generate", json=body).content
    obj = json.loads(js)
    rows = obj["routed_experts"]["shape"][0]
    route_json = len(json.dumps(obj["routed_experts"], separators=(",", ":")))
    bn = httpx.post(url + "/v1/generate", json=body, headers={"Accept": BINARY_MEDIA_TYPE}).content
    (n,) = struct.unpack_from("<I", bn)
    out = [{"model": "tiny (served)", "rows": rows, "raw_B_per_row": raw_row,
            "json_B_per_row": route_json / rows, "binary_B_per_row": (len(bn) - 4 - n) / rows,
            "json_response_B_per_row": len(js) / rows, "binary_response_B_per_row": len(bn) / rows}]
    # Qwen3-30B-A3B shape; K distinct ids per (token, layer), as every encoder requires
    routes = np.argsort(np.random.default_rng(0).random((rows, 48, 128)), axis=-1)[..., :8].astype(np.uint8)
    layers = list(range(48))
    out.append({"model": "Qwen3-30B-A3B shape (encoders only)", "rows": rows, "raw_B_per_row": 48 * 8,
                "json_B_per_row": len(json.dumps(encode(routes, 0, layers), separators=(",", ":"))) / rows,
                "binary_B_per_row": len(encode_binary(routes, 0, layers)) / rows})
    for r in out:
        r["json_vs_raw"] = r["json_B_per_row"] / r["raw_B_per_row"]
        r["binary_vs_raw"] = r["binary_B_per_row"] / r["raw_B_per_row"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and tokens, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    n, max_tokens = (64, 16) if args.quick else (128, 32)
    repeats = args.repeats or (1 if args.quick else 3)
    levels = (1, 8, 32)

    from flax import nnx

    from models import MoeConfig, MoeTransformer

    proc, url = start_server(max_tokens)
    loop = asyncio.new_event_loop()
    try:
        engine = Engine(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)), max_seq_len=MAX_SEQ,
                        max_batch_size=MAX_BATCH, prefix_cache_bytes=0)
        engine.warmup()
        info = httpx.get(url + "/v1/model").json()
        reqs = workload(n, max_tokens, info["vocab_size"])
        single = reqs[: n // 2]  # c = 1 runs half the requests (it is the slow case)
        clients = {c: RemoteInferenceClient(url, max_concurrency=c) for c in levels}
        times = {("http", c): [] for c in levels} | {("engine", c): [] for c in levels}
        batches = {}
        programs = lambda: (httpx.get(url + "/v1/stats").json()["engine"]["compiled_programs"],
                            engine.stats["compiled_programs"])
        for c in levels:  # opens the clients' connections; the programs are already compiled
            work = single if c == 1 else reqs
            http_pass(loop, clients[c], work), engine_pass(engine, work, c)
        warm = programs()
        for _ in range(repeats):
            for c in levels:
                work = single if c == 1 else reqs
                before = httpx.get(url + "/v1/stats").json()
                times[("http", c)].append(http_pass(loop, clients[c], work))
                after = httpx.get(url + "/v1/stats").json()
                # tokens decoded per decode call (rows x steps: a decode loop runs up to decode_steps of them)
                e0, e1 = before["engine"], after["engine"]
                batches[c] = (e1["decode_slot_steps"] - e0["decode_slot_steps"]) / max(1, e1["decode_calls"] - e0["decode_calls"])
                times[("engine", c)].append(engine_pass(engine, work, c))
        # streaming: 32 concurrent streams against 32 concurrent plain requests, interleaved passes
        stream_reqs = reqs[:STREAMS]
        http = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=STREAMS))
        stream_times = {True: [], False: []}
        for i in range(repeats + 1):  # the first pass of each is untimed (connections, first chunks)
            for streamed in (False, True):
                dt = loop.run_until_complete(completions_pass(http, url, stream_reqs, stream=streamed))
                if i:
                    stream_times[streamed].append(dt)
        loop.run_until_complete(http.aclose())
        compiled_while_timing = [b - a for a, b in zip(warm, programs())]
        rows = []
        per_req_serial = statistics.median(times[("http", 1)]) / len(single)
        for c in levels:
            k = len(single) if c == 1 else n
            th, te = statistics.median(times[("http", c)]), statistics.median(times[("engine", c)])
            rows.append({"concurrency": c, "requests": k, "new_tokens": max_tokens,
                         "http_req_s": k / th, "http_tok_s": k * max_tokens / th,
                         "engine_req_s": k / te, "engine_tok_s": k * max_tokens / te,
                         "http_vs_engine": te / th, "mean_server_batch": batches[c],
                         "vs_serial": th / (k * per_req_serial)})
        toks = len(stream_reqs) * max_tokens
        streaming = {"requests": len(stream_reqs), "new_tokens": max_tokens,
                     "plain_tok_s": toks / statistics.median(stream_times[False]),
                     "streamed_tok_s": toks / statistics.median(stream_times[True])}
        streaming["streamed_over_plain"] = streaming["streamed_tok_s"] / streaming["plain_tok_s"]
        wire = wire_bytes(url, info)
        for client in clients.values():
            loop.run_until_complete(client.aclose())
    finally:
        loop.close()
        proc.terminate()
        proc.wait(60)
    cols = ["concurrency", "requests", "new_tokens", "http_req_s", "http_tok_s", "engine_req_s", "engine_tok_s",
            "http_vs_engine", "mean_server_batch", "vs_serial"]
    print(table(rows, cols))
    print()
    print(table(wire, ["model", "rows", "raw_B_per_row", "json_B_per_row", "binary_B_per_row", "json_vs_raw",
                       "binary_vs_raw", "json_response_B_per_row", "binary_response_B_per_row"]))
    print(f"programs compiled during the timed passes (server, in-process): {compiled_while_timing}")
    print(f"{streaming['requests']} concurrent streams over {streaming['requests']} concurrent plain /v1/completions "
          f"requests: {streaming['streamed_tok_s']:.0f} / {streaming['plain_tok_s']:.0f} tokens/s = "
          f"{streaming['streamed_over_plain']:.3f} (goal >= 0.9)")
    path = write_json("bench_serve", {"quick": args.quick, "repeats": repeats, "throughput": rows, "wire": wire,
                                      "streaming": streaming,
                                      "compiled_while_timing": compiled_while_timing,
                                      "max_batch_size": MAX_BATCH, "max_seq_len": MAX_SEQ})
    print("wrote", path)


if __name__ == "__main__":
    main()
