"""R2 (``replay="trainer"``): the trainer records its own routes on the pre-update policy and replays
them unchanged in every later minibatch update, however the router has moved since.

The batch's "rollout" routes are set to the recorded ones, so ``live_routing_disagreement`` shows
whether the router itself would have chosen otherwise, and R3 on that batch (replaying the same
routes through batch.routes) must score exactly like R2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from r3jax.train import (eval_step, init_train_state, ppo_update, record_trainer_routes, train_step)


def _scalars(m):
    return {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}


def _permute_router(state):
    """The same state with every router's expert columns reversed: live routes change everywhere."""
    def flip(path, x):
        return x[..., ::-1] if "router" in jax.tree_util.keystr(path) else x
    return state.replace(params=jax.tree_util.tree_map_with_path(flip, state.params))


@pytest.fixture(scope="module")
def recorded(tiny, rollout_batch, tx):
    cfg, model = tiny
    state = init_train_state(model, tx)
    routes = record_trainer_routes(state, rollout_batch)
    real = np.asarray(rollout_batch.segment_ids) > 0
    batch = rollout_batch.replace(routes=jnp.asarray(routes).astype(rollout_batch.routes.dtype),
                                  route_mask=jnp.asarray(real))
    return state, np.asarray(routes), batch


def test_record_is_the_pre_update_live_forward(tiny, rollout_batch, recorded):
    cfg, model = tiny
    state, routes, _ = recorded
    b = rollout_batch
    out = state.model()(b.tokens, b.positions, segment_ids=b.segment_ids)
    real = np.asarray(b.segment_ids) > 0
    assert routes.shape == tuple(b.routes.shape) and routes.dtype == np.int32
    np.testing.assert_array_equal(routes[real], np.asarray(out.live_routes)[real])


def test_changed_router_does_not_change_replayed_experts(tiny, recorded, tx):
    cfg, model = tiny
    state0, routes, batch = recorded
    state = init_train_state(model, tx)
    state, m1 = train_step(state, batch, replay="trainer", trainer_routes=routes)  # update 1
    m1 = _scalars(m1)
    assert m1["live_routing_disagreement"] == 0.0  # pre-update = live
    state = _permute_router(state)  # the router after update 1 is now another router
    live = _scalars(eval_step(state, batch, replay="none"))
    assert live["live_routing_disagreement"] > 0.5, live  # live routing would now pick other experts
    r3 = _scalars(eval_step(state, batch, replay="rollout"))  # the recorded experts, forced via batch.routes
    state, m2 = train_step(state, batch, replay="trainer", trainer_routes=routes)  # update 2
    m2 = _scalars(m2)
    # update 2 still uses exactly the recorded experts: it scores like R3 on them, not like live routing
    for k in ("pg_loss", "mean_abs_delta"):
        assert m2[k] == pytest.approx(r3[k], rel=1e-5, abs=1e-9), k
        assert abs(live[k] - r3[k]) > 1e3 * abs(m2[k] - r3[k]) + 1e-6, (k, live[k], r3[k])
    assert m2["live_routing_disagreement"] == live["live_routing_disagreement"]
    assert m2["num_targets"] == live["num_targets"] > 0


def test_ppo_update_replays_the_pre_update_record_in_every_minibatch(tiny, recorded):
    cfg, model = tiny
    _, routes, batch = recorded
    # a large step so the router really moves between the two minibatch updates
    state = init_train_state(model, optax.sgd(300.0))
    state, hist = ppo_update(state, batch, replay="trainer", num_minibatches=2, epochs=2)
    hist = [_scalars(m) for m in hist]
    assert len(hist) == 4
    assert hist[0]["live_routing_disagreement"] == 0.0  # update 1 runs on the policy that recorded
    assert max(m["live_routing_disagreement"] for m in hist[1:]) > 0.0, hist  # the router moved


def test_trainer_mode_needs_trainer_routes(tiny, rollout_batch, tx):
    cfg, model = tiny
    state = init_train_state(model, tx)
    with pytest.raises(ValueError, match=r"replay='trainer' with trainer_routes=None: expected trainer_routes"):
        eval_step(state, rollout_batch, replay="trainer")
    with pytest.raises(ValueError, match=r"replay='rollout' with trainer_routes=given"):
        eval_step(state, rollout_batch, replay="rollout", trainer_routes=np.zeros((4, 32, 2, 2), np.int32))
    with pytest.raises(ValueError, match=r"trainer_routes shape=\(4, 31, 2, 2\): expected \[B, S, L, K\]"):
        eval_step(state, rollout_batch, replay="trainer", trainer_routes=np.zeros((4, 31, 2, 2), np.int32))
    with pytest.raises(ValueError, match=r"num_minibatches=3: expected a divisor of the batch size B=4"):
        ppo_update(state, rollout_batch, replay="none", num_minibatches=3)
