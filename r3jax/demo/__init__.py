"""The main job, ``python -m r3jax demo`` (``make demo``): multi-turn RL with routed-expert replay,
end to end, on the package's public API.

Files: ``cli`` (flags, the top-level flow, user-facing errors), ``rollouts`` (the server subprocess or
in-process engine, agent loops, weight sync), ``run`` (warm start and one RL run with checkpoints and
its metrics log), ``report`` (summary table and plots).
"""

from r3jax.demo.cli import main, parse_args

__all__ = ["main", "parse_args"]
