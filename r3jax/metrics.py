"""Train–inference mismatch metrics (docs/design.md §6), defined once for the trainer, tests and experiments.

All functions are pure ``jnp`` over ``[B, S]``-indexed arrays (numpy inputs work too) and are safe
inside ``jax.jit``. Values outside a mask never reach a result, even if they are inf or NaN. A
mean over an empty set is NaN (nothing was measured), never 0: a run that captured no routes must not
read as "no disagreement".

Two token sets are used, both derived from the batch contract (row i of every array = absolute
token i; ``loss_mask[i] == 1`` when token i is a loss-active target predicted from the logits at
position i - 1 of the same segment, and 0 at a segment's first token):

- **targets**: positions i with ``loss_mask[i] == 1``. Logprob metrics (Δ) live here.
- **predicting positions**: positions i with ``loss_mask[i + 1] == 1``, i.e. the positions whose
  logits score a loss-active target. The route row at i is what shapes that prediction (DESIGN §4),
  so routing metrics and the fallback fraction are taken over predicting positions; routing
  disagreement additionally requires a captured row (``route_mask[i]``). Because loss_mask is 0 at
  every segment start, shifting by one never crosses into another packed segment.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` over ``mask`` (any shape broadcastable to x); NaN when the mask is empty.

    An empty mask means no data, never a perfect score of 0. Entries outside the mask are replaced
    by 0 before summing, so NaN/inf there cannot leak, and the gradient in ``x`` stays finite (0
    when the mask is empty: the NaN is selected by ``where``, never divided through).
    """
    m = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), jnp.shape(x))
    x = jnp.where(m > 0, jnp.asarray(x, jnp.float32), 0.0)
    count = jnp.sum(m)
    return jnp.where(count > 0, jnp.sum(x * m) / jnp.maximum(count, 1.0), jnp.nan)


def predicting_mask(loss_mask: jax.Array) -> jax.Array:
    """``[B, S]`` bool: True at i when ``loss_mask[i + 1] == 1`` (the logits at i score a target)."""
    lm = jnp.asarray(loss_mask) > 0
    return jnp.concatenate([lm[:, 1:], jnp.zeros_like(lm[:, :1])], axis=1)


def logprob_mismatch(train_logprobs, rollout_logprobs, loss_mask) -> dict[str, jax.Array]:
    """Δ = log π_train(y) − log π_rollout(y) over targets (``loss_mask [B, S]`` > 0).

    train_logprobs, rollout_logprobs [B, S] f32 (row i = logprob of token i). Returns scalars
    ``mean_abs_delta`` = mean |Δ|, ``k3_kl`` = mean(exp(Δ) − 1 − Δ) (the k3 estimator of
    KL(π_rollout ‖ π_train) on rollout samples) and ``f2`` = fraction with |Δ| > ln 2
    (probability ratio outside [1/2, 2]), ``abs_delta_p99`` and ``abs_delta_max`` (the tail of
    |log importance ratio| that a truncated-IS cap or a clip has to absorb; NaN without targets).
    """
    m = jnp.asarray(loss_mask) > 0
    delta = jnp.where(m, jnp.asarray(train_logprobs, jnp.float32)
                      - jnp.asarray(rollout_logprobs, jnp.float32), 0.0)
    return {
        "mean_abs_delta": masked_mean(jnp.abs(delta), m),
        "k3_kl": masked_mean(jnp.expm1(delta) - delta, m),
        "f2": masked_mean((jnp.abs(delta) > LN2).astype(jnp.float32), m),
        "abs_delta_p99": jnp.nanpercentile(jnp.where(m, jnp.abs(delta), jnp.nan), 99.0),
        "abs_delta_max": jnp.where(m.any(), jnp.max(jnp.where(m, jnp.abs(delta), 0.0)), jnp.nan),
    }


def route_set_differs(routes, rollout_routes) -> jax.Array:
    """``[B, S, L]`` bool: the top-k *set* at (token, layer) differs (order within K is ignored).

    routes, rollout_routes [B, S, L, K], any integer dtypes (compact uint8/int16 included).
    """
    a = jnp.sort(jnp.asarray(routes).astype(jnp.int32), axis=-1)
    b = jnp.sort(jnp.asarray(rollout_routes).astype(jnp.int32), axis=-1)
    return jnp.any(a != b, axis=-1)


def routing_disagreement(routes, rollout_routes, route_mask, loss_mask) -> dict[str, jax.Array]:
    """Disagreement between the trainer router's own routes and the rollout's recorded routes.

    routes [B, S, L, K] (the model's ``out.live_routes``), rollout_routes [B, S, L, K], route_mask
    [B, S] bool (a recorded row exists), loss_mask [B, S]. Counted over predicting positions that
    have a recorded row. Returns ``routing_disagreement`` (fraction of (token, MoE layer) pairs
    whose sets differ), ``routing_disagreement_per_layer`` [L] and ``token_any_disagreement``
    (fraction of tokens with at least one differing layer). No such position (nothing captured),
    or no MoE layer, gives NaN: nothing was compared.
    """
    differs = route_set_differs(routes, rollout_routes)  # [B, S, L]
    tok = predicting_mask(loss_mask) & (jnp.asarray(route_mask) > 0)  # [B, S]
    d = differs.astype(jnp.float32)
    count = jnp.sum(tok.astype(jnp.float32))
    per_layer = jnp.sum(jnp.where(tok[..., None], d, 0.0), axis=(0, 1)) / jnp.maximum(count, 1.0)  # [L]
    per_layer = jnp.where(count > 0, per_layer, jnp.nan)
    overall = jnp.mean(per_layer) if d.shape[-1] else jnp.full((), jnp.nan, jnp.float32)
    return {
        "routing_disagreement": overall,
        "routing_disagreement_per_layer": per_layer,
        "token_any_disagreement": masked_mean(jnp.any(differs, axis=-1).astype(jnp.float32), tok),
    }


def fallback_fraction(route_mask, loss_mask) -> jax.Array:
    """Fraction of loss-active targets whose predicting position has no recorded row, i.e. whose
    logits were produced by live routing for lack of a row (route_mask [B, S] bool, loss_mask [B, S]).
    NaN when there is no loss-active target."""
    pred = predicting_mask(loss_mask)
    missing = (~(jnp.asarray(route_mask) > 0)).astype(jnp.float32)
    return masked_mean(missing, pred)


def target_entropy(logits, loss_mask) -> jax.Array:
    """Mean entropy (nats) of the policy's next-token distribution at the targets: the logits at
    i - 1 for every i with ``loss_mask[i] > 0``. logits [B, S, V], loss_mask [B, S] -> scalar."""
    lg = jnp.asarray(logits, jnp.float32)
    logp = jax.nn.log_softmax(lg, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [B, S]: entropy of the prediction made at i
    return masked_mean(ent, predicting_mask(loss_mask))


def mismatch_metrics(*, train_logprobs, rollout_logprobs, loss_mask, live_routes, rollout_routes,
                     route_mask) -> dict[str, jax.Array]:
    """All §6 metrics in one dict; each is NaN when its token set is empty (no data, not a 0).

    ``live_routing_disagreement`` / ``live_routing_disagreement_per_layer`` [L] /
    ``live_token_any_disagreement`` compare the router's own top-k (``live_routes``, the model's
    ``out.live_routes`` [B, S, L, K], also under replay) with the rollout's routes [B, S, L, K]:
    what the trainer would have chosen, i.e. what replay overrides. The routes a replaying trainer
    *used* are the replayed ids wherever a row was captured, so comparing those with the rollout's
    would be 0 by construction; it is not reported. Plus mean_abs_delta, k3_kl, f2
    (:func:`logprob_mismatch`) and fallback_fraction (the loss-active targets routed live for lack
    of a row).
    """
    out = logprob_mismatch(train_logprobs, rollout_logprobs, loss_mask)
    live = routing_disagreement(live_routes, rollout_routes, route_mask, loss_mask)
    out.update({"live_" + k: v for k, v in live.items()})
    out["fallback_fraction"] = fallback_fraction(route_mask, loss_mask)
    return out


# ---- run-level statistics (host side, numpy): seeds, confidence intervals, collapse -------------

# two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30 (beyond: the normal 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def mean_ci95(values) -> tuple[float, float]:
    """``(mean, half-width)`` of the two-sided 95% Student-t confidence interval of the mean of
    ``values`` [n] (one per seed). n = 1 gives half-width nan (no spread to estimate)."""
    import numpy as np

    x = np.asarray(values, np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("values=[]: expected at least one value")
    if x.size == 1:
        return float(x[0]), float("nan")
    t = _T975[x.size - 2] if x.size - 1 <= len(_T975) else 1.96
    return float(x.mean()), float(t * x.std(ddof=1) / np.sqrt(x.size))


def collapse_step(rewards, *, fraction: float = 0.5, patience: int = 5) -> int | None:
    """First index t at which a reward curve [T] collapses, or None: ``rewards[t .. t + patience - 1]``
    all lie below ``fraction`` x the peak reached up to t (a positive peak), i.e. the reward falls
    below half its peak and stays there for at least ``patience`` steps. A dip shorter than
    ``patience`` or a fall at the very end (fewer than ``patience`` steps left) is not a collapse."""
    import numpy as np

    r = np.asarray(rewards, np.float64).reshape(-1)
    if patience < 1:
        raise ValueError(f"patience={patience}: expected >= 1")
    peak = np.maximum.accumulate(r) if r.size else r
    below = (r < fraction * peak) & (peak > 0)
    run = 0
    for t in range(r.size):
        run = run + 1 if below[t] else 0
        if run >= patience:
            return t - patience + 1
    return None
