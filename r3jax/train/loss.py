"""Policy-gradient loss: token logprobs, the clipped surrogate (GRPO/PPO style), optional truncated
importance weights and KL to a reference policy, and group-normalised advantages."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from r3jax.checks import FieldError
from r3jax.metrics import masked_mean


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the token-level policy-gradient loss (hashable: a static jit argument).

    clip_eps / clip_eps_high: the ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``
    (``clip_eps_high=None`` means symmetric). tis_cap: None for the plain surrogate whose ratio is
    taken against the rollout logprobs; a float C switches to truncated importance sampling: the
    surrogate's ratio is taken against the trainer's own (stop-gradient) logprobs and every token
    is weighted by ``min(π_train / π_rollout, C)`` (stop-gradient). icepop: None, or ``(α, β)`` for
    IcePop (arXiv 2510.18855): as TIS, but the weight is ``π_train / π_rollout`` where it lies in
    ``[α, β]`` and 0 outside, so tokens whose training and rollout probabilities disagree too much are
    masked out of the gradient instead of capped (not with tis_cap). kl_coef: weight of the k3 KL to
    a reference policy (needs ``ref_logprobs``). aux_coef: weight of the router load-balancing
    loss; None takes the model config's ``router_aux_loss_coef`` (:func:`aux_coefficient`; a model
    without one needs an explicit aux_coef). bias_update_rate: DeepSeek-V3's
    auxiliary-loss-free balancing for ``sigmoid_bias_grouped`` routers: after each train step every
    MoE layer's ``router_bias`` (selection only, outside the gradient) moves by
    ``rate * sign(mean load - load)`` from that step's ``expert_load`` (under replay: the replayed
    experts over captured tokens); 0 leaves the biases alone.

    temperature, top_k, top_p: the distribution the trainer's logprobs are taken under, to match the
    rollout's ``logprobs_mode``. With the engine's default ``"raw_logprobs"`` keep the defaults
    (1.0, 0, 1.0: plain log_softmax). With ``"processed_logprobs"`` rollouts sampled at temperature T
    (and top-k/top-p) set the same values, so the importance ratio is taken against the distribution
    that actually sampled: the logits are divided by T (as verl and SkyRL do) and, with top_k > 0 or
    top_p < 1, renormalised over the engine's kept set (:func:`r3jax.engine.sampling.filter_logits`
    on the trainer's logits; the target token always counts as kept, so a near-tie at the cut cannot
    make its logprob -inf). The filter sorts the vocabulary at every position: it costs memory.

    logits_chunk: positions whose [B, chunk, V] f32 logits the loss holds at once
    (:func:`r3jax.train.logits.target_stats`: the LM head is applied per chunk under remat, in the
    forward and the backward pass); 0 or None takes the whole [B, S, V] at once (the reference).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    tis_cap: float | None = None
    icepop: tuple[float, float] | None = None
    kl_coef: float = 0.0
    aux_coef: float | None = None
    bias_update_rate: float = 0.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logits_chunk: int | None = 512

    def __post_init__(self):
        real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) and math.isfinite(x)
        t, k, p = self.temperature, self.top_k, self.top_p
        checks = [
            ("clip_eps", 0.0 < self.clip_eps < 1.0, "in (0, 1)"),
            ("clip_eps_high", self.clip_eps_high is None or self.clip_eps_high > 0.0, "None or > 0"),
            ("tis_cap", self.tis_cap is None or self.tis_cap >= 1.0, "None or >= 1"),
            ("icepop", self.icepop is None or (isinstance(self.icepop, tuple) and len(self.icepop) == 2
                                               and all(real(v) for v in self.icepop)
                                               and 0.0 < self.icepop[0] <= 1.0 <= self.icepop[1]),
             "None or a tuple (α, β) with 0 < α <= 1 <= β"),
            ("icepop", self.icepop is None or self.tis_cap is None, "None when tis_cap is set (one correction)"),
            ("kl_coef", self.kl_coef >= 0.0, ">= 0"),
            ("aux_coef", self.aux_coef is None or self.aux_coef >= 0.0, "None or >= 0"),
            ("bias_update_rate", self.bias_update_rate >= 0.0, ">= 0"),
            ("temperature", real(t) and t > 0, "a finite number > 0 (the rollout's sampling temperature)"),
            ("top_k", isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0, "an int >= 0 (0: off)"),
            ("top_p", real(p) and 0 < p <= 1, "a finite number in (0, 1] (1: off)"),
        ]
        lc = self.logits_chunk
        checks.append(("logits_chunk", lc is None or (isinstance(lc, (int, np.integer)) and not isinstance(lc, bool)
                                                      and lc >= 0), "None or an int >= 0 (0 or None: unchunked)"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)!r}: expected {expected}")

    @property
    def corrects(self) -> bool:
        """Whether the loss weighs tokens by π_train / π_rollout (TIS or IcePop): its surrogate ratio is
        then taken against the trainer's own pre-update logprobs (``old_logprobs``)."""
        return self.tis_cap is not None or self.icepop is not None


def aux_coefficient(config: LossConfig, model_config) -> float:
    """The aux-loss weight: ``config.aux_coef`` if set, else ``model_config.router_aux_loss_coef``.

    Raises :class:`r3jax.checks.FieldError` when neither is there (no silent 0: that would switch
    load balancing off without a word).
    """
    if config.aux_coef is not None:
        return config.aux_coef
    coef = getattr(model_config, "router_aux_loss_coef", None)
    if coef is None:
        raise FieldError("LossConfig.aux_coef", None, "a float >= 0 (the model config "
                         f"{type(model_config).__name__} has no router_aux_loss_coef to default to)")
    return float(coef)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> jax.Array:
    """Logprob of every token under the logits of the previous position, processed as the engine's
    sampler does (static arguments; the defaults leave the logits as they are).

    logits [B, S, V], tokens [B, S] int -> [B, S] f32 where row i =
    log softmax(process(logits[i - 1]))[tokens[i]] and row 0 = 0 (nothing predicts the first
    token); process divides by ``temperature`` and, with top_k > 0 or top_p < 1, masks to -inf
    what lies outside the top-k/top-p set (the target always kept; see :class:`LossConfig`). Rows
    that cross a packed-segment boundary are meaningless and must be masked by loss_mask (0 at
    every segment start).
    """
    lg = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:].astype(jnp.int32)
    if temperature != 1.0:  # static: the default program is unchanged
        lg = lg / temperature
    if top_k > 0 or top_p < 1.0:
        lg = _truncate(lg, targets, top_k, top_p)
    picked = jnp.take_along_axis(lg, targets[..., None], axis=-1)[..., 0]
    lp = picked - jax.nn.logsumexp(lg, axis=-1)
    return jnp.pad(lp, ((0, 0), (1, 0)))


def _truncate(lg, targets, top_k: int, top_p: float):
    """``lg`` [B, T, V] with -inf outside the engine's top-k/top-p set of each position (the set
    chosen on stop-gradient values; ``targets`` [B, T] always kept)."""
    from r3jax.engine.sampling import filter_logits  # the engine's rule, so the two sets agree

    b, t, v = lg.shape
    flat = jax.lax.stop_gradient(lg).reshape(b * t, v)
    kept = jnp.isfinite(filter_logits(flat, jnp.full((b * t,), top_k, jnp.int32),
                                      jnp.full((b * t,), top_p, jnp.float32))).reshape(b, t, v)
    kept = kept | (jnp.arange(v) == targets[..., None])
    return jnp.where(kept, lg, -jnp.inf)


def policy_loss(logprobs, rollout_logprobs, advantages, loss_mask, config: LossConfig,
                ref_logprobs=None, old_logprobs=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean clipped surrogate over targets (``loss_mask [B, S]`` > 0).

    logprobs [B, S] (trainer, differentiable), rollout_logprobs [B, S], advantages [B, S],
    ref_logprobs [B, S] or None, old_logprobs [B, S] or None (with ``tis_cap``: the trainer's
    pre-update logprobs; None takes stop_gradient(logprobs), exact on a batch's first update; without
    ``tis_cap`` / ``icepop`` they are not used). Returns ``(loss, stats)`` where loss = pg_loss + kl_coef *
    kl_ref and stats holds pg_loss, clip_fraction (targets where the clipped branch was taken),
    importance_weight (mean weight; 1 without a correction), icepop_masked (the share of targets IcePop
    took out) and kl_ref when used.
    Values at masked-out positions (padding) are zeroed before any exp, so garbage there is inert.
    """
    m = jnp.asarray(loss_mask) > 0
    lp = jnp.where(m, logprobs, 0.0)
    old = jnp.where(m, jnp.asarray(rollout_logprobs, jnp.float32), 0.0)
    adv = jnp.where(m, jnp.asarray(advantages, jnp.float32), 0.0)
    if not config.corrects:
        behaviour, weight = old, jnp.ones_like(lp)
    else:
        behaviour = jax.lax.stop_gradient(lp if old_logprobs is None
                                          else jnp.where(m, jnp.asarray(old_logprobs, jnp.float32), 0.0))
        k = jnp.exp(behaviour - old)  # π_train / π_rollout
        if config.tis_cap is not None:
            weight = jnp.minimum(k, config.tis_cap)
        else:
            lo, hi = config.icepop
            weight = jnp.where((k >= lo) & (k <= hi), k, 0.0)
    ratio = jnp.exp(lp - behaviour)
    high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + high) * adv
    pg_loss = -masked_mean(weight * jnp.minimum(unclipped, clipped), m)
    stats = {
        "pg_loss": pg_loss,
        "clip_fraction": masked_mean((clipped < unclipped).astype(jnp.float32), m),
        "importance_weight": masked_mean(weight, m),
    }
    if config.icepop is not None:
        stats["icepop_masked"] = masked_mean((weight == 0).astype(jnp.float32), m)
    loss = pg_loss
    if config.kl_coef > 0.0:
        log_r = jnp.where(m, jnp.asarray(ref_logprobs, jnp.float32), 0.0) - lp  # log π_ref / π
        stats["kl_ref"] = masked_mean(jnp.expm1(log_r) - log_r, m)
        loss = loss + config.kl_coef * stats["kl_ref"]
    return loss, stats


def group_advantages(rewards, group_ids, *, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages on the host: reward minus its group mean, divided by the group std if scale.

    rewards [N] float, group_ids [N] int (samples of the same prompt share an id) -> [N] float32.
    A group of identical rewards gets advantage 0.
    """
    r = np.asarray(rewards, np.float64)
    g = np.asarray(group_ids)
    if r.ndim != 1:
        raise ValueError(f"rewards shape={r.shape}: expected [N]")
    if g.shape != r.shape:
        raise ValueError(f"group_ids shape={g.shape}: expected {r.shape} (one id per reward)")
    _, inv = np.unique(g, return_inverse=True)
    count = np.bincount(inv)
    mean = np.bincount(inv, weights=r) / count
    centred = r - mean[inv]
    if scale:
        std = np.sqrt(np.bincount(inv, weights=centred ** 2) / count)
        centred = centred / (std[inv] + eps)
    return centred.astype(np.float32)
