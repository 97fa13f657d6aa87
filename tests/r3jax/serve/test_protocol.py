"""Wire codecs without a server: schema (request bodies → GenerateRequest, outputs → JSON) and the
client-side protocol (responses → checked GenerateOutput). Errors carry their field as data, and a
response never gets a field it lacks by default."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from r3jax.checks import FieldError
from r3jax.engine import GenerateOutput, GenerateRequest
from r3jax.routes import encode
from r3jax.serve import protocol, schema
from r3jax.serve.peers import sglang
from r3jax.serve.protocol import ProtocolError, ServedModel, parse_response

INFO = ServedModel(num_experts=8, top_k=2, moe_layer_ids=(1, 2), vocab_size=272)
REQ = GenerateRequest([1, 2, 3], max_tokens=3, return_routed_experts=True, routed_experts_prompt_start=1)
ROWS = np.arange(4 * 4, dtype=np.int32).reshape(4, 2, 2) % 8  # P - s + G - 1 = 3 - 1 + 3 - 1 rows
GOOD = {"output_ids": [1, 2, 3], "logprobs": [-1.0, -2.0, -3.0], "finish_reason": "stop",
        "routed_experts": encode(ROWS, 1, [1, 2]), "prompt_tokens": 3, "cached_tokens": 0, "weight_version": 4}


def _parse(obj):
    return parse_response(json.dumps(obj).encode(), "application/json", REQ, INFO, "test")


@pytest.mark.parametrize("key", ["weight_version", "prompt_tokens", "cached_tokens"])
def test_response_without_a_field_is_refused_not_defaulted(key):
    assert _parse(GOOD).weight_version == 4
    with pytest.raises(ProtocolError, match=f"test: missing field '{key}'") as err:
        _parse({k: v for k, v in GOOD.items() if k != key})
    assert err.value.field == key
    with pytest.raises(ProtocolError, match=f"test.{key}=True: expected an int") as err:
        _parse({**GOOD, key: True})
    assert err.value.field == key


@pytest.mark.parametrize("change,message", [
    (lambda r: r.__setitem__((2, 1), [3, 3]), r"routed_experts (token 2, layer 1)=[3, 3]: expert id 3 repeated"),
    (lambda r: r.__setitem__((0, 0, 1), 8), "routed_experts (token 0, layer 0): expert id 8 at slot 1: expected "
                                            "ids >= 0 and < num_experts=8"),
])
def test_response_routes_with_repeated_or_out_of_range_ids_are_refused(change, message):
    rows = ROWS.copy()
    change(rows)
    with pytest.raises(ProtocolError, match=re.escape(message)) as err:
        # encode refuses such rows itself, so the bad payload is written by hand
        data = base64.b64encode(rows.astype("<i4").tobytes()).decode()
        _parse({**GOOD, "routed_experts": {**GOOD["routed_experts"], "data": data, "dtype": "int32"}})
    assert err.value.field == "routed_experts"


def _sglang(rows, **meta):
    out = [10, 11]
    body = {"output_ids": out, "meta_info": {
        "output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": {"type": "length"},
        "prompt_tokens": 3, "cached_tokens": 0, "weight_version": "7",
        "routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode(), **meta}}
    body["meta_info"] = {k: v for k, v in body["meta_info"].items() if v is not None}
    req = GenerateRequest([1, 2, 3], max_tokens=2, return_routed_experts=True, routed_experts_prompt_start=1)
    return sglang.parse_generate_response(json.dumps(body).encode(), req, num_experts=8, num_layers=2, top_k=2,
                                          vocab_size=272, where="sg")


def test_sglang_weight_version_is_read_never_defaulted():
    rows = np.arange(4 * 4).reshape(4, 2, 2) % 8  # P + G - 1 = 4 rows (a server that ignores the start)
    out = _sglang(rows)
    assert out.weight_version == 7 and out.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(out.routed_experts, rows[1:])
    assert _sglang(rows, weight_version=5).weight_version == 5
    assert _sglang(rows, weight_version="default").weight_version == -1  # SGLang's "never versioned"
    for version, state in ((None, "missing"), ("v2", "'v2'")):
        with pytest.raises(ProtocolError, match=f"meta_info.weight_version is {state}: expected an integer "
                                                "version or 'default' .start SGLang with --weight-version 0") as err:
            _sglang(rows, weight_version=version)
        assert err.value.field == "weight_version"
    with pytest.raises(ProtocolError, match="meta_info.cached_tokens=None: expected an int"):
        _sglang(rows, cached_tokens=None)


def test_sglang_routes_with_repeated_or_out_of_range_ids_are_refused():
    rows = np.arange(4 * 4).reshape(4, 2, 2) % 8
    rows[3, 0] = [5, 5]
    with pytest.raises(ProtocolError, match=re.escape("routed_experts (token 3, layer 0)=[5, 5]: expert id 5 "
                                                      "repeated")) as err:
        _sglang(rows)
    assert err.value.field == "routed_experts"
    rows[3, 0] = [5, 8]
    with pytest.raises(ProtocolError, match=re.escape("routed_experts (token 3, layer 0): expert id 8 at slot 1")):
        _sglang(rows)


def test_request_prompt_start_uses_the_one_rule():
    for s in (4, -1, True):
        bad = GenerateRequest([1, 2, 3], routed_experts_prompt_start=s)
        for encode_body in (protocol.request_body, sglang.generate_body):
            with pytest.raises(FieldError, match=re.escape(f"routed_experts_prompt_start={s!r}: expected an int "
                                                           "in [0, P=3]")) as err:
                encode_body(bad)
            assert err.value.field == "routed_experts_prompt_start"
    with pytest.raises(FieldError, match=re.escape("prompt_ids[1]=True")) as err:
        protocol.request_body(GenerateRequest([1, True, 3]))
    assert err.value.field == "prompt_ids[1]"


LIMITS = schema.Limits(vocab_size=272, max_seq_len=32)


def _body(**sampling):
    raw = json.dumps({"prompt_ids": [1, 2, 3], "sampling_params": sampling}).encode()
    return schema.parse_json(raw, schema.GenerateBody)


def test_schema_errors_are_field_errors_with_the_field_as_data():
    assert issubclass(schema.InputError, FieldError)
    with pytest.raises(schema.InputError, match=re.escape("sampling_params.routed_experts_prompt_start=4: "
                                                          "expected an int in [0, P=3]")) as err:
        schema.to_request(_body(routed_experts_prompt_start=4), LIMITS)
    e = err.value
    assert (e.field, e.value, e.status) == ("sampling_params.routed_experts_prompt_start", 4, 422)
    assert e.body() == {"error": "invalid_request", "field": e.field, "detail": str(e)}
    with pytest.raises(schema.InputError) as err:
        schema.to_request(_body(max_tokens=40), LIMITS)
    assert (err.value.field, err.value.value) == ("sampling_params.max_tokens", 40)
    with pytest.raises(schema.InputError) as err:
        schema.parse_json(b"[1]", schema.GenerateBody)
    assert (err.value.field, err.value.status) == ("body", 422)


def test_engine_error_takes_the_field_from_the_error_not_its_text():
    inner = FieldError("max_tokens", 0, "an int >= 1").within("requests[2]")
    err = schema.engine_error(inner)
    assert (err.field, err.value, str(err)) == ("sampling_params.max_tokens", 0,
                                                 "sampling_params.max_tokens=0: expected an int >= 1")
    err = schema.engine_error(FieldError("prompt_ids[3]", 999, "a token id in [0, 272)"))
    assert (err.field, str(err)) == ("prompt_ids[3]", "prompt_ids[3]=999: expected a token id in [0, 272)")
    err = schema.engine_error(ValueError("max_tokens=0: expected an int >= 1"))  # no field as data
    assert err.field == "body"


def test_output_json_never_defaults_the_route_start():
    out = GenerateOutput([5], None, "length", ROWS[:3].astype(np.uint8), 3, 0, 1, routed_experts_start=1)
    obj, _ = schema.output_json(out, [1, 2])
    assert obj["routed_experts"]["start"] == 1

    class NoStart:  # an output object of another engine that lacks the field
        output_ids, logprobs, finish_reason, routed_experts = [5], None, "length", ROWS[:3].astype(np.uint8)
        prompt_tokens, cached_tokens, weight_version = 3, 0, 1

    with pytest.raises(AttributeError, match="routed_experts_start"):
        schema.output_json(NoStart(), [1, 2])
    NoStart.routed_experts = None  # no routes asked for: no start needed
    assert schema.output_json(NoStart(), [1, 2])[0]["routed_experts"] is None
