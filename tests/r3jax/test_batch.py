"""collate: alignment of every field with absolute token positions, padded and packed layouts,
route_mask on padding and the terminal gap, batch-dim padding, rejections, and segment isolation
through the real model."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer, Replay
from r3jax.batch import Batch, collate, fill_ratio, mask_stale, pack_rows

E, L, K = 8, 2, 2


def _traj(n, seed, uncaptured=1):
    """A trajectory of n tokens whose last `uncaptured` rows are the terminal gap."""
    rng = np.random.default_rng(seed)
    routes = np.argsort(rng.random((n, L, E)), axis=-1)[..., :K].astype(np.int32)  # distinct ids
    routes[n - uncaptured:] = 7  # garbage in the gap: must not reach the batch
    loss = np.zeros(n, np.float32)
    loss[n // 2:] = 1
    return {"tokens": rng.integers(1, 200, n), "loss_mask": loss,
            "rollout_logprobs": np.where(loss > 0, -rng.random(n), 0).astype(np.float32),
            "advantage": float(seed) - 1.5, "routes": routes,
            "captured": np.arange(n) < n - uncaptured}


TRAJS = [_traj(5, 1), _traj(7, 2), _traj(3, 3, uncaptured=0)]



def test_bf16_loss_mask_logprobs_and_advantage_are_real_values():
    """bfloat16 (an ml_dtypes type, which np.issubdtype calls no number) is accepted where floats are."""
    bf16 = [{**t, "loss_mask": t["loss_mask"].astype(jnp.bfloat16),
             "rollout_logprobs": t["rollout_logprobs"].astype(jnp.bfloat16),
             "advantage": np.asarray(t["advantage"], jnp.bfloat16)} for t in TRAJS]
    got = collate(bf16, buckets=(8,), num_experts=E, top_k=K, num_layers=L)
    want = collate([{**t, "rollout_logprobs": t["rollout_logprobs"].astype(jnp.bfloat16).astype(np.float32)}
                    for t in TRAJS], buckets=(8,), num_experts=E, top_k=K, num_layers=L)
    for name in ("loss_mask", "rollout_logprobs", "advantages", "routes", "route_mask"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def _check_segment(batch, row, offset, traj):
    n = len(traj["tokens"])
    span = slice(offset, offset + n)
    np.testing.assert_array_equal(batch.tokens[row, span], traj["tokens"])
    np.testing.assert_array_equal(batch.positions[row, span], np.arange(n))
    np.testing.assert_array_equal(batch.loss_mask[row, span], traj["loss_mask"])
    np.testing.assert_array_equal(batch.rollout_logprobs[row, span], traj["rollout_logprobs"])
    np.testing.assert_array_equal(batch.advantages[row, span], traj["advantage"])
    np.testing.assert_array_equal(batch.route_mask[row, span], traj["captured"])
    cap = traj["captured"]
    np.testing.assert_array_equal(batch.routes[row, span][cap], traj["routes"][cap])  # row i <-> token i
    np.testing.assert_array_equal(batch.routes[row, span][~cap], np.broadcast_to(np.arange(K), (L, K))[None]
                                  .repeat((~cap).sum(), 0))
    assert batch.loss_mask[row, offset] == 0  # a segment's first token is never a target


def test_padded_layout_alignment_and_masks():
    batch = collate(TRAJS, buckets=(4, 8, 16), num_experts=E, top_k=K, num_layers=L)
    assert isinstance(batch, Batch) and batch.tokens.shape == (3, 8)
    assert batch.routes.shape == (3, 8, L, K) and batch.routes.dtype == np.uint8
    assert batch.tokens.dtype == np.int32 and batch.route_mask.dtype == bool
    for r, t in enumerate(TRAJS):
        _check_segment(batch, r, 0, t)
    lengths = [5, 7, 3]
    for r, n in enumerate(lengths):
        np.testing.assert_array_equal(batch.segment_ids[r], [1] * n + [0] * (8 - n))
        np.testing.assert_array_equal(batch.attention_mask[r], batch.segment_ids[r] > 0)
        assert not batch.route_mask[r, n:].any() and not batch.loss_mask[r, n:].any()
        assert (batch.tokens[r, n:] == 0).all() and (batch.advantages[r, n:] == 0).all()
    # The terminal gap: the last row of trajectories 0 and 1 is False, trajectory 2 has no gap.
    assert batch.route_mask.sum(1).tolist() == [4, 6, 3]
    assert fill_ratio(batch) == pytest.approx(15 / 24)


def test_packed_layout_alignment_and_fill_ratio():
    assert pack_rows([5, 7, 3], 8) == [[1], [0, 2]]  # first-fit decreasing
    batch = collate(TRAJS, seq_len=8, packed=True, num_experts=E, top_k=K, num_layers=L)
    assert batch.tokens.shape == (2, 8)
    _check_segment(batch, 0, 0, TRAJS[1])
    _check_segment(batch, 1, 0, TRAJS[0])
    _check_segment(batch, 1, 5, TRAJS[2])
    np.testing.assert_array_equal(batch.segment_ids, [[1] * 7 + [0], [1] * 5 + [2] * 3])
    np.testing.assert_array_equal(batch.positions[1], [0, 1, 2, 3, 4, 0, 1, 2])
    assert fill_ratio(batch) == pytest.approx(15 / 16)


def test_batch_multiple_adds_all_padding_rows():
    batch = collate(TRAJS, buckets=(8,), num_experts=300, top_k=K, num_layers=L, batch_multiple=4)
    assert batch.tokens.shape == (4, 8) and batch.routes.dtype == np.int16
    assert not batch.attention_mask[3].any() and not batch.route_mask[3].any()
    assert (batch.segment_ids[3] == 0).all() and (batch.loss_mask[3] == 0).all()
    np.testing.assert_array_equal(batch.routes[3], np.broadcast_to(np.arange(K), (8, L, K)))


@pytest.mark.parametrize("change,kwargs,message", [
    ({"loss_mask": np.r_[1, np.zeros(4)]}, {}, r"trajectories\[0\].loss_mask\[0\]=1.0: expected 0"),
    ({"routes": np.zeros((5, 3, K), np.int32)}, {}, r"trajectories\[0\].routes shape=\(5, 3, 2\): "
                                                    r"expected \[N, L, K\] = \(5, 2, 2\)"),
    ({"captured": np.ones(5, np.int32)}, {}, r"trajectories\[0\].captured dtype=int32: expected bool"),
    ({"rollout_logprobs": np.zeros(4)}, {}, r"rollout_logprobs shape=\(4,\): expected \[N\] = \(5,\)"),
    ({"advantage": float("nan")}, {}, r"trajectories\[0\].advantage=nan: expected a finite float"),
    ({"tokens": np.array([1, 2, -3, 4, 5])}, {}, r"tokens has id -3: expected ids in \[0, 2\*\*31\)"),
    ({}, {"seq_len": 6}, r"seq_len=6: expected an int >= the longest trajectory \(trajectories\[1\] has 7"),
    ({}, {"buckets": (4,)}, "longest trajectory has 7 tokens: expected <= the largest bucket 4"),
])
def test_collate_rejections(change, kwargs, message):
    trajs = [{**TRAJS[0], **change}] + TRAJS[1:]
    with pytest.raises(ValueError, match=message):
        collate(trajs, num_experts=E, top_k=K, num_layers=L, **{"buckets": (8,), **kwargs})


def test_collate_checks_ids_only_on_captured_rows():
    bad = {**TRAJS[0], "routes": TRAJS[0]["routes"].copy()}
    bad["routes"][0, 0, 0] = E
    with pytest.raises(ValueError, match=re.escape("trajectories[0].routes (token 0, layer 0): expert id 8 at "
                                                   "slot 0: expected ids >= 0 and < num_experts=8")):
        collate([bad], buckets=(8,), num_experts=E, top_k=K, num_layers=L)
    gap = {**TRAJS[0], "routes": TRAJS[0]["routes"].copy()}
    gap["routes"][4] = 200  # uncaptured: ignored, replaced by 0..K-1
    batch = collate([gap], buckets=(8,), num_experts=E, top_k=K, num_layers=L)
    np.testing.assert_array_equal(batch.routes[0, 4], [[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="has no field 'advantage'"):
        collate([{k: v for k, v in TRAJS[0].items() if k != "advantage"}], num_experts=E, top_k=K,
                num_layers=L)
    with pytest.raises(ValueError, match="trajectories is empty"):
        collate([], num_experts=E, top_k=K, num_layers=L)


@pytest.mark.parametrize("packed", [False, True])
def test_collate_refuses_bad_replay_ids_naming_trajectory_token_layer_value(packed):
    """A replayed [3, 3] would become top-1 with a doubled gate; ids >= E, bool and float ids are not
    expert ids. Each is refused in both layouts, naming trajectory, token, layer and value."""
    def with_routes(change):
        routes = TRAJS[1]["routes"].copy()
        change(routes)
        return [TRAJS[0], {**TRAJS[1], "routes": routes}, TRAJS[2]]

    kw = dict(buckets=(8,), packed=packed, num_experts=E, top_k=K, num_layers=L)
    cases = [(lambda r: r.__setitem__((4, 1), [3, 3]), "trajectories[1].routes (token 4, layer 1)=[3, 3]: "
              "expert id 3 repeated; expected K distinct expert ids per (token, layer)", [3, 3]),
             (lambda r: r.__setitem__((2, 0, 1), E), "trajectories[1].routes (token 2, layer 0): expert id 8 "
              "at slot 1: expected ids >= 0 and < num_experts=8", E)]
    for change, message, value in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            collate(with_routes(change), **kw)
        assert err.value.field == "trajectories[1].routes" and err.value.value == value
    for dtype in (bool, np.float32):
        trajs = [TRAJS[0], {**TRAJS[1], "routes": TRAJS[1]["routes"].astype(dtype)}, TRAJS[2]]
        with pytest.raises(ValueError, match=re.escape(f"trajectories[1].routes.dtype='{np.dtype(dtype)}': "
                                                       "expected an integer dtype (not bool or float)")):
            collate(trajs, **kw)


def test_packed_segments_do_not_attend_across_and_replay_aligns():
    """The same trajectories through the model, packed and padded, give the same logits and replay
    the same routes at every real token."""
    cfg = MoeConfig.tiny()
    assert (cfg.num_experts, cfg.top_k, cfg.num_moe_layers) == (E, K, L)
    graphdef, state = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(0)))

    @jax.jit
    def forward(state, b):
        out = nnx.merge(graphdef, state)(b.tokens, b.positions, Replay(b.routes, b.route_mask),
                                         segment_ids=b.segment_ids, token_mask=b.attention_mask)
        return out.logits, out.routes

    padded = collate(TRAJS, seq_len=8, num_experts=E, top_k=K, num_layers=L)
    # batch_multiple=3 gives both layouts the shape [3, 8]: one compilation.
    packed = collate(TRAJS, seq_len=8, packed=True, num_experts=E, top_k=K, num_layers=L,
                     batch_multiple=3)
    pad_logits, pad_routes = forward(state, jax.tree_util.tree_map(jnp.asarray, padded))
    pk_logits, pk_routes = forward(state, jax.tree_util.tree_map(jnp.asarray, packed))
    for pad_row, ((row, off), t) in enumerate(zip([(1, 0), (0, 0), (1, 5)], TRAJS)):
        n = len(t["tokens"])
        np.testing.assert_allclose(pk_logits[row, off:off + n], pad_logits[pad_row, :n], atol=2e-5)
        cap = t["captured"]
        np.testing.assert_array_equal(np.asarray(pk_routes[row, off:off + n])[cap], t["routes"][cap])


@pytest.mark.parametrize("packed", [False, True])
def test_token_versions_reach_the_batch_and_the_staleness_bound_masks_and_counts(packed):
    """collate puts each trajectory's token_versions where its tokens go (-1 on padding and for a
    trajectory that has none); mask_stale zeroes the loss of tokens sampled more than max_staleness
    versions ago, keeps unknown (-1) ones, and says how many it took out."""
    a, b, c = _traj(7, 0), _traj(9, 1), _traj(5, 2)
    a["token_versions"] = np.where(a["loss_mask"] > 0, 3, -1).astype(np.int32)
    b["token_versions"] = np.where(b["loss_mask"] > 0, np.arange(9) % 2 + 5, -1).astype(np.int32)  # 5 and 6
    batch = collate([a, b, c], seq_len=32, packed=packed, num_experts=E, top_k=K, num_layers=L)
    seg, tv = np.asarray(batch.segment_ids), np.asarray(batch.token_versions)
    wants = [t.get("token_versions", np.full(len(t["tokens"]), -1)) for t in (a, b, c)]
    if packed:  # rows hold several trajectories: the same values, each beside its own tokens
        toks = np.asarray(batch.tokens)
        for t, want in zip((a, b, c), wants):
            for r in range(toks.shape[0]):
                hit = [i for i in range(toks.shape[1] - len(want) + 1)
                       if (toks[r, i:i + len(want)] == t["tokens"]).all() and seg[r, i] > 0]
                if hit:
                    np.testing.assert_array_equal(tv[r, hit[0]:hit[0] + len(want)], want)
                    break
            else:
                pytest.fail("trajectory not found in the packed batch")
    else:
        for j, want in enumerate(wants):
            np.testing.assert_array_equal(tv[j, :len(want)], want)
    assert (tv[seg == 0] == -1).all()
    masked, n = mask_stale(batch, current_version=6, max_staleness=1)  # versions 5, 6 kept; 3 is 3 behind
    loss, new = np.asarray(batch.loss_mask), np.asarray(masked.loss_mask)
    tv = np.asarray(batch.token_versions)
    assert n == int(((tv == 3) & (loss > 0)).sum()) > 0
    np.testing.assert_array_equal(new, np.where(tv == 3, 0, loss))
    assert mask_stale(batch, current_version=6, max_staleness=3)[1] == 0
    none = collate([c], seq_len=32, num_experts=E, top_k=K, num_layers=L)
    assert (np.asarray(none.token_versions) == -1).all() and mask_stale(none, 9, 0)[1] == 0
    with pytest.raises(ValueError, match="max_staleness"):
        mask_stale(batch, 6, -1)
