"""SkyRL 0.4.0 conformance: requests and responses recorded from SkyRL's own code (data/, source named
in the file), parsed and rendered by r3jax.serve.peers.skyrl, plus bad input → SkyRL's 400."""

import json
from pathlib import Path

import numpy as np
import pytest

from r3jax.checks import FieldError
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.serve.peers import skyrl
from r3jax.serve.protocol import ProtocolError

DATA = json.loads((Path(__file__).parent / "data" / "skyrl_0.4.0_generate.json").read_text())
E, L, K = DATA["num_experts"], DATA["num_layers"], DATA["top_k"]
CASES = sorted(DATA["cases"])


def _parse(case):
    req = case["request"]
    return skyrl.parse_generate(req["body"], return_routed_experts=req["path"] == skyrl.ROUTES_PATH,
                                session_id=req["headers"].get(skyrl.SESSION_HEADER))


@pytest.mark.parametrize("name", CASES)
def test_recorded_request_parses_to_the_engine_request(name):
    case = DATA["cases"][name]
    body = case["request"]["body"]
    req = _parse(case)
    assert req.prompt_ids == body["token_ids"]
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (1024, 1.0, 1.0, 0)  # SkyRL top_k -1 = off
    assert req.return_logprobs is True and req.return_routed_experts is True
    assert req.routed_experts_prompt_start == body["sampling_params"]["routed_experts_prompt_start"]
    assert req.session_id == "traj-0" and req.seed is None and list(req.stop_token_ids) == []


@pytest.mark.parametrize("name", CASES)
def test_request_for_builds_what_skyrl_client_sends(name):
    case = DATA["cases"][name]
    req = _parse(case)
    path, body, headers = skyrl.request_for(req, model=case["request"]["body"]["model"])
    assert path == case["request"]["path"] == "/skyrl/v1/generate"
    assert headers == case["request"]["headers"]
    recorded = case["request"]["body"]
    assert body["token_ids"] == recorded["token_ids"] and body["model"] == recorded["model"]
    for key in ("max_tokens", "temperature", "top_p", "routed_experts_prompt_start"):
        assert body["sampling_params"][key] == recorded["sampling_params"][key]
    again = skyrl.parse_generate(body, return_routed_experts=True, session_id=headers[skyrl.SESSION_HEADER])
    assert again == req


def test_plain_path_without_routes():
    req = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4, return_logprobs=False)
    path, body, headers = skyrl.request_for(req)
    assert path == "/inference/v1/generate" and "X-Session-ID" not in headers
    assert "routed_experts_prompt_start" not in body["sampling_params"]
    assert skyrl.parse_generate(body, return_routed_experts=False) == req


@pytest.mark.parametrize("name", CASES)
def test_recorded_response_parses_with_the_row_rule(name):
    case = DATA["cases"][name]
    req = _parse(case)
    out = skyrl.parse_generate_response(case["response_raw"].encode(), req, num_experts=E, num_layers=L, top_k=K)
    choice = case["response"]["choices"][0]
    assert out.output_ids == choice["token_ids"] and out.finish_reason == "length"
    assert out.logprobs == [c["logprob"] for c in choice["logprobs"]["content"]]
    want = np.asarray(case["routes"], dtype=np.int64).reshape(-1, L, K)
    assert out.routed_experts.dtype == np.int16  # route_dtype(384), whatever SkyRL's chunk dtype was
    np.testing.assert_array_equal(out.routed_experts, want)
    p, s, g = len(req.prompt_ids), req.routed_experts_prompt_start, len(out.output_ids)
    assert out.routed_experts.shape[0] == p - s + g - 1
    assert out.weight_version == -1  # SkyRL's protocol carries none


@pytest.mark.parametrize("name", CASES)
def test_render_is_byte_identical_to_skyrl_server(name):
    """SkyRL's load_packed_body splices on the exact byte layout: compare bytes, not parsed JSON."""
    case = DATA["cases"][name]
    req = _parse(case)
    choice = case["response"]["choices"][0]
    routes = np.asarray(case["routes"], dtype=np.int16).reshape(-1, L, K)
    out = GenerateOutput(output_ids=choice["token_ids"], logprobs=[c["logprob"] for c in choice["logprobs"]["content"]],
                         finish_reason="length", routed_experts=routes, prompt_tokens=len(req.prompt_ids),
                         cached_tokens=0, weight_version=0, routed_experts_start=req.routed_experts_prompt_start)
    raw = skyrl.dumps(skyrl.render_generate(out, req, num_experts=E))
    assert raw == case["response_raw"].encode()
    assert b'"routed_experts":{"data":"' in raw


def test_nonfinite_logprob_is_floored_like_skyrl():
    req = GenerateRequest(prompt_ids=[1], max_tokens=2, return_logprobs=True)
    out = GenerateOutput([5, 6], [float("-inf"), -1e5], "length", None, 1, 0, 0, 0)
    body = skyrl.render_generate(out, req, num_experts=8)
    assert [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]] == [-9999.0, -9999.0]


def _body(**sp):
    body = {"token_ids": [1, 2, 3, 4], "model": "m", "sampling_params": {"max_tokens": 4, "logprobs": 1, **sp}}
    return body


BAD = [
    ({"token_ids": None}, "token_ids"),
    ({"token_ids": "1 2 3"}, "token_ids"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, True]}, "token_ids[1]"),
    ({"token_ids": [1, -2]}, "token_ids[1]"),
    ({"sampling_params": "greedy"}, "sampling_params"),
    ({"return_sample_support": True}, "return_sample_support"),
    ({"features": {"mm_hashes": {}}}, "features"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"model": 7}, "model"),
]
BAD_SP = [
    ({"routed_experts_prompt_start": 5}, "sampling_params.routed_experts_prompt_start"),
    ({"routed_experts_prompt_start": -1}, "sampling_params.routed_experts_prompt_start"),
    ({"routed_experts_prompt_start": True}, "sampling_params.routed_experts_prompt_start"),
    ({"routed_experts_prompt_start": 1.0}, "sampling_params.routed_experts_prompt_start"),
    ({"max_tokens": 0}, "sampling_params.max_tokens"),
    ({"max_tokens": 2.5}, "sampling_params.max_tokens"),
    ({"temperature": 2.5}, "sampling_params.temperature"),
    ({"temperature": "hot"}, "sampling_params.temperature"),
    ({"top_p": 0}, "sampling_params.top_p"),
    ({"top_k": -2}, "sampling_params.top_k"),
    ({"seed": -5}, "sampling_params.seed"),
    ({"n": 2}, "sampling_params.n"),
    ({"stop": ["</s>"]}, "sampling_params.stop"),
    ({"presence_penalty": 0.5}, "sampling_params.presence_penalty"),
    ({"min_tokens": 3}, "sampling_params.min_tokens"),
    ({"logprobs": -2}, "sampling_params.logprobs"),
    ({"skip_special_tokens": "yes"}, "sampling_params.skip_special_tokens"),
    ({"best_of": 2}, "sampling_params.best_of"),
]


@pytest.mark.parametrize("change,field", BAD + [({"sampling_params": {**_body()["sampling_params"], **c}}, f)
                                                for c, f in BAD_SP])
def test_bad_input_is_skyrls_400_naming_the_field(change, field):
    body = {**_body(), **change}
    if change.get("token_ids", 0) is None:
        del body["token_ids"]
    with pytest.raises(FieldError) as info:
        skyrl.parse_generate(body, return_routed_experts=True, vocab_size=100, max_seq_len=64)
    assert info.value.field == field
    status, err = skyrl.error_response(info.value)
    assert status == 400 and err["error"]["code"] == 400 and err["error"]["param"] == field
    assert err["error"]["message"].startswith(field)  # SkyRL's raise_for_status shows error.message


def test_limits_of_the_served_model():
    with pytest.raises(FieldError, match=r"token_ids\[2\]"):
        skyrl.parse_generate(_body(), return_routed_experts=True, vocab_size=3)
    with pytest.raises(FieldError, match="sampling_params.max_tokens"):
        skyrl.parse_generate(_body(max_tokens=61), return_routed_experts=True, max_seq_len=64)
    # vLLM's null max_tokens: up to the context
    assert skyrl.parse_generate(_body(max_tokens=None), return_routed_experts=True, max_seq_len=64).max_tokens == 60


def test_not_a_json_object():
    with pytest.raises(FieldError) as info:
        skyrl.parse_generate([1, 2], return_routed_experts=False)
    assert info.value.field == "body"


def test_client_refuses_broken_answers():
    case = DATA["cases"]["int16_ids_e384"]
    req = _parse(case)
    resp = json.loads(case["response_raw"])
    choice = resp["choices"][0]
    short = skyrl.encode_routes(np.asarray(case["routes"])[:-1], E)
    for broken, match in [({**choice, "routed_experts": None}, "packed routed_experts"),
                          ({**choice, "routed_experts": short}, "rows: expected"),
                          ({**choice, "finish_reason": "cancelled"}, "finish_reason"),
                          ({**choice, "weight_versions": [[1, 3]]}, "weight_versions"),
                          ({**choice, "token_ids": []}, "token ids"),
                          ({**choice, "logprobs": None}, "logprobs")]:
        with pytest.raises(ProtocolError, match=match):
            skyrl.parse_generate_response({"choices": [broken]}, req, num_experts=E, num_layers=L, top_k=K)
    with pytest.raises(ProtocolError, match=r"expert id \d+ .*num_experts=200"):
        skyrl.parse_generate_response(case["response_raw"], req, num_experts=200, num_layers=L, top_k=K)
