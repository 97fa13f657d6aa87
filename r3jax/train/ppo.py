"""PPO-style updates: several minibatch optimizer steps per rollout batch, in any replay mode.

``ppo_update(state, batch, replay=..., num_minibatches=n)`` splits the batch's rows into n
minibatches (``epochs`` passes over them) and runs one ``train_step`` per minibatch. With
``replay="trainer"`` (R2) the routes are recorded once, on the pre-update policy, before the first
update, and every update replays its rows of that record unchanged, however far the router has
moved since. ``"rollout"`` (R3) replays the rollout's routes in every update; ``"none"`` routes live.
With ``LossConfig.tis_cap`` the trainer's logprobs are likewise recorded once on the pre-update
policy (:func:`record_old_logprobs`, in the update's replay mode), so every update's clipped ratio is
taken against π_old and its importance weight is ``min(π_old / π_rollout, C)``.
"""

from __future__ import annotations

import jax

from r3jax.train.loss import LossConfig
from r3jax.train.state import TrainState
from r3jax.train.step import REPLAY_MODES, record_old_logprobs, record_trainer_routes, train_step


def _rows(tree, lo: int, hi: int):
    return jax.tree.map(lambda x: x[lo:hi], tree)


def ppo_update(state: TrainState, batch, *, replay: str, config: LossConfig = LossConfig(),
               num_minibatches: int = 1, epochs: int = 1, ref_logprobs=None,
               trainer_routes=None, old_logprobs=None) -> tuple[TrainState, list[dict[str, jax.Array]]]:
    """``epochs * num_minibatches`` optimizer steps on ``batch`` [B, S] (B divisible by
    num_minibatches; each minibatch a multiple of the mesh's batch divisor).

    Returns ``(new_state, metrics per update, in order)``; ``state`` is donated. For
    ``replay="trainer"``, ``trainer_routes`` defaults to :func:`record_trainer_routes` of ``state``
    on the whole batch, taken before any update; with ``config.tis_cap`` and more than one update,
    ``old_logprobs`` defaults to :func:`record_old_logprobs` likewise (one update takes its own).
    """
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay={replay!r}: expected one of {REPLAY_MODES}")
    for name, v in (("num_minibatches", num_minibatches), ("epochs", epochs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: expected an int >= 1")
    b = int(batch.tokens.shape[0])
    if b % num_minibatches:
        raise ValueError(f"num_minibatches={num_minibatches}: expected a divisor of the batch size B={b}")
    if replay == "trainer" and trainer_routes is None:
        trainer_routes = record_trainer_routes(state, batch)  # the old policy's routes, once
    if config.corrects and old_logprobs is None and epochs * num_minibatches > 1:
        old_logprobs = record_old_logprobs(state, batch, replay=replay, config=config,
                                           trainer_routes=trainer_routes)  # π_old, once
    size = b // num_minibatches
    history = []
    for _ in range(epochs):
        for lo in range(0, b, size):
            hi = lo + size
            state, metrics = train_step(
                state, _rows(batch, lo, hi), replay=replay, config=config,
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[lo:hi],
                trainer_routes=None if trainer_routes is None else trainer_routes[lo:hi],
                old_logprobs=None if old_logprobs is None else old_logprobs[lo:hi])
            history.append(metrics)
    return state, history
