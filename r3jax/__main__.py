"""Command line: ``python -m r3jax demo`` (the main job), ``python -m r3jax serve`` (HTTP server) and
``python -m r3jax train`` (training on saved rollout rows, one process or many)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m r3jax {demo,serve,train} [options]  (each takes --help)")
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from r3jax.demo import main as demo_main
        demo_main(rest)
    elif cmd == "serve":
        from r3jax.serve.server import main as serve_main
        serve_main(rest)
    elif cmd == "train":
        from r3jax.train.cli import main as train_main
        train_main(rest)
    else:
        raise SystemExit(f"unknown command {cmd!r}: expected 'demo', 'serve' or 'train'")


if __name__ == "__main__":
    main()
