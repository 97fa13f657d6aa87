"""Command line: ``python -m r3jax demo`` (the main job) and ``python -m r3jax serve`` (HTTP server)."""

from __future__ import annotations

import sys


def _showcase() -> None:
    """A short forward + replay showcase on the tiny model (until the full RL demo lands)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models import MoeConfig, MoeTransformer, Replay

    cfg = MoeConfig.tiny()
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t, p, r: nnx.merge(graphdef, s)(t, p, r))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    live = fwd(state, tokens, positions, None)
    print(f"tiny model: {cfg.param_count():,} params, MoE layers {cfg.moe_layer_ids}, "
          f"E={cfg.num_experts}, K={cfg.top_k}; routes {live.routes.shape}")
    same = fwd(state, tokens, positions, Replay(live.routes.astype(jnp.uint8), jnp.ones((2, 16), bool)))
    print("replay of own routes bit-identical:", bool((same.logits == live.logits).all()))
    forced = (live.routes + cfg.top_k) % cfg.num_experts
    other = fwd(state, tokens, positions, Replay(forced, jnp.ones((2, 16), bool)))
    print("forced routes used exactly:", bool((other.routes == forced).all()),
          f"| max |Δlogit| = {float(jnp.abs(other.logits - live.logits).max()):.3g}",
          f"| live top-k disagreement with forced = {float(np.mean(other.live_routes != forced)):.2f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m r3jax {demo,serve} [options]")
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        _showcase()
    elif cmd == "serve":
        from r3jax.serve.server import main as serve_main
        serve_main(rest)
    else:
        raise SystemExit(f"unknown command {cmd!r}: expected 'demo' or 'serve'")


if __name__ == "__main__":
    main()
