"""The R3 data path: trace append + finalize, bytes on the wire, packed vs padded batches.

    python -m experiments.bench_trace [--quick]

1. Append + finalize time of a RoutedExpertTrace over 10, 100, 1000 turns against naive
   re-concatenation of the whole prefix every turn (same chunks, same run). Per-turn time should stay
   flat for the trace (O(N) total) and grow with the turn count for the naive one (O(N^2)).
   copy_floor is the cost of copying each chunk once, the floor for any owner of the data (its
   per-turn value moves with the allocator and caches, not with the algorithm).
2. Bytes on the wire per route row: JSON+base64 (r3jax wire form), binary framing, SGLang's int32
   base64 and nested JSON lists, each against the raw compact array.
3. Fill ratio (real tokens / B*S) of padded vs packed batches on a long-tailed RL length mix.
"""

from __future__ import annotations

import argparse
import base64
import json
import time

import numpy as np

from experiments.common import table, timeit, write_json
from r3jax.batch import DEFAULT_BUCKETS, bucket_length, collate, fill_ratio
from r3jax.routes import decode, decode_binary, encode, encode_binary, route_dtype
from r3jax.trace import RoutedExpertTrace

MODELS = {  # name: (MoE layers L, experts E, top-k K), as in docs/design.md §1
    "Qwen3-30B-A3B": (48, 128, 8), "DeepSeek-V3": (58, 256, 8), "Kimi-K2": (60, 384, 8),
    "gpt-oss-120b": (36, 128, 4), "Mixtral-8x7B": (32, 8, 2),
}


def _routes(rows, num_layers, num_experts, top_k, seed=0):
    """Random distinct ids per (row, layer), in the compact dtype."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, num_layers, num_experts), dtype=np.float32), axis=-1)[..., :top_k]
    return ids.astype(route_dtype(num_experts))


def bench_append(turns_list, rows_per_turn, repeats):
    """Multi-turn: each turn adds obs tokens to the prompt and generates, returning rows_per_turn rows."""
    num_layers, num_experts, top_k = MODELS["Qwen3-30B-A3B"]
    obs = rows_per_turn // 2
    gen = rows_per_turn - obs + 1  # rows = P - s + G - 1 = obs + gen - 1
    pool = _routes(rows_per_turn * 8, num_layers, num_experts, top_k)
    out = []
    for turns in turns_list:
        chunks = [pool[(t % 8) * rows_per_turn:(t % 8 + 1) * rows_per_turn].copy() for t in range(turns)]
        n_tokens = turns * rows_per_turn + 1
        mask = np.zeros(n_tokens, np.float32)

        def build():
            tr = RoutedExpertTrace(moe_layer_ids=tuple(range(num_layers)))
            for c in chunks:
                tr = tr.record(prompt_len=tr.prompt_start + obs, generated_len=gen, routes=c)
            return tr

        def naive_run():
            acc = np.zeros((0, num_layers, top_k), chunks[0].dtype)
            for c in chunks:
                acc = np.concatenate([acc, c])  # the whole prefix is copied every turn
            return acc

        def copy_floor():  # each chunk copied once: what any owner of the data pays per turn
            return [np.array(c, copy=True) for c in chunks]

        built = build()
        routes, _ = built.finalize(token_count=n_tokens, loss_mask=mask)
        np.testing.assert_array_equal(routes[:-1], naive_run())  # same result, then time
        t_append = timeit(build, repeats=repeats)
        t_final = timeit(lambda: built.finalize(token_count=n_tokens, loss_mask=mask), repeats=repeats)
        t_naive = timeit(naive_run, repeats=repeats)
        t_copy = timeit(copy_floor, repeats=repeats)
        t_trace = t_append + t_final
        out.append({"turns": turns, "rows": turns * rows_per_turn,
                    "MiB": turns * rows_per_turn * num_layers * top_k / 2**20,
                    "append_ms": 1e3 * t_append, "finalize_ms": 1e3 * t_final,
                    "trace_ms": 1e3 * t_trace, "naive_ms": 1e3 * t_naive,
                    "copy_floor_us_per_turn": 1e6 * t_copy / turns,
                    "append_us_per_turn": 1e6 * t_append / turns,
                    "trace_us_per_turn": 1e6 * t_trace / turns, "naive_us_per_turn": 1e6 * t_naive / turns,
                    "naive_over_trace": t_naive / t_trace})
        print(out[-1], flush=True)
    return out


def _mb_per_s(fn, nbytes, repeats):
    return nbytes / 2**20 / timeit(fn, repeats=repeats)


def bench_wire(chunk_rows, repeats):
    out = []
    for name, (num_layers, num_experts, top_k) in MODELS.items():
        for rows in chunk_rows:
            r = _routes(rows, num_layers, num_experts, top_k, seed=rows)
            layers = list(range(num_layers))
            text = json.dumps(encode(r, 0, layers))
            blob = encode_binary(r, 0, layers)
            sglang = base64.b64encode(r.astype("<i4").tobytes())
            nested = json.dumps(r.tolist(), separators=(",", ":"))
            raw = r.nbytes
            row = {"model": name, "dtype": r.dtype.name, "rows": rows, "raw_B_row": raw / rows,
                   "json_b64_B_row": len(text) / rows, "binary_B_row": len(blob) / rows,
                   "sglang_i32_b64_B_row": len(sglang) / rows, "nested_lists_B_row": len(nested) / rows,
                   "json_over_raw": len(text) / raw, "binary_over_raw": len(blob) / raw,
                   "sglang_over_raw": len(sglang) / raw, "nested_over_raw": len(nested) / raw}
            if rows == max(chunk_rows):  # codec throughput on the large chunk
                row["json_roundtrip_MBps"] = _mb_per_s(
                    lambda: decode(json.loads(json.dumps(encode(r, 0, layers))), num_experts), raw, repeats)
                row["binary_roundtrip_MBps"] = _mb_per_s(
                    lambda: decode_binary(encode_binary(r, 0, layers), num_experts), raw, repeats)
            out.append(row)
            print(row, flush=True)
    return out


def _length_mix(rng, count):
    """Long-tailed RL lengths: lognormal prompts (median ~400) + responses (median ~700), <= 8192."""
    prompt = rng.lognormal(np.log(400), 0.6, count)
    response = rng.lognormal(np.log(700), 0.9, count)
    return np.clip(prompt + response, 16, 8192).astype(int)


def bench_fill(batches, batch_size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    cases = {"padded": dict(packed=False), "packed": dict(packed=True)}
    stats = {k: {"real": 0, "slots": 0, "rows": 0} for k in cases}
    for _ in range(batches):
        lengths = _length_mix(rng, batch_size)
        trajs = [{"tokens": np.ones(n, np.int32), "loss_mask": np.r_[0, np.ones(n - 1)],
                  "rollout_logprobs": np.zeros(n), "advantage": 0.0,
                  "routes": np.zeros((n, 1, 1), np.uint8), "captured": np.ones(n, bool)} for n in lengths]
        s = bucket_length(int(lengths.max()))
        for name, kw in cases.items():
            b = collate(trajs, seq_len=s, num_experts=8, top_k=1, num_layers=1, **kw)
            st = stats[name]
            st["real"] += int(b.attention_mask.sum())
            st["slots"] += b.attention_mask.size
            st["rows"] += b.tokens.shape[0]
            assert abs(fill_ratio(b) * b.attention_mask.size - int(b.attention_mask.sum())) < 1e-6
    for name, st in stats.items():
        out.append({"layout": name, "batches": batches, "trajectories": batches * batch_size,
                    "rows": st["rows"], "real_tokens": st["real"], "slots": st["slots"],
                    "fill_ratio": st["real"] / st["slots"],
                    "slots_vs_padded": st["slots"] / stats["padded"]["slots"]})
    print(out, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer rows per turn, chunks, batches, repeats")
    args = ap.parse_args()
    t0 = time.perf_counter()
    repeats = 2 if args.quick else 5
    rows_per_turn = 8 if args.quick else 64
    append = bench_append((10, 100, 1000), rows_per_turn, repeats)
    wire = bench_wire((1, 64) if args.quick else (1, 640), 5 if args.quick else 21)
    fill = bench_fill(4 if args.quick else 16, 64)

    print(f"\n## Append + finalize, Qwen3-30B-A3B routes (L=48, K=8, uint8), {rows_per_turn} rows/turn")
    print(table(append, ["turns", "rows", "MiB", "append_ms", "finalize_ms", "trace_ms", "naive_ms",
                         "copy_floor_us_per_turn", "append_us_per_turn", "trace_us_per_turn",
                         "naive_us_per_turn",
                         "naive_over_trace"]))
    print("\n## Bytes on the wire per route row (ratios against the raw compact array)")
    print(table(wire, ["model", "dtype", "rows", "raw_B_row", "json_b64_B_row", "binary_B_row",
                       "json_over_raw", "binary_over_raw", "sglang_over_raw", "nested_over_raw",
                       "json_roundtrip_MBps", "binary_roundtrip_MBps"]))
    print("\n## Fill ratio, padded vs packed (S = bucket of the longest trajectory in each batch of 64)")
    print(table(fill, ["layout", "batches", "trajectories", "rows", "real_tokens", "slots", "fill_ratio",
                       "slots_vs_padded"]))
    path = write_json("bench_trace", {
        "quick": args.quick, "rows_per_turn": rows_per_turn, "buckets": list(DEFAULT_BUCKETS),
        "length_mix": "lognormal prompt (median 400, sigma 0.6) + response (median 700, sigma 0.9), "
                      "clipped to [16, 8192]",
        "append": append, "wire": wire, "fill": fill, "wall_s": time.perf_counter() - t0})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
