"""Supervised warm-up (behaviour cloning) on the same TrainState and Batch as the RL step.

Used by the demo to start a random-init model from a few oracle demonstrations, so that RL has a
policy that already speaks the task's format. Routes are live (nothing to replay: demonstrations
were never sampled by the model).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from r3jax.metrics import masked_mean
from r3jax.train.logits import forward_stats
from r3jax.train.state import TrainState


def sft_loss(params, state: TrainState, batch) -> tuple[jax.Array, dict]:
    """Token-mean negative log-likelihood of targets where ``batch.loss_mask > 0``.

    Returns ``(loss, {"nll", "accuracy"})``; accuracy is greedy next-token accuracy on the targets.
    """
    model = nnx.merge(state.graphdef, params, state.rest)
    _, ts = forward_stats(model, batch.tokens, batch.positions, segment_ids=batch.segment_ids,
                          token_mask=batch.attention_mask)  # LM head in chunks (r3jax/train/logits.py)
    mask = batch.loss_mask > 0
    nll = -masked_mean(ts.logprobs, mask)
    hit = (ts.argmax == batch.tokens) & (jnp.arange(batch.tokens.shape[1]) > 0)  # nothing predicts token 0
    acc = masked_mean(hit.astype(jnp.float32), mask)
    return nll, {"nll": nll, "accuracy": acc}


@functools.partial(jax.jit, donate_argnums=0)
def sft_step(state: TrainState, batch) -> tuple[TrainState, dict]:
    """One optimizer step on :func:`sft_loss`. The state is donated; the step counter advances."""
    (_, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(state.params, state, batch)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics
