"""SGLang 0.5.23 /generate conformance: bodies in SGLang's form (data/, source named in the file),
parsed and rendered by r3jax.serve.peers.sglang; bad input → SGLang's 400."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from r3jax.checks import FieldError
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.serve.peers import sglang
from r3jax.serve.protocol import ProtocolError

DATA = json.loads((Path(__file__).parent / "data" / "sglang_0.5.23_generate.json").read_text())
E, L, K = DATA["num_experts"], DATA["num_layers"], DATA["top_k"]
CASES = sorted(DATA["cases"])


@pytest.mark.parametrize("name", CASES)
def test_documented_request_parses(name):
    body = DATA["cases"][name]["request"]
    req = sglang.parse_generate(body)
    assert req.prompt_ids == body["input_ids"] and req.max_tokens == body["sampling_params"]["max_new_tokens"]
    assert req.temperature == 0.0 and req.top_k == 0 and req.return_logprobs and req.return_routed_experts
    assert req.routed_experts_prompt_start == body["routed_experts_start_len"]
    assert sglang.parse_generate(sglang.generate_body(req)) == req


@pytest.mark.parametrize("name", CASES)
def test_documented_response_parses_with_the_row_rule(name):
    case = DATA["cases"][name]
    req = sglang.parse_generate(case["request"])
    out = sglang.parse_generate_response(json.dumps(case["response"]), req, num_experts=E, num_layers=L, top_k=K)
    meta = case["response"]["meta_info"]
    assert out.output_ids == case["response"]["output_ids"] and out.finish_reason == "length"
    assert out.logprobs == [row[0] for row in meta["output_token_logprobs"]]
    want = np.asarray(case["routes"], dtype=np.int64).reshape(-1, L, K)
    s = req.routed_experts_prompt_start
    if name == "old_server_full_sequence":  # rows [0, P + G - 1): the client keeps [s, P + G - 1)
        want = want[s:]
    np.testing.assert_array_equal(out.routed_experts, want)
    assert out.routed_experts.dtype == np.int16
    assert out.routed_experts.shape[0] == len(req.prompt_ids) - s + len(out.output_ids) - 1
    assert out.weight_version == -1  # SGLang's "default": never updated


@pytest.mark.parametrize("name", CASES)
def test_render_has_sglangs_shape_and_round_trips(name):
    case = DATA["cases"][name]
    req = sglang.parse_generate(case["request"])
    recorded = case["response"]
    routes = np.asarray(case["routes"], dtype=np.int16).reshape(-1, L, K)
    if name == "old_server_full_sequence":
        routes = routes[req.routed_experts_prompt_start:]
    meta = recorded["meta_info"]
    out = GenerateOutput(recorded["output_ids"], [r[0] for r in meta["output_token_logprobs"]], "length", routes,
                         len(req.prompt_ids), 0, 4, req.routed_experts_prompt_start)
    body = sglang.render_generate(out, req, num_experts=E, rid=meta["id"])
    assert set(body) == set(recorded)
    assert set(body["meta_info"]) <= set(meta)
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs"):
        assert body["meta_info"][key] == meta[key], key
    assert body["meta_info"]["weight_version"] == "4"
    flat = np.frombuffer(base64.b64decode(body["meta_info"]["routed_experts"]), dtype=np.int32)  # SGLang's decode
    np.testing.assert_array_equal(flat, routes.reshape(-1))
    back = sglang.parse_generate_response(body, req, num_experts=E, num_layers=L, top_k=K)
    np.testing.assert_array_equal(back.routed_experts, routes)
    assert back.weight_version == 4


def test_stop_finish_reason():
    req = GenerateRequest(prompt_ids=[1, 2], max_tokens=5, stop_token_ids=(7,), return_logprobs=False)
    out = GenerateOutput([3, 7], None, "stop", None, 2, 1, 0, 0)
    body = sglang.render_generate(out, req, num_experts=8, rid="r")
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 7}
    assert "output_token_logprobs" not in body["meta_info"] and "routed_experts" not in body["meta_info"]
    back = sglang.parse_generate_response(body, req, num_experts=8, num_layers=1, top_k=1)
    assert back.finish_reason == "stop" and back.cached_tokens == 1


def test_sglang_defaults():
    req = sglang.parse_generate({"input_ids": [1, 2, 3]})
    assert (req.max_tokens, req.temperature, req.top_k, req.return_logprobs, req.return_routed_experts) == \
        (128, 1.0, 0, False, False)
    # SGLang reads routed_experts_start_len only when routes are asked for (scheduler.py)
    assert sglang.parse_generate({"input_ids": [1, 2], "routed_experts_start_len": 9}).routed_experts_prompt_start == 0


def _body(**kw):
    sp = kw.pop("sp", {})
    return {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, **sp},
            "return_routed_experts": True, **kw}


BAD = [
    (_body(text="Hello"), "text"),
    (_body(input_ids=[]), "input_ids"),
    (_body(input_ids="1 2"), "input_ids"),
    (_body(input_ids=[[1], [2]]), "input_ids"),
    (_body(input_ids=[1, 2, 999]), "input_ids[2]"),
    (_body(routed_experts_start_len=5), "routed_experts_start_len"),
    (_body(routed_experts_start_len=-1), "routed_experts_start_len"),
    (_body(routed_experts_start_len=True), "routed_experts_start_len"),
    (_body(return_routed_experts_start_len=1), "return_routed_experts_start_len"),
    (_body(return_logprob="yes"), "return_logprob"),
    (_body(stream=True), "stream"),
    (_body(top_logprobs_num=2), "top_logprobs_num"),
    (_body(sp={"max_new_tokens": 0}), "sampling_params.max_new_tokens"),
    (_body(sp={"top_k": 0}), "sampling_params.top_k"),
    (_body(sp={"temperature": -1}), "sampling_params.temperature"),
    (_body(sp={"n": 0}), "sampling_params.n"),
    (_body(sp={"n": 257}), "sampling_params.n"),
    (_body(sp={"n": "3"}), "sampling_params.n"),
    (_body(sp={"stop": ["x"]}), "sampling_params.stop"),
    (_body(sp={"sampling_seed": 1.5}), "sampling_params.sampling_seed"),
    (_body(sp={"max_tokens": 4}), "sampling_params.max_tokens"),
    (_body(sampling_params=[1]), "sampling_params"),
]


def test_n_samples_of_one_prompt():
    body = _body(sp={"n": 3, "sampling_seed": 5})
    req = sglang.parse_generate(body, vocab_size=100, max_seq_len=64)
    assert sglang.generate_samples(body) == 3 and sglang.generate_samples(_body()) == 1
    assert req.seed == 5 and req.max_tokens == 4


@pytest.mark.parametrize("body,field", BAD)
def test_bad_input_is_sglangs_400(body, field):
    with pytest.raises(FieldError) as info:
        sglang.parse_generate(body, vocab_size=100, max_seq_len=64)
    assert info.value.field == field
    status, err = sglang.error_response(info.value)
    assert status == 400 and err == {"error": {"message": info.value.message}}
    assert field in err["error"]["message"]


def test_client_reads_an_abort_and_refuses_wrong_rows_and_broken_spans():
    case = DATA["cases"]["start_len_e384"]
    req = sglang.parse_generate(case["request"])
    resp = case["response"]
    aborted = {**resp, "meta_info": {**resp["meta_info"], "finish_reason": {"type": "abort", "message": "x"}}}
    out = sglang.parse_generate_response(aborted, req, num_experts=E, num_layers=L, top_k=K)
    assert out.finish_reason == "abort" and out.output_ids == resp["output_ids"]
    g = len(resp["output_ids"])
    for spans in ([{"version": "1", "start": 0, "end": g - 1}],  # short of G
                  [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": g}],  # a gap
                  [{"version": "x", "start": 0, "end": g}], [{"version": "1", "start": 0, "end": 0}], "0-3:1"):
        broken = {**resp, "meta_info": {**resp["meta_info"], "weight_versions": spans}}
        with pytest.raises(ProtocolError, match="weight_versions"):
            sglang.parse_generate_response(broken, req, num_experts=E, num_layers=L, top_k=K)
    routes = np.asarray(case["routes"])
    bad = {**resp, "meta_info": {**resp["meta_info"], "routed_experts": sglang.encode_routes(routes[1:], E)}}
    with pytest.raises(ProtocolError, match="rows"):
        sglang.parse_generate_response(bad, req, num_experts=E, num_layers=L, top_k=K)
    odd = {**resp, "meta_info": {**resp["meta_info"], "routed_experts": base64.b64encode(b"\0" * 20).decode()}}
    with pytest.raises(ProtocolError, match="multiple of"):
        sglang.parse_generate_response(odd, req, num_experts=E, num_layers=L, top_k=K)


def test_an_aborted_output_renders_as_sglangs_abort():
    """A weight update's mode "abort" answer goes out as SGLang's ``{"type": "abort"}`` finish (never as a
    length or stop), which SGLang's clients, this one included, read as an aborted request."""
    req = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=8)
    out = GenerateOutput(output_ids=[4, 5], logprobs=[-0.5, -0.25], finish_reason="abort", routed_experts=None,
                         prompt_tokens=3, cached_tokens=0, weight_version=2, routed_experts_start=0)
    obj = sglang.render_generate(out, req, num_experts=E, rid="r")
    assert obj["meta_info"]["finish_reason"]["type"] == "abort"
    back = sglang.parse_generate_response(obj, req, num_experts=E, num_layers=L, top_k=K)
    assert (back.finish_reason, back.output_ids, back.logprobs) == ("abort", [4, 5], [-0.5, -0.25])
    assert back.weight_versions == ((0, 2),)  # one version: from meta_info.weight_version
