"""Host-side validation: bad requests raise FieldError (a ValueError carrying its field) naming the
field and value, before anything is queued or run; the rules are r3jax.checks'."""

import numpy as np
import pytest

from r3jax.checks import FieldError
from r3jax.engine import Engine, GenerateRequest

MAX_SEQ = 64


def _rejects(engine, match, field=None, **fields):
    before = dict(engine.stats)
    req = GenerateRequest(**{"prompt_ids": [1, 2, 3, 4], **fields})
    with pytest.raises(FieldError, match=match) as err:
        engine.generate([req])
    assert engine.stats == before  # nothing queued, nothing run, no counter moved
    assert err.value.field == "requests[0]." + (field or next(iter(fields)))
    with pytest.raises(FieldError, match=match):
        engine.submit(req)
    assert engine.stats == before


@pytest.mark.parametrize("s, shown", [(-1, "-1"), (5, "5"), (True, "True"), (False, "False"),
                                      (1.0, "1.0"), ("2", "'2'"), (None, "None"), (np.bool_(True), "np.True_")])
def test_prompt_start_outside_0_to_P_or_not_an_int(engine, s, shown):
    _rejects(engine, rf"routed_experts_prompt_start={shown}: expected an int in \[0, P=4\]",
             routed_experts_prompt_start=s)


@pytest.mark.parametrize("s", [0, 2, 4, np.int64(3)])
def test_prompt_start_in_range_is_accepted(s):
    prompt = GenerateRequest(prompt_ids=[1, 2, 3, 4], routed_experts_prompt_start=s).validate(
        vocab_size=272, max_seq_len=MAX_SEQ)
    np.testing.assert_array_equal(prompt, [1, 2, 3, 4])
    assert prompt.dtype == np.int32


def test_empty_prompt(engine):
    _rejects(engine, r"prompt_ids=\[\]: expected at least one token id", prompt_ids=[])
    with pytest.raises(FieldError, match="stop_token_ids has 65 ids: expected at most 64"):
        engine.submit(GenerateRequest(prompt_ids=[1], stop_token_ids=[1] * 65))


@pytest.mark.parametrize("prompt, match", [
    ([1, 272, 3], r"prompt_ids\[1\]=272: expected token ids in \[0, vocab_size=272\)"),
    ([-1], r"prompt_ids\[0\]=-1: expected token ids in \[0, vocab_size=272\)"),
    (np.array([5, 9999]), r"prompt_ids\[1\]=9999: expected token ids"),
    ([1, True], r"prompt_ids\[1\]=True: expected an int token id"),
    ([1, 2.0], r"prompt_ids\[1\]=2.0: expected an int token id"),
    ("abc", r"prompt_ids='abc': expected a sequence of int token ids"),
    (np.array([[1, 2]]), r"prompt_ids: array of dtype int64 and shape \(1, 2\)"),
])
def test_bad_prompt_ids(engine, prompt, match):
    before = dict(engine.stats)
    with pytest.raises(FieldError, match=match) as err:
        engine.generate([GenerateRequest(prompt_ids=prompt)])
    assert err.value.field.startswith("requests[0].prompt_ids") and engine.stats == before


def test_prompt_plus_max_tokens_over_max_seq_len(engine):
    _rejects(engine, r"max_tokens=61: prompt length 4 \+ max_tokens = 65, expected <= max_seq_len=64",
             max_tokens=61)


@pytest.mark.parametrize("value", [0, -3, True, 2.5])
def test_max_tokens_below_one_or_not_int(engine, value):
    _rejects(engine, rf"max_tokens={value!r}: expected an int >= 1", max_tokens=value)


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -0.5, r"temperature=-0.5: expected a finite number in \[0.0, 3.4e38 \(float32's largest\)\]"),
    ("temperature", 1e39, r"temperature=1e\+39: expected a finite number in \[0.0, 3.4e38"),
    ("temperature", float("nan"), r"temperature=nan"),
    ("top_p", 0.0, r"top_p=0.0: expected a finite number in \(0.0, 1.0\]"),
    ("top_p", 1.5, r"top_p=1.5"),
    ("top_k", -1, r"top_k=-1: expected 0 \(off\) or an int in \[1, vocab_size=272\]"),
    ("top_k", 2**31, r"top_k=2147483648: expected 0 \(off\) or an int in \[1, vocab_size=272\]"),
    ("top_k", 273, r"top_k=273"),
    ("seed", -2, r"seed=-2: expected an int in \[0, 18446744073709551615\]"),
    ("seed", 1.5, r"seed=1.5"),
    ("stop_token_ids", [3, 400], r"stop_token_ids\[1\]=400: expected token ids in \[0, vocab_size=272\)"),
    ("return_routed_experts", 1, r"return_routed_experts=1: expected a bool"),
    ("return_logprobs", "yes", r"return_logprobs='yes': expected a bool"),
    ("session_id", 7, r"session_id=7: expected a str or None"),
])
def test_other_fields(engine, field, value, match):
    before = dict(engine.stats)
    with pytest.raises(FieldError, match=match) as err:
        engine.generate([GenerateRequest(**{"prompt_ids": [1, 2, 3, 4], field: value})])
    assert err.value.field.startswith(f"requests[0].{field}") and engine.stats == before


def test_error_names_the_request_and_nothing_runs_for_the_good_ones(engine):
    good = GenerateRequest(prompt_ids=[1, 2], max_tokens=2)
    bad = GenerateRequest(prompt_ids=[1, 2], max_tokens=0)
    before = dict(engine.stats)
    with pytest.raises(FieldError, match=r"^requests\[1\]\.max_tokens=0") as err:
        engine.generate([good, bad])
    assert err.value.field == "requests[1].max_tokens" and err.value.value == 0
    assert engine.stats == before


@pytest.mark.parametrize("requests, match", [
    (GenerateRequest(prompt_ids=[1]), r"requests=GenerateRequest: expected a list of GenerateRequest"),
    ([{"prompt_ids": [1]}], r"requests\[0\]=dict: expected a GenerateRequest"),
])
def test_requests_must_be_a_list_of_requests(engine, requests, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(requests)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_seq_len=1, max_batch_size=2), r"Engine max_seq_len=1: expected an int >= 2"),
    (dict(max_seq_len=64, max_batch_size=0), r"Engine max_batch_size=0: expected an int >= 1"),
    (dict(max_seq_len=64, max_batch_size=2, prefix_cache_bytes=-1), r"Engine prefix_cache_bytes=-1"),
    (dict(max_seq_len=64, max_batch_size=2, moe_impl="sparse"), r"Engine moe_impl='sparse': expected one of 'ragged'"),
])
def test_engine_arguments(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model, **kwargs)
