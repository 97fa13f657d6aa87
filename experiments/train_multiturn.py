"""The main job, kept under its old name: ``python -m experiments.train_multiturn`` is
``python -m r3jax demo`` (the code lives in ``r3jax.demo``)."""

from r3jax.demo import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    main()
