"""Route transfer cost of multi-turn rollouts over HTTP: incremental vs full re-gather.

    python -m experiments.transfer_cost [--quick]

The same multi-turn rollouts (ArithmeticEnv with exactly T turns, same env and sampling seeds) run
twice against the inference server through ``RemoteInferenceClient`` + ``AgentLoop``: incremental
(each turn sends ``routed_experts_prompt_start = trace.prompt_start``) and full re-gather (start 0
every turn). For T = 1, 2, 4, 8, 16, 32 it reports route rows and bytes received (raw array bytes and
bytes on the wire, for the binary framing and for JSON+base64), server time gathering the route
rows off the device and encoding them, and client decode time; plus full ÷ incremental ratios from
the same run (expected about (T+1)/2 for rows when every turn adds the same number of tokens).
Writes experiments/results/transfer_cost.json and transfer_cost.png.

Nothing is patched: the server is the stock ``python -m r3jax serve``, and every figure comes from
published counters read before and after each case. Client side: ``RemoteInferenceClient.stats``
(``decode_s``, ``route_bytes``, ``body_bytes``). Server side: ``GET /v1/stats`` →
``routes = {gather_s, encode_s, rows, bytes, responses}``; a server without that block stops the
script with a message naming the missing keys.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

RESULTS_NAME = "transfer_cost"
# 48 MoE layers x K=8 x 1 byte (uint8, E=128): what each received row would weigh on Qwen3-30B-A3B
QWEN3_30B_ROW_BYTES = 48 * 8 * 1


# ---- server side: the stock server and its stats ---------------------------------------------
SERVER_ROUTE_KEYS = ("gather_s", "encode_s", "rows", "bytes", "responses")


def server_routes(url: str) -> dict:
    """The server's cumulative route counters, ``GET /v1/stats`` → ``routes``: seconds reading route
    rows off the device (gather) and encoding them, rows and wire bytes sent, responses with routes.
    A server without them cannot give the server-side columns: stop rather than guess."""
    import httpx

    stats = httpx.get(url + "/v1/stats", timeout=30).json()
    routes = stats.get("routes")
    missing = [k for k in SERVER_ROUTE_KEYS if not isinstance(routes, dict) or k not in routes]
    if missing:
        raise SystemExit(f"{url}/v1/stats has no routes.{{{', '.join(missing)}}} (got top-level keys "
                         f"{sorted(stats)}): this server does not report route gather/encode stats, so the "
                         "server-side columns of this experiment cannot be measured. Run it against a server "
                         "that reports \"routes\": {\"gather_s\", \"encode_s\", \"rows\", \"bytes\", "
                         "\"responses\"} in GET /v1/stats.")
    return {k: routes[k] for k in SERVER_ROUTE_KEYS}


def route_heavy_dir(path) -> str:
    """A Hugging Face directory of a narrow model whose route rows weigh what Qwen3-30B-A3B's do
    (48 MoE layers, E=128, K=8: 384 bytes per row in uint8), so transfer costs are realistic."""
    from flax import nnx

    from models import MoeConfig, MoeTransformer
    from models.hf import save_pretrained

    cfg = MoeConfig(vocab_size=272, hidden_size=32, num_layers=48, num_heads=2, num_kv_heads=1, head_dim=16,
                    num_experts=128, top_k=8, moe_intermediate_size=8, first_dense_layers=0)
    save_pretrained(MoeTransformer(cfg, rngs=nnx.Rngs(0)), path)
    return str(path)


def start_server(model: str, max_seq_len: int, max_batch_size: int, timeout: float = 900.0):
    """``python -m r3jax serve`` on a free port; returns (process, url) once ``/health`` is 200."""
    from r3jax.serve.client import wait_healthy

    proc = subprocess.Popen([sys.executable, "-m", "r3jax", "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", "0", "--max-seq-len", str(max_seq_len), "--max-batch-size",
                             str(max_batch_size)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, line = time.monotonic() + timeout, ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start (exit code {proc.poll()})")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain logs
    url = line.strip().rsplit(" ", 1)[-1]
    try:
        wait_healthy(url, timeout=max(1.0, deadline - time.monotonic()), poll_s=0.2, proc=proc)
    except (RuntimeError, TimeoutError):
        proc.kill()
        raise
    return proc, url


# ---- client side -----------------------------------------------------------------------------
def run_case(client, url, turns: int, mode: str, n: int, max_tokens: int,
             max_seq_len: int) -> tuple[dict, list]:
    """One case: rollouts through ``client``; client counters (``client.stats``) and server counters
    (``/v1/stats`` routes) read before and after, so each row holds this case's share."""
    from r3jax.rollout import AgentLoop, ArithmeticEnv

    loop = AgentLoop(client, lambda: ArithmeticEnv(num_turns=turns), max_turns=turns, max_seq_len=max_seq_len,
                     sampling={"max_tokens": max_tokens, "temperature": 1.0},
                     full_regather=(mode == "full"), seed=0)
    server0, client0 = server_routes(url), client.stats
    t0 = time.perf_counter()
    trajs = loop.run(n, 1, env_seeds=list(range(n)))
    wall = time.perf_counter() - t0
    server1, client1 = server_routes(url), client.stats
    srv = {k: server1[k] - server0[k] for k in SERVER_ROUTE_KEYS}
    cli = {k: client1[k] - client0[k] for k in client1}
    if not all(t.num_turns == turns for t in trajs):
        raise RuntimeError(f"every rollout must run exactly T={turns} turns: got {[t.num_turns for t in trajs]}")
    if cli["retries"]:
        raise RuntimeError(f"{cli['retries']} retried requests: server counters would include failed attempts")
    if srv["rows"] != cli["route_rows"]:
        raise RuntimeError(f"the server reports {srv['rows']} route rows sent, the client decoded "
                           f"{cli['route_rows']}: the counters disagree")
    return {
        "T": turns, "mode": mode, "trajectories": n, "tokens": sum(t.num_tokens for t in trajs),
        "rows": sum(t.route_rows for t in trajs), "raw_bytes": sum(t.route_bytes for t in trajs),
        "wire_route_bytes": cli["route_bytes"], "wire_body_bytes": cli["body_bytes"],
        "server_route_rows": srv["rows"], "server_route_bytes": srv["bytes"],
        "server_gather_ms": 1e3 * srv["gather_s"], "server_encode_ms": 1e3 * srv["encode_s"],
        "client_decode_ms": 1e3 * cli["decode_s"], "rollout_s": wall,
    }, trajs


def median_row(runs: list[dict]) -> dict:
    """Counts must agree across repeats (same seeds); timings are the median."""
    out = dict(runs[0])
    for key in ("tokens", "rows", "raw_bytes", "wire_route_bytes", "server_route_rows"):
        if len({r[key] for r in runs}) != 1:
            raise RuntimeError(f"{key} differs across repeats: {[r[key] for r in runs]}")
    for key in ("server_gather_ms", "server_encode_ms", "client_decode_ms", "rollout_s"):
        out[key] = float(np.median([r[key] for r in runs]))
    return out


def plot(rows: list[dict], path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for wire, ls in (("binary", "-"), ("json", "--")):
        for mode, color in (("incremental", "tab:blue"), ("full", "tab:red")):
            sel = sorted((r for r in rows if r["wire"] == wire and r["mode"] == mode), key=lambda r: r["T"])
            if not sel:
                continue
            ts = [r["T"] for r in sel]
            label = f"{mode} ({wire})"
            if wire == "binary":
                axes[0].plot(ts, [r["rows"] / r["trajectories"] for r in sel], ls, color=color, marker="o",
                             label=mode)
            axes[1].plot(ts, [r["wire_route_bytes"] / r["trajectories"] / 1024 for r in sel], ls, color=color,
                         marker="o", label=label)
            axes[2].plot(ts, [(r["server_gather_ms"] + r["server_encode_ms"] + r["client_decode_ms"])
                              / r["trajectories"] for r in sel], ls, color=color, marker="o", label=label)
    titles = ("route rows received per trajectory", "route KiB on the wire per trajectory",
              "server gather+encode + client decode, ms per trajectory")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("turns T")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"multi-turn route transfer, model {model}: incremental (linear) vs full re-gather "
                 f"(quadratic)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure(url: str, model: str, turns: list[int], wires: list[str], n: int, max_tokens: int,
            max_seq_len: int, repeats: int) -> tuple[list[dict], bool]:
    """All cases against the running server: one row per (wire, T, mode), and whether incremental
    and full re-gather gave identical tokens and routes."""
    from r3jax.serve.client import RemoteInferenceClient

    results, identical = [], True
    server_routes(url)  # fail at once (before any rollout) if the server lacks route stats
    for wire in wires:
        with RemoteInferenceClient(url, binary_routes=(wire == "binary")) as client:
            for t in turns:  # warm-up: compile every program shape before timing
                for mode in ("incremental", "full"):
                    run_case(client, url, t, mode, n, max_tokens, max_seq_len)
            for t in turns:
                pair = {}
                for mode in ("incremental", "full"):
                    runs = [run_case(client, url, t, mode, n, max_tokens, max_seq_len)
                            for _ in range(repeats)]
                    row, pair[mode] = median_row([r for r, _ in runs]), runs[0][1]
                    if model == "tiny":
                        row["qwen3_30b_bytes_projected"] = row["rows"] * QWEN3_30B_ROW_BYTES
                    results.append({"wire": wire, **row})
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in results[-1].items()},
                          flush=True)
                both = list(zip(pair["incremental"], pair["full"]))
                same_tokens = all(np.array_equal(a.tokens, b.tokens) for a, b in both)
                # route rows (same tokens) where the two modes recorded different ids: the rows come
                # from different engine programs (decode step vs prefill chunk, other batch shapes)
                diff = (sum(int((a.routes != b.routes).any((1, 2)).sum()) for a, b in both)
                        if same_tokens else None)
                for r in results[-2:]:
                    r["same_tokens_both_modes"], r["route_rows_differing_between_modes"] = same_tokens, diff
                identical &= same_tokens and diff == 0
    return results, identical


def ratios_of(results: list[dict]) -> list[dict]:
    """full ÷ incremental for each (wire, T), from the same run."""
    out = []
    for inc in (r for r in results if r["mode"] == "incremental"):
        full = next(r for r in results if r["wire"] == inc["wire"] and r["T"] == inc["T"] and r["mode"] == "full")
        ratio = lambda key: full[key] / inc[key] if inc[key] else float("nan")
        out.append({"wire": inc["wire"], "T": inc["T"], "expected_(T+1)/2": (inc["T"] + 1) / 2,
                    "rows_ratio": ratio("rows"), "wire_route_bytes_ratio": ratio("wire_route_bytes"),
                    "server_gather_ratio": ratio("server_gather_ms"),
                    "server_encode_ratio": ratio("server_encode_ms"),
                    "client_decode_ratio": ratio("client_decode_ms")})
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="T up to 8, 2 trajectories, binary wire only")
    ap.add_argument("--model", default="tiny", choices=["tiny", "route_heavy"],
                    help="tiny: L=2, K=2 (4 B/row); route_heavy: 48 MoE layers, K=8 (384 B/row, "
                         "Qwen3-30B-A3B's row size) on a narrow model")
    ap.add_argument("--trajectories", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn (at most)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per case (median reported)")
    args = ap.parse_args(argv)

    from experiments.common import RESULTS, table, write_json

    turns = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32]
    wires = ["binary"] if args.quick else ["binary", "json"]
    n = args.trajectories or (2 if args.quick else 4)
    repeats = args.repeats or 3
    # each turn: <= max_tokens generated + 1 synthetic EOS + a 6-token question; first prompt 7
    max_seq_len = 1 << (7 + max(turns) * (args.max_tokens + 7)).bit_length()
    name = RESULTS_NAME if args.model == "tiny" else f"{RESULTS_NAME}_{args.model}"
    with tempfile.TemporaryDirectory() as tmp:
        model = "tiny" if args.model == "tiny" else route_heavy_dir(Path(tmp) / "route_heavy")
        proc, url = start_server(model, max_seq_len, max_batch_size=32)
        try:
            results, identical = measure(url, args.model, turns, wires, n, args.max_tokens, max_seq_len, repeats)
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    ratios = ratios_of(results)
    cols = ["wire", "T", "mode", "tokens", "rows", "raw_bytes", "wire_route_bytes", "server_route_bytes",
            "server_gather_ms", "server_encode_ms", "client_decode_ms", "rollout_s",
            "route_rows_differing_between_modes"]
    cols += ["qwen3_30b_bytes_projected"] if args.model == "tiny" else []
    row_bytes = results[0]["raw_bytes"] // max(results[0]["rows"], 1)
    print(f"\n{n} trajectories per case, model {args.model} ({row_bytes} bytes per route row), <= "
          f"{args.max_tokens} tokens per turn; totals over the trajectories; timings: median of "
          f"{repeats} run(s)" + (f"; qwen3_30b_bytes_projected = rows x {QWEN3_30B_ROW_BYTES} B "
                                 f"(computed, not measured)" if args.model == "tiny" else "") + "\n")
    print(table(results, cols))
    print()
    print(table(ratios, list(ratios[0])))
    print(f"\nincremental and full re-gather gave identical tokens and final routes: {identical}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / f"{name}.png"
    plot(results, png, args.model)
    path = write_json(name, {"model": args.model, "quick": args.quick, "trajectories": n, "repeats": repeats,
                             "max_tokens": args.max_tokens, "max_seq_len": max_seq_len, "rows": results,
                             "ratios": ratios, "identical_tokens_and_routes": identical})
    print("wrote", path, "and", png)


if __name__ == "__main__":
    main()
