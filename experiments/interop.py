"""Each protocol r3jax speaks, side by side: route bytes on the wire, encode / decode cost, and HTTP
throughput, all ÷ r3jax's native JSON form in the same run.

    python -m experiments.interop [--quick]

Protocols: r3jax ``/v1/generate`` (JSON wire form, and its binary framing), SkyRL ``/skyrl/v1/generate``
(packed routes, value-canonical dtype), vLLM ``/v1/completions`` (base64 ``.npy``), SGLang ``/generate``
(base64 int32).

1. **Wire and codec cost** on real route shapes, one 640-row chunk (a turn of 640 tokens): Qwen3-30B-A3B
   (48 MoE layers, K = 8, E = 128: uint8) and Kimi-K2 (60 MoE layers, K = 8, E = 384: int16; ids drawn up to
   383). ``route_B_row``: bytes of the route payload in the response body ÷ rows (``÷ raw``: over the raw
   array, rows × L × K × r3jax's dtype bytes). ``encode_us_row``: the server's whole render of that answer
   (the same function the endpoint calls, to body bytes) ÷ rows; ``decode_us_row``: the client's whole
   parse and check (``RemoteInferenceClient``'s dialect, row rule included) ÷ rows. Minimum over
   repeats interleaved across protocols (pure CPU work: the minimum is the least disturbed run).
2. **Requests/s at concurrency 8** on the tiny model over loopback HTTP: ``python -m r3jax serve`` in a
   subprocess (warmed up), one ``RemoteInferenceClient(protocol=...)`` per protocol with
   ``max_concurrency=8``, the same N requests (20-token prompts, 16 sampled tokens, fixed seeds, routes for
   every row), interleaved passes, median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from experiments.bench_serve import start_server, workload
from experiments.common import table, write_json
from r3jax.engine import GenerateOutput, GenerateRequest
from r3jax.routes import route_dtype
from r3jax.serve import schema
from r3jax.serve.client import protocols
from r3jax.serve.peers import sglang, skyrl, vllm
from r3jax.serve.protocol import BINARY_MEDIA_TYPE, ServedModel

PROTOCOLS = [("r3jax", False), ("r3jax", True), ("skyrl", False), ("vllm", False), ("sglang", False)]
SHAPES = {"Qwen3-30B-A3B": (48, 8, 128), "Kimi-K2": (60, 8, 384)}
ROWS = 640


def label(name: str, binary: bool) -> str:
    return f"{name} binary" if binary else name


def render(name: str, binary: bool, out: GenerateOutput, req: GenerateRequest, layers: list[int], e: int):
    """(body bytes, media type, route payload bytes) exactly as the server's endpoint renders them."""
    import struct

    if name == "r3jax":
        obj, frame = schema.output_json(out, layers, binary_routes=binary)
        head = json.dumps(obj, separators=(",", ":")).encode()
        if binary:
            return struct.pack("<I", len(head)) + head + frame, BINARY_MEDIA_TYPE, len(frame)
        return head, "application/json", len(obj["routed_experts"]["data"])
    if name == "skyrl":
        body = skyrl.dumps(skyrl.render_generate(out, req, num_experts=e))
    elif name == "vllm":
        body = json.dumps(vllm.render_completion(out, req, model="m", request_id="1", created=0, num_experts=e),
                          separators=(",", ":")).encode()
    else:
        body = json.dumps(sglang.render_generate(out, req, num_experts=e, rid="1"), separators=(",", ":")).encode()
    return body, "application/json", protocols.json_route_bytes(body)


def codec_rows(repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    cases = []
    for model, (l, k, e) in SHAPES.items():
        routes = np.stack([rng.permutation(e)[:k] for _ in range(ROWS * l)]).reshape(ROWS, l, k).astype(route_dtype(e))
        req = GenerateRequest(list(range(ROWS)), max_tokens=1, return_routed_experts=True)  # P - 0 + 1 - 1 rows
        out = GenerateOutput([7], [-0.5], "length", routes, ROWS, 0, 3, 0)
        info = ServedModel(num_experts=e, top_k=k, moe_layer_ids=tuple(range(l)))
        for name, binary in PROTOCOLS:
            dialect = protocols.make(name, binary_routes=binary)
            body, media, route_b = render(name, binary, out, req, list(range(l)), e)
            got = dialect.decode(body, media, req, info, "bench", {"x-weight-version": "3"})
            np.testing.assert_array_equal(got.routed_experts, routes)  # every form carries the same rows
            cases.append(dict(model=model, name=name, binary=binary, out=out, req=req, info=info, e=e,
                              layers=list(range(l)), dialect=dialect, body=body, media=media, route_b=route_b,
                              raw=routes.nbytes, enc=[], dec=[]))
    for _ in range(repeats):  # interleaved, so a busy spell of the machine hits every protocol alike
        for c in cases:
            t0 = time.perf_counter()
            render(c["name"], c["binary"], c["out"], c["req"], c["layers"], c["e"])
            t1 = time.perf_counter()
            c["dialect"].decode(c["body"], c["media"], c["req"], c["info"], "bench", {"x-weight-version": "3"})
            t2 = time.perf_counter()
            c["enc"].append(t1 - t0), c["dec"].append(t2 - t1)
    rows = [{"model": c["model"], "protocol": label(c["name"], c["binary"]), "raw_B_row": c["raw"] / ROWS,
             "route_B_row": c["route_b"] / ROWS, "over_raw": c["route_b"] / c["raw"],
             "body_B_row": len(c["body"]) / ROWS, "encode_us_row": min(c["enc"]) / ROWS * 1e6,
             "decode_us_row": min(c["dec"]) / ROWS * 1e6} for c in cases]
    for r in rows:  # ÷ r3jax's native JSON form of the same shape, same run
        base = next(b for b in rows if b["model"] == r["model"] and b["protocol"] == "r3jax")
        for key in ("route_B_row", "encode_us_row", "decode_us_row"):
            r[f"{key}_vs_r3jax"] = r[key] / base[key]
    return rows


def throughput(n: int, repeats: int) -> list[dict]:
    proc, url = start_server(16)
    loop = asyncio.new_event_loop()
    from r3jax.serve import RemoteInferenceClient

    try:
        reqs = workload(n, 16, 272)
        clients = {label(p, b): RemoteInferenceClient(url, protocol=p, binary_routes=b, max_concurrency=8,
                                                      model="tiny") for p, b in PROTOCOLS}
        times = {name: [] for name in clients}
        outs = {name: loop.run_until_complete(c.agenerate(reqs)) for name, c in clients.items()}  # untimed
        ref = outs["r3jax"]
        for name, got in outs.items():  # same requests, same seeds: the same tokens and rows on every protocol
            for a, b in zip(got, ref):
                if a.output_ids != b.output_ids or not np.array_equal(a.routed_experts, b.routed_experts):
                    raise RuntimeError(f"{name}: answers differ from the r3jax protocol's")
        for _ in range(repeats):
            for name, c in clients.items():
                t0 = time.perf_counter()
                loop.run_until_complete(c.agenerate(reqs))
                times[name].append(time.perf_counter() - t0)
        for c in clients.values():
            loop.run_until_complete(c.aclose())
    finally:
        loop.close()
        proc.terminate()
        proc.wait(60)
    base = n / statistics.median(times["r3jax"])
    return [{"protocol": name, "requests": n, "concurrency": 8, "req_s": n / statistics.median(t),
             "req_s_vs_r3jax": n / statistics.median(t) / base} for name, t in times.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    args = ap.parse_args()
    codec = codec_rows(3 if args.quick else 15)
    cols = ["model", "protocol", "raw_B_row", "route_B_row", "over_raw", "route_B_row_vs_r3jax", "encode_us_row",
            "encode_us_row_vs_r3jax", "decode_us_row", "decode_us_row_vs_r3jax"]
    print(table(codec, cols))
    http = throughput(32 if args.quick else 128, 1 if args.quick else 5)
    print()
    print(table(http, ["protocol", "requests", "concurrency", "req_s", "req_s_vs_r3jax"]))
    path = write_json("interop", {"quick": args.quick, "rows_per_chunk": ROWS, "codec": codec, "http": http})
    print("wrote", path)


if __name__ == "__main__":
    main()
