"""``python -m r3jax serve``: the inference server under uvicorn.

    python -m r3jax serve --model tiny --host 127.0.0.1 --port 8000 [--api-key KEY]
        [--max-batch-size 32] [--max-seq-len 256] [--seed 0] [--config PRESET|HF_DIR]

``--model``: a preset (``tiny``), a Hugging Face directory or an orbax params directory (see
:mod:`r3jax.serve.weights`). Binds to loopback unless ``--host`` says otherwise. ``--port 0`` picks a
free port. Prints ``r3jax serve: listening on http://HOST:PORT`` once the socket is bound.

SIGTERM / SIGINT: uvicorn stops accepting connections, lets in-flight requests finish (up to
``--graceful-timeout`` seconds), then the app refuses anything still queued with 503 (clients retry
it elsewhere) and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m r3jax serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="preset name, Hugging Face dir or orbax params dir")
    ap.add_argument("--config", default=None, help="config for an orbax --model: preset or HF dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("R3JAX_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $R3JAX_API_KEY)")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20)
    ap.add_argument("--batch-wait-ms", type=float, default=2.0, help="bounded wait to fill a batch")
    ap.add_argument("--seed", type=int, default=0, help="init seed of a preset model")
    ap.add_argument("--prefix-cache-mb", type=float, default=64.0,
                    help="device memory for the engine's prefix cache (0 turns it off)")
    ap.add_argument("--warmup", default=None, metavar="P:G",
                    help="before serving, compile every batch-size bucket for P-token prompts and G new tokens")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="param and compute dtype (default: the checkpoint's / preset's)")
    ap.add_argument("--graceful-timeout", type=float, default=30.0)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    for name in ("max_batch_size", "max_seq_len", "max_body_bytes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if not 0 <= args.port < 65536:
        ap.error(f"--port={args.port}: expected 0..65535")
    if args.prefix_cache_mb < 0:
        ap.error(f"--prefix-cache-mb={args.prefix_cache_mb}: expected >= 0")
    if args.warmup is not None:
        try:
            p, g = (int(x) for x in args.warmup.split(":"))
            assert p >= 1 and g >= 1 and p + g <= args.max_seq_len
        except (ValueError, AssertionError):
            ap.error(f"--warmup={args.warmup!r}: expected P:G, ints >= 1 with P + G <= --max-seq-len")
        args.warmup = (p, g)
    return args


def warmup(engine, prompt_len: int, max_tokens: int) -> int:
    """Run one batch of every power-of-two size up to ``engine.max_batch_size`` (each a batch-size
    bucket of the engine), routes on, so those programs are compiled before the first request.
    Distinct prompts: no prefix-cache hits change the shapes. Returns the engine's program count."""
    from r3jax.engine import GenerateRequest

    vocab, b, k = engine.config.vocab_size, 1, 0
    while True:
        reqs = []
        for _ in range(b):
            reqs.append(GenerateRequest([(k * 7919 + j * 31 + 1) % vocab for j in range(prompt_len)],
                                        max_tokens=max_tokens, temperature=0.0, return_routed_experts=True))
            k += 1
        engine.generate(reqs)
        if b >= engine.max_batch_size:
            return int(engine.stats.get("compiled_programs", 0))
        b = min(2 * b, engine.max_batch_size)


def build_engine(args: argparse.Namespace):
    import jax.numpy as jnp

    from r3jax.engine import Engine
    from r3jax.serve.weights import build_model

    dtype = None if args.dtype is None else getattr(jnp, args.dtype)
    model = build_model(args.model, config=args.config, seed=args.seed, dtype=dtype)
    return Engine(model, max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
                  prefix_cache_bytes=int(args.prefix_cache_mb * (1 << 20)))


def serve(app, sock: socket.socket, *, log_level: str = "warning", graceful_timeout: float = 30.0):
    """Run ``app`` under uvicorn on an already bound socket until SIGTERM/SIGINT."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from r3jax.serve.app import create_app

    try:
        engine = build_engine(args)
    except (ValueError, FileNotFoundError) as e:  # a bad --model / --config: say so, no traceback
        raise SystemExit(f"python -m r3jax serve: {e}") from None
    if args.warmup is not None:
        warmup(engine, *args.warmup)
    app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     max_wait_s=args.batch_wait_ms / 1000)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, restores these handlers and re-raises the
    # signal: exit 0 then, instead of dying by the signal after a clean shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"r3jax serve: listening on http://{host}:{port}", flush=True)
    serve(app, sock, log_level=args.log_level, graceful_timeout=args.graceful_timeout)
