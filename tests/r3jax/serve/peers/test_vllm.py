"""vLLM /v1/completions conformance: bodies in vLLM's documented form (data/, source named in the
file), parsed and rendered by r3jax.serve.peers.vllm; bad input → vLLM's 400/404 error body."""

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from r3jax.checks import FieldError
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.serve.peers import vllm
from r3jax.serve.protocol import ProtocolError

DATA = json.loads((Path(__file__).parent / "data" / "vllm_completions.json").read_text())
E, L, K = DATA["num_experts"], DATA["num_layers"], DATA["top_k"]
CASES = sorted(DATA["cases"])
MODEL = "Qwen/Qwen3-30B-A3B"


def _parse(body, **kw):
    kw.setdefault("return_routed_experts_default", True)  # server started with --enable-return-routed-experts
    return vllm.parse_completion(body, served_model=MODEL, **kw)


@pytest.mark.parametrize("name", CASES)
def test_documented_request_parses(name):
    body = DATA["cases"][name]["request"]
    req = _parse(body)
    assert req.prompt_ids == body["prompt"] and req.max_tokens == body["max_tokens"]
    assert req.temperature == 0.0 and req.return_logprobs is True and req.return_routed_experts is True
    assert req.routed_experts_prompt_start == body["routed_experts_prompt_start"]
    assert _parse({**body, "prompt": [body["prompt"]]}) == req  # a batch of one prompt
    assert _parse(body, return_routed_experts_default=False).return_routed_experts is False
    assert _parse({**body, "return_routed_experts": True}, return_routed_experts_default=False).return_routed_experts


@pytest.mark.parametrize("name", CASES)
def test_documented_response_parses_with_the_row_rule(name):
    case = DATA["cases"][name]
    req = _parse(case["request"])
    out = vllm.parse_completion_response(json.dumps(case["response"]), req, num_experts=E, num_layers=L, top_k=K)
    choice = case["response"]["choices"][0]
    assert out.output_ids == choice["token_ids"] and out.logprobs == choice["logprobs"]["token_logprobs"]
    want = np.asarray(case["routes"], dtype=np.int64).reshape(-1, L, K)
    np.testing.assert_array_equal(out.routed_experts, want)
    assert out.routed_experts.dtype == np.int16
    assert out.routed_experts.shape[0] == len(req.prompt_ids) - req.routed_experts_prompt_start + len(out.output_ids) - 1


@pytest.mark.parametrize("name", CASES)
def test_render_has_vllms_shape_and_round_trips(name):
    case = DATA["cases"][name]
    req = _parse(case["request"])
    recorded = case["response"]
    routes = np.asarray(case["routes"], dtype=np.int16).reshape(-1, L, K)
    choice = recorded["choices"][0]
    out = GenerateOutput(choice["token_ids"], choice["logprobs"]["token_logprobs"], "length", routes,
                         len(req.prompt_ids), 2, 0, req.routed_experts_prompt_start)
    body = vllm.render_completion(out, req, model=MODEL, request_id="0", created=recorded["created"], num_experts=E)
    assert set(recorded) <= set(body) and set(choice) <= set(body["choices"][0])
    for key in ("id", "object", "created", "model"):
        assert body[key] == recorded[key]
    ours = body["choices"][0]
    assert ours["logprobs"] == choice["logprobs"] and ours["token_ids"] == choice["token_ids"]
    assert ours["prompt_token_ids"] == choice["prompt_token_ids"] and ours["text"] == ""
    arr = np.load(io.BytesIO(base64.b64decode(ours["routed_experts"])), allow_pickle=False)  # vLLM's documented decode
    assert arr.dtype == np.uint16 and arr.shape == routes.shape
    np.testing.assert_array_equal(arr, routes)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    back = vllm.parse_completion_response(json.dumps(body), req, num_experts=E, num_layers=L, top_k=K)
    np.testing.assert_array_equal(back.routed_experts, routes)
    assert back.cached_tokens == 2 and back.output_ids == out.output_ids


def test_completion_body_round_trips():
    req = GenerateRequest(prompt_ids=[5, 6, 7, 8], max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=11,
                          stop_token_ids=(2,), return_logprobs=True, return_routed_experts=True,
                          routed_experts_prompt_start=2, session_id="s1")
    body = vllm.completion_body(req, model=MODEL)
    assert body["return_token_ids"] is True and body["routed_experts_prompt_start"] == 2
    assert _parse(body, return_routed_experts_default=False) == req


def test_stop_reason_and_finish():
    req = GenerateRequest(prompt_ids=[1, 2], max_tokens=4, stop_token_ids=(9,), return_logprobs=False)
    out = GenerateOutput([3, 9], None, "stop", None, 2, 0, 0, 0)
    choice = vllm.render_completion(out, req, model=MODEL, request_id="x", created=1, num_experts=8)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["logprobs"], choice["routed_experts"]) == \
        ("stop", 9, None, None)


def test_models_body():
    body = vllm.models_body(MODEL, max_model_len=4096, created=5)
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 4096


def _body(**kw):
    return {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4, **kw}


BAD = [
    ({"prompt": "Hello"}, "prompt"),
    ({"prompt": ["Hello"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2.0]}, "prompt[1]"),
    ({"prompt": [1, 500]}, "prompt[1]"),
    ({"routed_experts_prompt_start": 5}, "routed_experts_prompt_start"),
    ({"routed_experts_prompt_start": -1}, "routed_experts_prompt_start"),
    ({"routed_experts_prompt_start": False}, "routed_experts_prompt_start"),
    ({"return_routed_experts": 1}, "return_routed_experts"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"stream": True}, "stream"),
    ({"n": 0}, "n"),
    ({"n": 257}, "n"),
    ({"n": 2.0}, "n"),
    ({"stop": ["\n"]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -7}, "seed"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
    ({"session_id": 3}, "session_id"),
    ({"no_such_field": 1}, "no_such_field"),
]


def test_n_samples_of_one_prompt():
    """n is read apart from the sampling fields: samples(request, n) seeds sample i with seed + i."""
    body = _body(n=3, seed=2**64 - 2, temperature=1.0)
    req = _parse(body, vocab_size=100, max_seq_len=64)
    assert vllm.completion_samples(body) == 3 and vllm.completion_samples(_body()) == 1
    assert [r.seed for r in vllm.samples(req, 3)] == [2**64 - 2, 2**64 - 1, 0]
    assert all(r.prompt_ids == req.prompt_ids and r.max_tokens == 4 for r in vllm.samples(req, 3))
    unseeded = _parse(_body(n=2), vocab_size=100, max_seq_len=64)
    assert [r.seed for r in vllm.samples(unseeded, 2)] == [None, None]


@pytest.mark.parametrize("change,field", BAD)
def test_bad_input_is_vllms_400_naming_the_param(change, field):
    with pytest.raises(FieldError) as info:
        _parse(_body(**change), vocab_size=100, max_seq_len=64)
    assert info.value.field == field
    status, err = vllm.error_response(info.value)
    assert status == 400
    assert err == {"error": {"message": info.value.message, "type": "BadRequestError", "param": field, "code": 400}}


def test_unknown_model_is_vllms_404():
    with pytest.raises(FieldError) as info:
        _parse(_body(model="other"))
    status, err = vllm.error_response(info.value)
    assert status == 404
    assert err["error"] == {"message": "The model `other` does not exist.", "type": "NotFoundError", "param": "model",
                            "code": 404}


def test_vllm_defaults():
    req = _parse({"prompt": [1, 2, 3]}, return_routed_experts_default=False)
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.return_logprobs) == \
        (16, 1.0, 1.0, 0, None, False)
    assert _parse({"prompt": [1], "seed": -1, "top_k": -1, "max_tokens": None}).seed is None


def test_npy_decoder_refuses_bad_payloads():
    for text, match in [("%%%", "base64"), (base64.b64encode(b"abc").decode(), "npy"), (7, "base64 string")]:
        with pytest.raises(ValueError, match=match):
            vllm.decode_routes(text, E)
    buf = io.BytesIO()
    np.save(buf, np.array([[[3, 3, 1]]], np.int32))
    with pytest.raises(FieldError, match="repeated"):
        vllm.decode_routes(base64.b64encode(buf.getvalue()).decode(), E)
    buf = io.BytesIO()
    np.save(buf, np.ones((1, 2, 3), np.float32))
    with pytest.raises(FieldError, match="integer dtype"):
        vllm.decode_routes(base64.b64encode(buf.getvalue()).decode(), E)


def test_client_refuses_missing_routes_and_wrong_rows():
    case = DATA["cases"]["uint16_e384"]
    req = _parse(case["request"])
    choice = case["response"]["choices"][0]
    with pytest.raises(ProtocolError, match="enable-return-routed-experts"):
        vllm.parse_completion_response({"choices": [{**choice, "routed_experts": None}]}, req, num_experts=E,
                                       num_layers=L, top_k=K)
    short = vllm.encode_routes(np.asarray(case["routes"])[1:], E)
    with pytest.raises(ProtocolError, match="rows: expected P - s \\+ G - 1"):
        vllm.parse_completion_response({"choices": [{**choice, "routed_experts": short}]}, req, num_experts=E,
                                       num_layers=L, top_k=K)


def test_cached_tokens_are_never_read_as_zero():
    """``prompt_tokens_details: null`` (vLLM without --enable-prompt-tokens-details) is an unknown
    count, not 0; a details object without an int count is a broken answer."""
    req = GenerateRequest(prompt_ids=[1, 2], max_tokens=1, return_logprobs=False)
    answer = {"choices": [{"token_ids": [3], "finish_reason": "length"}], "usage": {"prompt_tokens": 2}}
    read = lambda usage: vllm.parse_completion_response({**answer, "usage": usage}, req, num_experts=E,
                                                        num_layers=L, top_k=K).cached_tokens
    assert read({"prompt_tokens_details": {"cached_tokens": 0}}) == 0
    assert read({"prompt_tokens_details": {"cached_tokens": 7}}) == 7
    assert read({"prompt_tokens_details": None}) is None and read({}) is None
    for details in ({}, {"cached_tokens": None}, {"cached_tokens": "3"}, {"cached_tokens": -1}, [3]):
        with pytest.raises(ProtocolError, match="cached_tokens") as err:
            read({"prompt_tokens_details": details})
        assert err.value.field == "cached_tokens"


def test_chat_answer_read_by_the_client_against_the_rendered_prompt():
    """The client's chat codec: the body asks for token ids and the rows from s; the answer's rows are
    counted against its prompt_token_ids (P - s + G - 1); a tool-call finish is a stop; an answer without
    prompt_token_ids, or with a row too many, is a ProtocolError naming what is wrong."""
    from r3jax.serve.client.chat import ChatRequest, chat_body, parse_chat_response
    from r3jax.serve.peers import vllm_chat

    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=3, stop_token_ids=(9,),
                      return_routed_experts=True, routed_experts_prompt_start=5, session_id="s")
    body = chat_body(req, model=None)
    assert body["return_token_ids"] is True and body["routed_experts_prompt_start"] == 5 and "model" not in body
    assert body["logprobs"] is True and body["seed"] == 3 and body["stop_token_ids"] == [9]
    prompt = list(range(1, 9))  # P = 8: rows [5, 8 + 3 - 1) = 5 rows
    routes = np.arange(5 * L * K).reshape(5, L, K) % E
    served = GenerateRequest(prompt_ids=prompt, max_tokens=4, return_routed_experts=True,
                             routed_experts_prompt_start=5)
    out = GenerateOutput(output_ids=[4, 5, 9], logprobs=[-0.5, -1.0, -0.25], finish_reason="stop",
                         routed_experts=routes.astype(np.uint8), prompt_tokens=8, cached_tokens=0, weight_version=0,
                         routed_experts_start=5)
    answer = vllm_chat.render_chat([out], served, texts=["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"],
                                   model="m", request_id="r", created=0, num_experts=E, return_token_ids=True,
                                   tool_call_parser="hermes")
    got = parse_chat_response(json.dumps(answer), req, num_experts=E, num_layers=L, top_k=K, vocab_size=100)
    assert got.prompt_ids == prompt and got.output_ids == [4, 5, 9] and got.logprobs == [-0.5, -1.0, -0.25]
    np.testing.assert_array_equal(got.routed_experts, routes)
    assert got.finish_reason == "stop" and got.routed_experts_start == 5 and got.prompt_tokens == 8
    assert got.message["tool_calls"][0]["function"]["name"] == "f"
    bad = dict(answer, prompt_token_ids=None)
    with pytest.raises(ProtocolError, match="prompt_token_ids"):
        parse_chat_response(json.dumps(bad), req, num_experts=E, num_layers=L, top_k=K)
    short = dict(answer, prompt_token_ids=prompt[:7])  # one prompt token fewer: 4 rows expected, 5 sent
    with pytest.raises(ProtocolError, match="expected P - s \\+ G - 1 = 7 - 5 \\+ 3 - 1 = 4"):
        parse_chat_response(json.dumps(short), req, num_experts=E, num_layers=L, top_k=K)
    with pytest.raises(ValueError, match="messages"):
        ChatRequest(messages=[])


@pytest.mark.parametrize("form", ["vllm", "skyrl", "sglang"])
@pytest.mark.parametrize("spans", [((0, 2),), ((0, 2), (3, 3)), ((0, 1), (1, 4), (4, 6))])
@pytest.mark.parametrize("finish", ["length", "abort"])
def test_version_spans_and_abort_round_trip_every_peer_form(form, spans, finish):
    """An output's weight-version spans and an abort finish survive each peer form's server render and
    client parse. A one-version output sends no spans field (the answer stays the peer's own bytes): the
    client takes the answer's version (SGLang's ``weight_version``; the others' ``X-Weight-Version``
    header, applied by the client after parsing). SGLang's field is ``meta_info.weight_versions`` as
    ``[{"version": str, "start", "end"}]``; vLLM's and SkyRL's an extension ``weight_versions`` of the choice."""
    import dataclasses

    from r3jax.serve.peers import common, sglang, skyrl

    g, E = 6, 8
    req = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=8, return_logprobs=True, return_routed_experts=True)
    routes = (np.arange(3 + g - 1)[:, None, None] + np.array([0, 1])).astype(np.uint8) % E  # [rows, 1, 2] distinct
    out = GenerateOutput(output_ids=[4, 5, 6, 7, 8, 9], logprobs=[-0.5] * g, finish_reason=finish,
                         routed_experts=routes, prompt_tokens=3, cached_tokens=0, weight_version=spans[0][1],
                         routed_experts_start=0, weight_versions=spans)
    kw = dict(num_experts=E, num_layers=1, top_k=2)
    if form == "vllm":
        body = vllm.render_completion(out, req, model="m", request_id="r", created=0, num_experts=E)
        field = body["choices"][0].get("weight_versions")
        back = vllm.parse_completion_response(json.dumps(body), req, **kw)
    elif form == "skyrl":
        body = skyrl.render_generate(out, req, num_experts=E)
        field = body["choices"][0].get("weight_versions")
        back = skyrl.parse_generate_response(skyrl.dumps(body), req, **kw)
    else:
        body = sglang.render_generate(out, req, num_experts=E, rid="r")
        field = body["meta_info"].get("weight_versions")
        back = sglang.parse_generate_response(json.dumps(body), req, **kw)
    if len(spans) == 1:
        assert field is None
    elif form == "sglang":
        ends = [i for i, _ in spans[1:]] + [g]
        assert field == [{"version": str(v), "start": i, "end": e} for (i, v), e in zip(spans, ends)]
    else:
        assert field == [list(s) for s in spans]
    if form != "sglang":  # what the client does with the X-Weight-Version header next
        back = common.one_span(dataclasses.replace(back, weight_version=out.weight_version))
    assert (back.finish_reason, back.output_ids, back.logprobs) == (finish, out.output_ids, out.logprobs)
    assert tuple(back.weight_versions) == spans
    np.testing.assert_array_equal(back.routed_experts, routes)
