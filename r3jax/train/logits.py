"""Token logprobs and entropy from hidden states, the LM head applied in sequence chunks.

The loss needs, per position, only a few numbers from the [V] logits: the target's logprob, the
entropy, the argmax. Taking them chunk by chunk under ``jax.checkpoint`` keeps at most
[B, chunk, V] f32 logits alive in the forward pass and again in the backward pass (each chunk's
logits are recomputed there), instead of [B, S, V] f32 (4.2 GB per 8k-token sequence at
DeepSeek-V3's 129k vocabulary). ``chunk=0`` (or None) is the unchunked reference computation.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from r3jax.checks import is_int


class TargetStats(NamedTuple):
    """Per position of a [B, S] token row, indexed by the *target* token i (row 0 = 0: nothing
    predicts the first token), all [B, S]:

    logprobs f32: log p(tokens[i] | < i) under the processed distribution (temperature, top-k,
    top-p: :func:`r3jax.train.loss.token_logprobs`); entropy f32: entropy (nats) of the raw
    (unprocessed) next-token distribution predicting i; argmax int32: that distribution's argmax.
    """

    logprobs: jax.Array
    entropy: jax.Array
    argmax: jax.Array


def head_fn(model: Any) -> Callable[[jax.Array], jax.Array] | None:
    """``model.logits`` when the model can return hidden states (``model(..., return_hidden=True)``
    paired with a ``logits(hidden) -> [.., V]`` method), else None (callers then take full logits)."""
    fn = getattr(model, "logits", None)
    return fn if callable(fn) else None


def check_chunk(chunk) -> None:
    """Raise ValueError unless ``chunk`` is None or an int >= 0 (0 and None: unchunked)."""
    if chunk is not None and not (is_int(chunk) and chunk >= 0):
        raise ValueError(f"logits_chunk={chunk!r}: expected None or an int >= 0 (0 or None: unchunked)")


def _position_stats(lg, targets, temperature, top_k, top_p):
    """lg [B, T, V] f32 logits, targets [B, T] int32 -> (logprob, entropy, argmax) each [B, T]."""
    from r3jax.train.loss import _truncate  # the trainer's processing rule, shared with token_logprobs

    logp_raw = jax.nn.log_softmax(lg, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp_raw) * logp_raw, axis=-1)
    argmax = jnp.argmax(lg, axis=-1).astype(jnp.int32)
    proc = lg
    if temperature != 1.0:  # static: the default program is unchanged
        proc = proc / temperature
    if top_k > 0 or top_p < 1.0:
        proc = _truncate(proc, targets, top_k, top_p)
    if proc is lg:
        picked = jnp.take_along_axis(logp_raw, targets[..., None], axis=-1)[..., 0]
    else:
        picked = (jnp.take_along_axis(proc, targets[..., None], axis=-1)[..., 0]
                  - jax.nn.logsumexp(proc, axis=-1))
    return picked, entropy, argmax


def target_stats(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, tokens: jax.Array, *,
                 chunk: int | None = 512, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> TargetStats:
    """:class:`TargetStats` of ``tokens`` [B, S] int from ``hidden`` [B, S, D] and the LM head
    ``head`` (hidden [B, c, D] -> logits [B, c, V]; e.g. ``model.logits``, or the identity when
    ``hidden`` already holds logits). Differentiable in ``hidden`` and in whatever ``head`` closes
    over (the head weights).

    ``chunk`` > 0: positions are taken ``chunk`` at a time (S padded up to a multiple of it) in a
    ``lax.map`` whose body is ``jax.checkpoint``-ed, so neither pass holds more than [B, chunk, V]
    f32 logits; 0 or None: one [B, S, V] computation (the reference). Static arguments.
    Rows crossing a packed-segment boundary are meaningless: mask them with the loss mask.
    """
    check_chunk(chunk)
    b, s = tokens.shape
    # position t predicts tokens[t + 1]; the last position predicts nothing (its target is a dummy 0)
    targets = jnp.concatenate([tokens[:, 1:].astype(jnp.int32), jnp.zeros((b, 1), jnp.int32)], axis=1)

    def stats(h, tg):
        return _position_stats(head(h).astype(jnp.float32), tg, temperature, top_k, top_p)

    if not chunk or chunk >= s:
        out = stats(hidden, targets)
    else:
        n = -(-s // chunk)
        pad = n * chunk - s
        h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))) if pad else hidden
        tg = jnp.pad(targets, ((0, 0), (0, pad))) if pad else targets
        # [B, n*c, ...] -> [n, B, c, ...]: the batch axis stays where its sharding put it
        h = jnp.moveaxis(h.reshape(b, n, chunk, h.shape[-1]), 1, 0)
        tg = jnp.moveaxis(tg.reshape(b, n, chunk), 1, 0)
        body = jax.checkpoint(lambda xs: stats(*xs))
        out = jax.lax.map(body, (h, tg))
        out = tuple(jnp.moveaxis(o, 0, 1).reshape(b, n * chunk)[:, :s] for o in out)
    # to target indexing: stats of position t belong to token t + 1
    shift = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0)))
    return TargetStats(*(shift(o) for o in out))


def forward_stats(model: Any, tokens, positions, *, chunk: int | None = 512, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, **model_kwargs):
    """Run ``model(tokens, positions, **model_kwargs)`` and take :func:`target_stats` of ``tokens``.

    Returns ``(out, stats)``. A model with a ``logits`` method (:func:`head_fn`) is called with
    ``return_hidden=True`` and its head is applied chunk by chunk; any other model is called as it
    is and its full ``out.logits`` [B, S, V] are processed in chunks (the statistics are the same;
    only the model's own logits tensor stays).
    """
    head = head_fn(model)
    kw = dict(chunk=chunk, temperature=temperature, top_k=top_k, top_p=top_p)
    if head is None:
        out = model(tokens, positions, **model_kwargs)
        return out, target_stats(lambda x: x, out.logits, tokens, **kw)
    out = model(tokens, positions, return_hidden=True, **model_kwargs)
    return out, target_stats(head, out.hidden, tokens, **kw)
