"""MaxText forced-routing hand-off: Batch routes/route_mask ↔ int32 [B, S, L, K] with -1 rows."""

import numpy as np
import pytest

from r3jax import handoff
from r3jax.checks import FieldError
from r3jax.routes import route_dtype

B, S, L, K, E = 2, 6, 3, 8, 384


def _routes(seed=0, hi=E):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(hi)[:K] for _ in range(B * S * L)]).reshape(B, S, L, K)
    return ids.astype(route_dtype(E))


MASK = np.array([[1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1]], bool)


def test_round_trip_and_layout():
    routes = _routes()
    forced = handoff.to_maxtext(routes, MASK)
    assert forced.dtype == np.int32 and forced.shape == (B, S, L, K)
    assert (forced[~MASK] == -1).all()  # every slot of an unset row, not just slot 0
    np.testing.assert_array_equal(forced[MASK], routes[MASK].astype(np.int32))
    back, mask = handoff.from_maxtext(forced, E)
    assert back.dtype == route_dtype(E) and mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, MASK)
    np.testing.assert_array_equal(back[MASK], routes[MASK])
    assert (back[~MASK] == np.arange(K)).all()  # unset rows come back as 0..K-1 (DESIGN §3)


def test_uint8_routes_and_small_e():
    routes = _routes(1, hi=64).astype(np.uint8)
    back, mask = handoff.from_maxtext(handoff.to_maxtext(routes, MASK), 64)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back[MASK], routes[MASK])


def test_batch_and_jax_arrays_stay_on_device():
    import jax.numpy as jnp

    from r3jax.batch import Batch

    routes = _routes(2)
    zeros = np.zeros((B, S), np.float32)
    batch = Batch(tokens=zeros.astype(np.int32), positions=zeros.astype(np.int32), segment_ids=zeros.astype(np.int32),
                  attention_mask=MASK, loss_mask=zeros, advantages=zeros, rollout_logprobs=zeros,
                  routes=jnp.asarray(routes), route_mask=jnp.asarray(MASK))
    forced = handoff.batch_to_maxtext(batch)
    assert not isinstance(forced, np.ndarray) and forced.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(forced), handoff.to_maxtext(routes, MASK))


@pytest.mark.parametrize("routes,mask,field", [
    (np.zeros((B, S, L), np.int16), MASK, "routes.shape"),
    (np.zeros((B, S, L, K), np.int16), MASK[:, :3], "route_mask.shape"),
    (np.zeros((B, S, L, K), np.float32), MASK, "routes.dtype"),
    (np.zeros((B, S, L, K), np.int16), MASK.astype(np.int32), "route_mask.dtype"),
])
def test_to_maxtext_refuses_bad_arrays(routes, mask, field):
    with pytest.raises(FieldError) as info:
        handoff.to_maxtext(routes, mask)
    assert info.value.field == field


def test_from_maxtext_refuses_what_it_cannot_mean():
    forced = handoff.to_maxtext(_routes(3), MASK)
    partial = forced.copy()
    partial[0, 1, 2, 5] = -1
    with pytest.raises(FieldError, match=r"trajectory 0, token 1\) mixes -1"):
        handoff.from_maxtext(partial, E)
    dup = forced.copy()
    dup[1, 2, 0, :2] = 7
    with pytest.raises(FieldError, match=r"trajectory 1, token 2, layer 0\)=.*repeated"):
        handoff.from_maxtext(dup, E)
    high = forced.copy()
    high[0, 0, 1, 3] = E
    with pytest.raises(FieldError, match="num_experts=384"):
        handoff.from_maxtext(high, E)
    neg = forced.copy()
    neg[0, 0] = -2
    with pytest.raises(FieldError, match="expected ids >= 0"):
        handoff.from_maxtext(neg, E)
    with pytest.raises(FieldError, match="dtype"):
        handoff.from_maxtext(forced.astype(np.float32), E)
    with pytest.raises(FieldError, match="num_experts"):
        handoff.from_maxtext(forced, 0)
