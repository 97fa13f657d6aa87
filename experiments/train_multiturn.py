"""``python -m experiments.train_multiturn [demo flags]``: runs ``python -m r3jax demo`` (same flags,
code in ``r3jax.demo``) and publishes its result as ``experiments/results/demo_summary.json`` and
``demo.png``, recording the commit that produced them (``experiments.common.write_json``)."""

import shutil
import sys
from pathlib import Path

from r3jax.demo import main, parse_args

__all__ = ["main", "parse_args", "publish"]


def publish(argv=None) -> Path:
    """Run the demo with ``argv`` (default: the command line) and copy its summary and plot to
    experiments/results; returns the JSON path."""
    from experiments.common import RESULTS, write_json

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    summary = main(argv)
    settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
    path = write_json("demo_summary", {"settings": settings, **summary})
    shutil.copyfile(Path(args.out) / "demo.png", RESULTS / "demo.png")
    print(f"wrote {path} and {RESULTS / 'demo.png'}")
    return path


if __name__ == "__main__":
    publish()
