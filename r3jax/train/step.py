"""The jitted, sharded policy-gradient step with routed-expert replay, and a forward-only eval step.

``train_step(state, batch, replay="rollout")`` (R3) replays ``batch.routes`` where ``batch.route_mask``
is True; ``replay="trainer"`` (R2) replays the routes of the trainer's own forward on the pre-update
policy (``trainer_routes=record_trainer_routes(state, batch)``, recorded once per rollout batch and
passed unchanged to every later minibatch update); ``replay="none"`` routes every token live. All
modes report the same mismatch metrics (r3jax.metrics) against the rollout's routes, so a run
without replay shows what replay would remove.

Batch contract (r3jax.batch.Batch; any pytree with these attributes works), every field indexed by
absolute token i of a row: tokens, positions, segment_ids [B, S] int32 (segment 0 = padding);
attention_mask [B, S] bool; loss_mask, advantages, rollout_logprobs [B, S] f32; routes [B, S, L, K]
compact int; route_mask [B, S] bool.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import Replay, routers
from r3jax import metrics as mm
from r3jax.train import partition
from r3jax.train.logits import forward_stats
from r3jax.train.loss import LossConfig, aux_coefficient, policy_loss
from r3jax.train.model_protocol import route_config
from r3jax.train.state import TrainState, state_shardings

REPLAY_MODES = ("rollout", "trainer", "none")
BATCH_FIELDS = ("tokens", "positions", "segment_ids", "attention_mask", "loss_mask", "advantages",
                "rollout_logprobs", "routes", "route_mask")


def _forward(params, state: TrainState, batch, replay: str, config: LossConfig, trainer_routes):
    """The model's forward in ``replay`` mode: ``(model, out, target stats, captured [B, S])``."""
    model = nnx.merge(state.graphdef, params, state.rest)
    real = batch.segment_ids > 0
    captured = batch.route_mask.astype(bool)
    if replay == "rollout":
        rp, token_mask = Replay(batch.routes, captured), real & captured
    elif replay == "trainer":
        rp, token_mask = Replay(trainer_routes, real), real
    else:
        rp, token_mask = None, real
    # the LM head per chunk of positions (r3jax/train/logits.py): no [B, S, V] f32 logits held
    out, ts = forward_stats(model, batch.tokens, batch.positions, chunk=config.logits_chunk,
                            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                            replay=rp, segment_ids=batch.segment_ids, token_mask=token_mask)
    return model, out, ts, captured


def forward_metrics(params, state: TrainState, batch, replay: str, config: LossConfig, ref_logprobs=None,
                    trainer_routes=None, old_logprobs=None):
    """Loss and metrics of one forward pass (pure; differentiable in ``params``).

    Returns ``(loss, metrics)``. Replay mode "rollout" forces ``batch.routes`` where
    ``batch.route_mask``; the aux loss is taken over real, captured tokens (segment_ids > 0 and
    route_mask), since uncaptured rows stay out of router statistics (DESIGN §4). Mode "trainer"
    forces ``trainer_routes [B, S, L, K]`` on every real token (the trainer recorded them all).
    Mode "none" routes live everywhere. Both take the aux loss over all real tokens.
    ``old_logprobs`` [B, S]: the pre-update trainer logprobs the TIS surrogate's ratio is taken
    against (:class:`LossConfig`), or None.
    """
    model, out, ts, captured = _forward(params, state, batch, replay, config, trainer_routes)
    lp = ts.logprobs  # as sampled
    loss, stats = policy_loss(lp, batch.rollout_logprobs, batch.advantages, batch.loss_mask, config,
                              ref_logprobs, old_logprobs)
    loss = loss + aux_coefficient(config, getattr(model, "config", None)) * out.aux_loss
    # routing is compared through the router's own top-k (live_routes): the used routes are the
    # replayed ids under replay, so they would agree with the rollout's by construction
    metrics = mm.mismatch_metrics(train_logprobs=jax.lax.stop_gradient(lp),
                                  rollout_logprobs=batch.rollout_logprobs, loss_mask=batch.loss_mask,
                                  live_routes=out.live_routes, rollout_routes=batch.routes,
                                  route_mask=captured)
    metrics.update(stats)
    # entropy of the raw distribution at the predicting positions (mm.target_entropy's token set)
    scored = (batch.loss_mask > 0).at[:, 0].set(False)
    metrics["entropy"] = mm.masked_mean(jax.lax.stop_gradient(ts.entropy), scored)
    metrics.update(loss=loss, aux_loss=out.aux_loss,
                   num_targets=jnp.sum((batch.loss_mask > 0).astype(jnp.float32)),
                   expert_load_imbalance=_imbalance(out.expert_load))
    metrics[_LOAD] = out.expert_load  # for the bias update; not a reported metric
    return loss, metrics


_LOAD = "_expert_load"


def _imbalance(load):
    """Mean over MoE layers of max(load) / mean(load) (1 = perfectly balanced) [L, E] -> scalar;
    NaN without MoE layers or when a layer counted no token (nothing to balance is not balance)."""
    if load.shape[0] == 0:
        return jnp.full((), jnp.nan, jnp.float32)
    mean = jnp.mean(load, -1)
    return jnp.mean(jnp.where(mean > 0, jnp.max(load, -1) / jnp.where(mean > 0, mean, 1.0), jnp.nan))


def _train_impl(state: TrainState, batch, ref_logprobs, trainer_routes, old_logprobs, *, replay: str,
                config: LossConfig):
    grad_fn = jax.value_and_grad(forward_metrics, has_aux=True)
    (_, metrics), grads = grad_fn(state.params, state, batch, replay, config, ref_logprobs, trainer_routes,
                                  old_logprobs)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    load = metrics.pop(_LOAD)
    rest = state.rest
    if config.bias_update_rate > 0:
        rest = routers.update_state_biases(rest, load, state.model().moe_layer_ids, config.bias_update_rate)
    rng, _ = jax.random.split(state.rng)
    new = state.replace(params=params, rest=rest, opt_state=opt_state, step=state.step + 1, rng=rng)
    return new, metrics


def _eval_impl(state: TrainState, batch, ref_logprobs, trainer_routes, old_logprobs, *, replay: str,
               config: LossConfig):
    metrics = forward_metrics(state.params, state, batch, replay, config, ref_logprobs, trainer_routes,
                              old_logprobs)[1]
    metrics.pop(_LOAD)
    return metrics


def _logprobs_impl(state: TrainState, batch, ref_logprobs, trainer_routes, old_logprobs, *, replay: str,
                   config: LossConfig):
    return jnp.where(batch.loss_mask > 0, _forward(state.params, state, batch, replay, config, trainer_routes)[2]
                     .logprobs, 0.0)


def _record_impl(state: TrainState, batch):
    model = nnx.merge(state.graphdef, state.params, state.rest)
    out = model(batch.tokens, batch.positions, segment_ids=batch.segment_ids,
                token_mask=batch.segment_ids > 0)
    return out.live_routes


@dataclasses.dataclass(frozen=True)
class _Compiled:
    fn: Callable
    mesh: jax.sharding.Mesh
    batch_sharding: jax.sharding.NamedSharding
    model_config: Any


_CACHE: dict = {}


def _on_mesh(fn: Callable, mesh) -> Callable:
    """``fn`` traced with ``mesh`` in context, so the MoE layers run expert-parallel on it
    (models/expert_parallel.py); an abstract mesh, since ``jax.set_mesh`` is refused inside jit."""
    @functools.wraps(fn)
    def wrapped(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)
    return wrapped


def _compile(kind: str, state: TrainState, mesh, replay: str, config: LossConfig, with_ref: bool,
             with_old: bool) -> _Compiled:
    state_sh = state_shardings(state, mesh)
    bsh, rep = partition.batch_sharding(mesh), partition.replicated(mesh)
    if kind == "record":
        jitted = jax.jit(_on_mesh(_record_impl, mesh), in_shardings=(state_sh, bsh), out_shardings=bsh)
        return _Compiled(jitted, mesh, bsh, route_config(state.model()))
    impl = {"train": _train_impl, "eval": _eval_impl, "logprobs": _logprobs_impl}[kind]
    body = _on_mesh(functools.partial(impl, replay=replay, config=config), mesh)
    with_tr = replay == "trainer"
    # positional extras after (state, batch): [ref_logprobs] [trainer_routes] [old_logprobs]
    def fn(s, b, *extra):
        extra = list(extra)
        ref = extra.pop(0) if with_ref else None
        tr = extra.pop(0) if with_tr else None
        old = extra.pop(0) if with_old else None
        return body(s, b, ref, tr, old)
    in_sh = (state_sh, bsh) + ((bsh,) * (with_ref + with_tr + with_old))
    if kind == "train":
        jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=(state_sh, rep), donate_argnums=0)
    elif kind == "logprobs":
        jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=bsh)
    else:
        jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=rep)
    return _Compiled(jitted, mesh, bsh, route_config(state.model()))


def _lookup(kind: str, state: TrainState, replay: str, config: LossConfig, with_ref: bool,
            with_old: bool = False) -> _Compiled:
    if kind != "record" and replay not in REPLAY_MODES:
        raise ValueError(f"replay={replay!r}: expected one of {REPLAY_MODES}")
    if not isinstance(config, LossConfig):
        raise ValueError(f"config={config!r}: expected a LossConfig")
    if config.kl_coef > 0.0 and not with_ref and kind != "logprobs":
        raise ValueError(f"ref_logprobs=None with LossConfig.kl_coef={config.kl_coef}: expected "
                         "reference logprobs [B, S] (or kl_coef=0)")
    mesh = state.mesh
    # The tree structure carries the graphdef and the optimizer (static fields), so one key covers
    # model, optimizer, mesh and mode; jax.jit then caches per batch shape underneath.
    key = (kind, jax.tree.structure(state), mesh, replay, config, with_ref, with_old)
    if key not in _CACHE:
        _CACHE[key] = _compile(kind, state, mesh, replay, config, with_ref, with_old)
    return _CACHE[key]


def make_train_step(state: TrainState, *, replay: str = "rollout", config: LossConfig = LossConfig(),
                    with_ref: bool = False, with_old: bool = False) -> Callable:
    """The raw jitted step for hot loops: ``fn(state, batch[, ref_logprobs][, trainer_routes]
    [, old_logprobs]) -> (state, metrics)`` (trainer_routes exactly when ``replay="trainer"``).

    Explicit in/out shardings from ``state``'s mesh (params per partition specs, batch along
    data x fsdp x expert, metrics replicated) and ``donate_argnums=0``: the input state is consumed.
    No host-side checks: call :func:`validate_batch` once per batch shape yourself.
    """
    return _lookup("train", state, replay, config, with_ref, with_old).fn


def validate_batch(batch, model_config, mesh) -> None:
    """Host-side shape/dtype checks of a batch against the model config and the mesh.

    Raises ValueError naming the field, its value and the expectation. Checks shapes only (cheap,
    no device transfer); ids in routes are checked by ``models.validate_replay`` if you need it.
    """
    missing = [f for f in BATCH_FIELDS if not hasattr(batch, f)]
    if missing:
        raise ValueError(f"batch is missing fields {missing}: expected {BATCH_FIELDS}")
    shape = tuple(np.shape(batch.tokens))
    if len(shape) != 2:
        raise ValueError(f"batch.tokens shape={shape}: expected [B, S]")
    for f in BATCH_FIELDS[1:-2] + ("route_mask",):
        if tuple(np.shape(getattr(batch, f))) != shape:
            raise ValueError(f"batch.{f} shape={tuple(np.shape(getattr(batch, f)))}: expected [B, S] = {shape}")
    if model_config is not None:
        want = shape + (model_config.num_moe_layers, model_config.top_k)
        if tuple(np.shape(batch.routes)) != want:
            raise ValueError(f"batch.routes shape={tuple(np.shape(batch.routes))}: expected [B, S, L, K] = {want}")
    rdt = np.dtype(batch.routes.dtype)
    if rdt == np.bool_ or not np.issubdtype(rdt, np.integer):
        raise ValueError(f"batch.routes dtype={rdt}: expected an integer dtype")
    div = partition.batch_divisor(mesh)
    if shape[0] % div:
        raise ValueError(f"batch.tokens batch size B={shape[0]}: expected a multiple of data x fsdp x expert = {div}")


def _place(tree, sharding):
    """Move leaves that are not already laid out as ``sharding`` (host arrays, other layouts)."""
    def put(x):
        sh = getattr(x, "sharding", None)
        if sh is not None and sh.is_equivalent_to(sharding, np.ndim(x)):
            return x
        return jax.device_put(x, sharding)
    return jax.tree.map(put, tree)


def _run(kind, state, batch, replay, config, ref_logprobs, trainer_routes=None, old_logprobs=None):
    if (replay == "trainer") != (trainer_routes is not None):
        raise ValueError(f"replay={replay!r} with trainer_routes="
                         f"{'None' if trainer_routes is None else 'given'}: expected trainer_routes = "
                         "record_trainer_routes(state, batch) exactly when replay='trainer'")
    if old_logprobs is not None and not config.corrects:
        raise ValueError("old_logprobs given with LossConfig.tis_cap=None: expected old_logprobs only with "
                         "tis_cap or icepop (the plain surrogate's ratio is taken against the rollout logprobs)")
    c = _lookup(kind, state, replay, config, ref_logprobs is not None, old_logprobs is not None)
    validate_batch(batch, c.model_config, c.mesh)
    for name, x in (("ref_logprobs", ref_logprobs), ("old_logprobs", old_logprobs)):
        if x is not None and tuple(np.shape(x)) != tuple(np.shape(batch.tokens)):
            raise ValueError(f"{name} shape={tuple(np.shape(x))}: expected [B, S] = {tuple(np.shape(batch.tokens))}")
    if trainer_routes is not None and tuple(np.shape(trainer_routes)) != tuple(np.shape(batch.routes)):
        raise ValueError(f"trainer_routes shape={tuple(np.shape(trainer_routes))}: expected [B, S, L, K] = "
                         f"{tuple(np.shape(batch.routes))}")
    args = (state, _place(batch, c.batch_sharding))
    if ref_logprobs is not None:
        args += (_place(ref_logprobs, c.batch_sharding),)
    if trainer_routes is not None:
        args += (_place(trainer_routes, c.batch_sharding),)
    if old_logprobs is not None:
        args += (_place(old_logprobs, c.batch_sharding),)
    return c.fn(*args)


def record_trainer_routes(state: TrainState, batch) -> jax.Array:
    """R2's recording pass: the routes ``[B, S, L, K]`` int32 of the trainer's own live forward on
    ``state`` (the pre-update policy, i.e. the old-logprob pass), for every token of ``batch``.

    Call it once per rollout batch before its first update and pass the result unchanged as
    ``train_step(..., replay="trainer", trainer_routes=...)`` to every minibatch update of that
    batch (slice it along B like the batch). The state is not donated.
    """
    c = _lookup("record", state, "none", LossConfig(), False)
    validate_batch(batch, c.model_config, c.mesh)
    return c.fn(state, _place(batch, c.batch_sharding))


def record_old_logprobs(state: TrainState, batch, *, replay: str, config: LossConfig,
                        trainer_routes=None) -> jax.Array:
    """The pre-update trainer logprobs ``[B, S]`` f32 of ``batch``'s targets (0 off ``loss_mask``)
    under ``replay`` and ``config``'s sampling transform: π_old of the TIS surrogate.

    Call it once per rollout batch before its first update and pass the result (sliced along B like
    the batch) as ``train_step(..., old_logprobs=...)`` to every minibatch update with
    ``LossConfig.tis_cap``, so the clipped ratio measures how far the updates have moved the policy
    from the one that scored the batch (a forward pass, like verl's old-logprob recompute). The
    state is not donated.
    """
    return _run("logprobs", state, batch, replay, config, None, trainer_routes)


def train_step(state: TrainState, batch, *, replay: str = "rollout", config: LossConfig = LossConfig(),
               ref_logprobs=None, trainer_routes=None, old_logprobs=None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step. Returns ``(new_state, metrics)``; ``state`` is donated (do not reuse it).

    replay: "rollout" (R3: replay batch.routes where batch.route_mask), "trainer" (R2: replay
    ``trainer_routes`` [B, S, L, K] from :func:`record_trainer_routes` on every real token; required
    exactly in this mode) or "none" (live routing). old_logprobs [B, S] from
    :func:`record_old_logprobs`, only with ``config.tis_cap`` (None: this step's own, exact on a
    batch's first update).
    metrics (replicated scalars unless noted): loss, pg_loss, aux_loss, clip_fraction,
    importance_weight, grad_norm, num_targets, mean_abs_delta, k3_kl, f2, fallback_fraction,
    live_routing_disagreement, live_routing_disagreement_per_layer [L], live_token_any_disagreement
    (the router's own top-k vs the rollout's, also under replay, where it is what replay overrides;
    see r3jax.metrics.mismatch_metrics), entropy (mean policy entropy at the targets),
    expert_load_imbalance, + kl_ref with a reference. A metric over an empty token set is NaN.
    The compiled program is cached per (mesh, state structure, replay, config, batch shapes).
    """
    return _run("train", state, batch, replay, config, ref_logprobs, trainer_routes, old_logprobs)


def eval_step(state: TrainState, batch, *, replay: str = "rollout", config: LossConfig = LossConfig(),
              ref_logprobs=None, trainer_routes=None, old_logprobs=None) -> dict[str, jax.Array]:
    """Forward-only metrics of ``state`` on ``batch`` (same dict as train_step minus grad_norm).
    The state is not donated."""
    return _run("eval", state, batch, replay, config, ref_logprobs, trainer_routes, old_logprobs)
