"""Prefill-row buckets and how many prompt chunks a step takes (r3jax/engine/programs.py,
Engine.prefill_rows_for), and a batch of prompts prefilled in one step of the largest bucket."""

import numpy as np
import pytest

from r3jax.engine import Engine, GenerateRequest
from r3jax.engine import programs
from r3jax.engine.programs import fill, prefill_buckets

from tests.r3jax.engine.conftest import ENGINE_KW


@pytest.mark.parametrize("rows, want", [(1, [0, 1]), (2, [0, 2]), (4, [0, 4]), (5, [0, 4, 5]), (16, [0, 4, 16]),
                                        (64, [0, 4, 16, 64]), (100, [0, 4, 16, 64, 100])])
def test_prefill_buckets_are_powers_of_four_up_to_prefill_rows(rows, want):
    assert prefill_buckets(rows) == want


def test_fill_takes_every_ready_chunk_unless_its_bucket_pads_more_than_a_third():
    sizes = [0, 4, 16]
    got = {n: fill(n, sizes) for n in range(0, 21)}
    # 1-3: no bucket below, so all (padded to 4); 5-11 would pad 16 by more than a third: 4 now;
    # 12-16 fill 16 well enough; past 16: the largest bucket
    assert got == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, **{n: 4 for n in range(5, 12)}, **{n: n for n in range(12, 17)},
                   17: 16, 18: 16, 19: 16, 20: 16}
    assert [fill(n, [0, 2]) for n in range(5)] == [0, 1, 2, 2, 2]


def test_prefill_rows_for_takes_more_than_four_rows_only_for_that_many_prompts(tiny_model):
    eng = Engine(tiny_model, **{**ENGINE_KW, "prefill_rows": 16})  # nothing compiled: no request
    try:
        assert eng.prefill_rows_for(ready=40, prompts=1) == 4  # one long prompt: 4 rows a step
        assert eng.prefill_rows_for(ready=40, prompts=3) == 4
        assert eng.prefill_rows_for(ready=2, prompts=2) == 2
        assert eng.prefill_rows_for(ready=40, prompts=8) == 4  # 8 of 16 rows: two steps of 4
        assert eng.prefill_rows_for(ready=13, prompts=13) == 13
        assert eng.prefill_rows_for(ready=40, prompts=30) == 16
    finally:
        eng.close()
    small = Engine(tiny_model, **ENGINE_KW)  # prefill_rows=2
    try:
        assert [small.prefill_rows_for(ready=r, prompts=1) for r in (1, 2, 9)] == [1, 2, 2]
    finally:
        small.close()


def test_a_batch_of_prompts_is_prefilled_in_one_step_and_answers_as_in_steps_of_four(tiny_model):
    """12 prompts of one chunk each, submitted together: an engine of prefill_rows=16 prefills them in
    one step (bucket 16), one of prefill_rows=4 in three; tokens, logprobs and route rows are equal."""
    kw = {**ENGINE_KW, "max_batch_size": 12, "num_pages": 1 + 12 * 8, "prefix_cache_bytes": 0}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny_model.config.vocab_size, int(n)).tolist() for n in rng.integers(20, 33, 12)]
    reqs = [GenerateRequest(prompt_ids=p, max_tokens=1, temperature=0.0, return_routed_experts=True,
                            return_logprobs=True) for p in prompts]
    outs, steps = {}, {}
    for rows in (16, 4):
        eng = Engine(tiny_model, **{**kw, "prefill_rows": rows})
        try:
            outs[rows] = eng.generate(reqs)
            steps[rows] = eng.stats["steps"]
        finally:
            eng.close()
    assert steps == {16: 1, 4: 3}
    for a, b in zip(outs[16], outs[4]):
        assert a.output_ids == b.output_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch, rows, buckets", [(64, 16, [0, 4, 16]), (16, 16, [0, 4, 16]), (12, 16, [0, 4, 16]),
                                                 (11, 4, [0, 4]), (8, 4, [0, 4]), (1, 4, [0, 4])])
def test_the_default_is_16_rows_from_12_requests_else_4_and_the_server_says_so(tiny_model, batch, rows, buckets):
    """No 16-row prefill program in an engine that never runs 12 prompts at once (the fewest that take
    16 rows), and no intermediate bucket: 4 rows, what one long prompt takes a step."""
    from r3jax.serve.server import ENGINE_DEFAULT_PREFILL_ROWS

    kw = {k: v for k, v in ENGINE_KW.items() if k != "prefill_rows"}
    eng = Engine(tiny_model, **{**kw, "max_batch_size": batch})  # nothing compiled
    try:
        assert ENGINE_DEFAULT_PREFILL_ROWS == programs.DEFAULT_PREFILL_ROWS == 16
        assert eng.prefill_rows == programs.default_prefill_rows(batch) == rows
        assert eng.max_num_batched_tokens == batch + rows * ENGINE_KW["prefill_chunk"]
        assert sorted({lay.prefill_rows for lay in eng.layouts()}) == buckets
    finally:
        eng.close()
