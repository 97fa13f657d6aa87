"""Trace accumulators: immutability, rejections, widening, the §4 finalize check, pytree behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.trace import RoutedExpertTrace, TokenMetadataTrace

L, K = 2, 2


def _rows(n, start=0, dtype=np.uint8):
    """Distinguishable rows: row j holds ids (start + j) and (start + j + 1) in every layer."""
    j = np.arange(start, start + n)
    return np.broadcast_to(np.stack([j, j + 1], -1)[:, None, :], (n, L, K)).astype(dtype)


def _two_turns():
    t0 = RoutedExpertTrace(moe_layer_ids=(1, 2))
    t1 = t0.record(prompt_len=3, generated_len=2, routes=_rows(4))  # rows 0..3 of tokens 0..4
    t2 = t1.record(prompt_len=7, generated_len=2, routes=_rows(4, 4))  # rows 4..7 of tokens 0..8
    return t0, t1, t2


def test_metadata_trace_is_immutable_and_copies_numpy_input():
    a = np.arange(6, dtype=np.int32).reshape(3, 2)
    t0 = TokenMetadataTrace()
    t1 = t0.append(a, 3)
    t2 = t1.append(a[:1] + 10, 1)
    assert (t0.num_rows, t1.num_rows, t2.num_rows) == (0, 3, 4)
    assert t0.chunks == () and len(t1.chunks) == 1
    a[0, 0] = 99  # the caller's array changes; the trace must not
    np.testing.assert_array_equal(t1.finalize(), np.arange(6).reshape(3, 2))
    np.testing.assert_array_equal(t2.finalize()[3], [10, 11])
    with pytest.raises(ValueError, match="read-only"):
        t1.chunks[0][0, 0] = 5


@pytest.mark.parametrize("rows,expected,message", [
    (np.zeros((3, 2), np.int32), 4, "rows has 3 rows: expected 4"),
    (np.array(5, np.int32), 1, r"rows is 0-d \(shape \(\)\)"),
    ([[1, 2]], 1, "rows: got list, expected a numpy or jax array"),
    (np.zeros((1, 2), np.float32), 1, "rows dtype=float32: expected an integer or bool dtype"),
    (np.zeros((1, 2), np.int8), 1, "rows dtype=int8: expected uint8/int16/int32"),
    (np.zeros((1, 2), np.int32), True, "expected_rows=True: expected an int >= 0"),
])
def test_metadata_trace_rejections(rows, expected, message):
    with pytest.raises(ValueError, match=message):
        TokenMetadataTrace().append(rows, expected)


def test_metadata_trace_schema_is_fixed_by_first_chunk():
    t = TokenMetadataTrace().append(np.zeros((2, 3), np.uint8), 2)
    with pytest.raises(ValueError, match=r"rows trailing shape=\(4,\): expected \(3,\)"):
        t.append(np.zeros((1, 4), np.uint8), 1)
    with pytest.raises(ValueError, match="rows dtype=bool: expected an integer dtype"):
        t.append(np.zeros((1, 3), bool), 1)
    with pytest.raises(ValueError, match="no chunks"):
        TokenMetadataTrace().finalize()


def test_metadata_trace_widens_integer_dtypes():
    t = TokenMetadataTrace().append(np.full((2, 1), 200, np.uint8), 2)
    t = t.append(np.full((1, 1), 300, np.int16), 1)
    assert t.dtype == np.int16
    t = t.append(np.full((1, 1), 70000, np.int32), 1)
    out = t.finalize()
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out[:, 0], [200, 200, 300, 70000])


def test_two_turn_scenario_leaves_last_row_uncaptured():
    t0, t1, t2 = _two_turns()
    assert (t0.prompt_start, t1.prompt_start, t2.prompt_start) == (0, 4, 8)
    routes, captured = t2.finalize(token_count=9, loss_mask=np.r_[np.zeros(3), 1, 1, 0, 0, 1, 1])
    assert routes.shape == (9, L, K) and routes.dtype == np.uint8
    np.testing.assert_array_equal(routes[:8], _rows(8))
    np.testing.assert_array_equal(routes[8], [[0, 1], [0, 1]])  # uncaptured rows: 0..K-1
    np.testing.assert_array_equal(captured, [True] * 8 + [False])
    # The earlier trace is unchanged and finalizes on its own.
    r1, c1 = t1.finalize(token_count=5, loss_mask=np.r_[0, 0, 0, 1, 1])
    np.testing.assert_array_equal(r1[:4], _rows(4))
    assert c1.tolist() == [True] * 4 + [False]


def test_finalize_refuses_target_after_gap_and_accepts_one_at_prompt_start():
    _, _, t = _two_turns()
    ok = np.zeros(9)
    ok[8] = 1  # the last sampled token: its logits come from position 7, which has a row
    t.finalize(token_count=9, loss_mask=ok)
    late = np.zeros(10)
    late[9] = 1  # e.g. a synthetic EOS after the last engine call
    with pytest.raises(ValueError, match="missing routed-expert row for loss-active target at token 9"):
        t.finalize(token_count=10, loss_mask=late)
    with pytest.raises(ValueError, match=r"token_count=7: expected >= prompt_start=8"):
        t.finalize(token_count=7, loss_mask=np.zeros(7))
    with pytest.raises(ValueError, match=r"loss_mask shape=\(8,\): expected \[N\] = \(9,\)"):
        t.finalize(token_count=9, loss_mask=np.zeros(8))
    with pytest.raises(ValueError, match="no routes recorded"):
        RoutedExpertTrace().finalize(token_count=0, loss_mask=np.zeros(0))

    # a bf16 mask is numeric (np.issubdtype says it is not); a string mask is refused by name
    late16 = late.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="missing routed-expert row for loss-active target at token 9"):
        t.finalize(token_count=10, loss_mask=late16)
    np.testing.assert_array_equal(t.finalize(token_count=9, loss_mask=ok.astype(jnp.bfloat16))[1],
                                  t.finalize(token_count=9, loss_mask=ok)[1])
    with pytest.raises(ValueError, match="loss_mask dtype=<U1: expected bool or numeric"):
        t.finalize(token_count=9, loss_mask=np.array(list("a" * 9)))


def test_record_rejections():
    _, t1, _ = _two_turns()
    with pytest.raises(ValueError, match=r"prompt_start=4: expected an int in \[0, P=3\]"):
        t1.record(prompt_len=3, generated_len=2, routes=_rows(0))
    with pytest.raises(ValueError, match="generated_len=0: expected an int >= 1"):
        t1.record(prompt_len=7, generated_len=0, routes=_rows(2))
    with pytest.raises(ValueError, match="prompt_len=True: expected an int >= 0"):
        t1.record(prompt_len=True, generated_len=1, routes=_rows(0))
    with pytest.raises(ValueError, match=r"routes has 3 rows: expected prompt_len - prompt_start \+ "
                                         r"generated_len - 1 = 7 - 4 \+ 2 - 1 = 4"):
        t1.record(prompt_len=7, generated_len=2, routes=_rows(3))
    with pytest.raises(ValueError, match=r"routes shape=\(4, 2\): expected an array \[rows, L, K\]"):
        t1.record(prompt_len=7, generated_len=2, routes=_rows(4)[:, 0])
    with pytest.raises(ValueError, match="routes: got list, expected a numpy or jax array"):
        t1.record(prompt_len=7, generated_len=2, routes=_rows(4).tolist())


def test_layer_id_mismatch_is_refused():
    _, t1, _ = _two_turns()
    with pytest.raises(ValueError, match=r"layers=\[1, 3\]: expected moe_layer_ids=\[1, 2\]"):
        t1.record(prompt_len=7, generated_len=2, routes=_rows(4), layers=[1, 3])
    with pytest.raises(ValueError, match=r"routes shape=\(4, 3, 2\): expected L = 2"):
        t1.record(prompt_len=7, generated_len=2, routes=np.zeros((4, 3, 2), np.uint8))
    # A trace without ids adopts the first payload's, then holds later payloads to them.
    t = RoutedExpertTrace().record(prompt_len=2, generated_len=1, routes=_rows(2), layers=(4, 5))
    assert t.moe_layer_ids == (4, 5)
    with pytest.raises(ValueError, match=r"layers=\[4, 6\]"):
        t.record(prompt_len=2, generated_len=2, routes=_rows(1), layers=(4, 6))


def test_widening_when_later_turn_uses_expert_above_255_of_384():
    t = RoutedExpertTrace(moe_layer_ids=(0, 1))
    t = t.record(prompt_len=3, generated_len=2, routes=_rows(4, 250, np.uint8))  # ids 250..254
    big = _rows(4, 290, np.int16)  # ids 290..294: need int16
    t = t.record(prompt_len=7, generated_len=2, routes=big)
    routes, captured = t.finalize(token_count=9, loss_mask=np.zeros(9))
    assert routes.dtype == np.int16
    np.testing.assert_array_equal(routes[:4], _rows(4, 250))
    np.testing.assert_array_equal(routes[4:8], big)
    assert captured.sum() == 8


def test_pytree_tree_map_and_jit():
    _, _, t = _two_turns()
    assert len(jax.tree_util.tree_leaves(t)) == 2
    shifted = jax.tree_util.tree_map(lambda x: x.astype(np.int32) + 1, t)
    assert isinstance(shifted, RoutedExpertTrace) and shifted.moe_layer_ids == (1, 2)
    np.testing.assert_array_equal(shifted.rows.finalize(), _rows(8).astype(np.int32) + 1)

    _, t1, _ = _two_turns()
    step = jax.jit(lambda tr, r: tr.record(prompt_len=7, generated_len=2, routes=r))
    out = step(t1, jnp.asarray(_rows(4, 4)))
    assert isinstance(out.rows.chunks[1], jax.Array) and out.prompt_start == 8
    mask = np.zeros(9)
    np.testing.assert_array_equal(out.finalize(token_count=9, loss_mask=mask)[0],
                                  t.finalize(token_count=9, loss_mask=mask)[0])
    inner = jax.jit(lambda tr: tr.rows.finalize())(t)
    np.testing.assert_array_equal(inner, _rows(8))


def test_record_refuses_bool_routes_and_k_zero():
    """A bool array is not expert ids, and K = 0 cannot be finalized: both refused at record, before
    anything is stored (they used to pass and make finalize fail later)."""
    t0, t1, _ = _two_turns()
    for trace in (t0, t1):
        with pytest.raises(ValueError, match=r"routes dtype=bool: expected an integer dtype") as e:
            trace.record(prompt_len=7, generated_len=2, routes=np.ones((7 - trace.prompt_start + 1, L, K), bool))
        assert e.value.field == "routes.dtype"
    with pytest.raises(ValueError, match=r"routes shape=\(4, 2, 0\): expected an array \[rows, L, K\] with K >= 1"):
        t0.record(prompt_len=3, generated_len=2, routes=np.zeros((4, L, 0), np.uint8))
    with pytest.raises(ValueError, match="routes dtype=bool"):  # also under jit (shapes/dtypes only)
        jax.jit(lambda r: t0.record(prompt_len=3, generated_len=2, routes=r))(jnp.ones((4, L, K), bool))


def test_truncate_keeps_the_first_rows_and_the_schema():
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 8, (n, 2, 2), dtype=np.uint8) for n in (5, 3, 4)]
    trace = RoutedExpertTrace((1, 2))
    for p, g, c in zip((5, 7, 10), (1, 2, 3), chunks):  # rows 5, 3, 4 of calls P - s + G - 1
        trace = trace.record(prompt_len=p, generated_len=g, routes=c)
    every = np.concatenate(chunks)
    for rows in range(0, 13):
        cut = trace.truncate(rows)
        assert cut.prompt_start == rows
        np.testing.assert_array_equal(cut.rows.finalize(), every[:rows])
        assert cut.rows.trailing_shape == (2, 2) and cut.moe_layer_ids == (1, 2)
    assert trace.prompt_start == 12  # unchanged
    # the cut trace records on from there: rows [7, 7 + 4) of a 10-token prompt and 2 generated
    more = rng.integers(0, 8, (4, 2, 2), dtype=np.uint8)
    again = trace.truncate(7).record(prompt_len=10, generated_len=2, routes=more)
    np.testing.assert_array_equal(again.rows.finalize(), np.concatenate([every[:7], more]))
    with pytest.raises(ValueError, match="rows=13: expected <= num_rows=12"):
        trace.truncate(13)
    with pytest.raises(ValueError, match="rows"):
        trace.truncate(-1)


def test_each_row_keeps_the_version_whose_forward_produced_it():
    """Rows ``[s, P)`` come from the first token's version (the prefill that sampled it), the row of
    position ``P + i - 1`` from token i's; a later call never re-stamps earlier rows; truncation keeps
    versions aligned with rows; a call without versions records -1."""
    from r3jax.trace import row_versions

    assert row_versions(5, 2, 4, ((0, 3), (2, 4))).tolist() == [3, 3, 3, 3, 4, 4]
    assert row_versions(5, 5, 1, 7).tolist() == []  # no row: the prompt was captured, one token
    assert row_versions(3, 0, 2, None).tolist() == [-1] * 4
    rows = lambda n: np.zeros((n, 2, 2), np.uint8)  # noqa: E731
    t = RoutedExpertTrace().record(prompt_len=5, generated_len=4, routes=rows(8), versions=((0, 3), (2, 4)))
    t = t.record(prompt_len=12, generated_len=2, routes=rows(5), versions=5)
    assert t.row_versions().tolist() == [3] * 6 + [4, 4] + [5] * 5
    assert t.row_versions(15).tolist() == [3] * 6 + [4, 4] + [5] * 5 + [-1, -1]
    cut = t.truncate(7)
    assert cut.row_versions().tolist() == [3] * 6 + [4]
    again = cut.record(prompt_len=9, generated_len=1, routes=rows(2))
    assert again.row_versions().tolist() == [3] * 6 + [4, -1, -1]
    for bad in (((1, 3),), ((0, 3), (0, 4)), ((0, 3), (4, 4))):
        with pytest.raises(ValueError, match="versions="):
            RoutedExpertTrace().record(prompt_len=5, generated_len=4, routes=rows(8), versions=bad)
    with pytest.raises(ValueError, match="token_count"):
        t.row_versions(3)
