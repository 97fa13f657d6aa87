"""The peers' endpoints on the real tiny engine over HTTP (uvicorn in a thread): the same two-turn
conversation through every protocol (r3jax JSON and binary, SkyRL, vLLM, SGLang) gives the same tokens,
logprobs and route rows ``[s, P + G - 1)`` as the in-process engine; openai's own client drives
``/v1/completions``; every endpoint answers bad input with its peer's 4xx and never a 5xx (fuzzed);
auth and OpenAPI cover every endpoint."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import struct
import threading
import time

import httpx
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateOutput, GenerateRequest
from r3jax.rollout import ByteTokenizer
from r3jax.routes import decode_binary
from r3jax.serve import RemoteInferenceClient, RemoteInputError, create_app
from r3jax.serve.protocol import BINARY_MEDIA_TYPE

# the engine tests' configuration (tests/r3jax/serve/test_app.py): the same programs, from the cache
ENGINE_KW = dict(max_seq_len=64, max_batch_size=4, block_size=8, prefill_chunk=32,
                 prefill_rows=2, decode_buckets=1, moe_impl="dense")
PROTOCOLS = [("r3jax", True), ("r3jax", False), ("skyrl", False), ("vllm", False), ("sglang", False)]
FIRST, OBSERVATION = [256, 259, 72, 105, 260], [257, 259, 79, 107, 260]  # ByteTokenizer dialogue pieces


@pytest.fixture(scope="module")
def served(serve_helpers):
    engine = Engine(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)), **ENGINE_KW)
    app = create_app(engine, max_body_bytes=64 << 10, served_model_name="tiny", tokenizer=ByteTokenizer())
    with serve_helpers.thread_server(app) as srv:
        yield engine, srv.url
    engine.close()


def _turns(generate, session: str | None = None):
    """Two turns of a conversation driven by ``generate(request) -> GenerateOutput``; the second turn
    asks only for the rows after those already captured (s = P1 + G1 - 1)."""
    r1 = GenerateRequest(FIRST, max_tokens=4, temperature=0.0, return_routed_experts=True, session_id=session)
    o1 = generate(r1)
    prompt = FIRST + list(o1.output_ids) + OBSERVATION
    s = len(FIRST) + len(o1.output_ids) - 1
    r2 = GenerateRequest(prompt, max_tokens=4, temperature=0.0, return_routed_experts=True,
                         routed_experts_prompt_start=s, session_id=session)
    return (r1, o1), (r2, generate(r2))


@pytest.mark.parametrize("protocol,binary", PROTOCOLS)
def test_two_turns_through_every_protocol_equal_the_engine(served, protocol, binary):
    engine, url = served
    want = _turns(lambda r: engine.generate([r])[0])
    with RemoteInferenceClient(url, protocol=protocol, binary_routes=binary, model="tiny") as client:
        got = _turns(lambda r: client.generate([r])[0], session="conv-1")
        stats = httpx.get(url + "/v1/stats").json()
    for (req, a), (_, b) in zip(got, want):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs  # floats survive JSON exactly
        p, g, s = len(req.prompt_ids), len(a.output_ids), req.routed_experts_prompt_start
        assert a.routed_experts.shape == (p - s + g - 1, 2, 2) and a.routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert a.routed_experts_start == s and a.weight_version == engine.weight_version  # X-Weight-Version
    assert stats["protocols"][protocol] >= 2
    if protocol in ("r3jax", "skyrl", "vllm"):  # the ones that carry a session id
        assert stats["sessions"]["conv-1"] >= 2


def test_openai_client_drives_completions(served):
    openai = pytest.importorskip("openai")
    engine, url = served
    (r1, o1), (r2, o2) = _turns(lambda r: engine.generate([r])[0])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for req, want in ((r1, o1), (r2, o2)):
        resp = client.completions.create(
            model="tiny", prompt=list(req.prompt_ids), max_tokens=4, temperature=0.0, logprobs=0,
            extra_body={"return_token_ids": True, "return_routed_experts": True,
                        "routed_experts_prompt_start": req.routed_experts_prompt_start})
        choice = resp.choices[0]
        extra = choice.model_extra
        assert extra["token_ids"] == want.output_ids and choice.finish_reason == want.finish_reason
        assert choice.text == ByteTokenizer().decode(want.output_ids)
        assert choice.logprobs.token_logprobs == want.logprobs
        routes = np.load(io.BytesIO(base64.b64decode(extra["routed_experts"])))  # vLLM's documented decode
        np.testing.assert_array_equal(routes, want.routed_experts)
        assert resp.usage.prompt_tokens == len(req.prompt_ids) and resp.usage.completion_tokens == 4
    text = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0.0,
                                     extra_body={"return_token_ids": True})
    assert text.choices[0].model_extra["prompt_token_ids"] == list(b"Hi")  # the server's tokenizer
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=2)


def test_completions_n_samples_share_one_prefill(served):
    """vLLM's n: the samples of one prompt, seeded seed + i, prefill it once and equal each run alone."""
    engine, url = served
    prompt = np.random.default_rng(11).integers(0, 256, 41).tolist()  # 5 whole pages of 8, then 1 token
    before = engine.stats["prefill_tokens"]
    r = httpx.post(url + "/v1/completions", json={
        "prompt": prompt, "n": 4, "seed": 7, "temperature": 1.0, "max_tokens": 6, "logprobs": 0,
        "return_token_ids": True, "return_routed_experts": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert engine.stats["prefill_tokens"] - before == 41 + 3
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 41 and body["usage"]["completion_tokens"] == 24
    for i, choice in enumerate(body["choices"]):
        [alone] = engine.generate([GenerateRequest(prompt, max_tokens=6, temperature=1.0, seed=7 + i,
                                                   return_routed_experts=True)])
        assert choice["token_ids"] == alone.output_ids
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], alone.logprobs, atol=2e-5)
        routes = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        np.testing.assert_array_equal(routes, alone.routed_experts)
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1  # distinct seeds, distinct samples


def test_sglang_n_samples_are_a_list_sharing_one_prefill(served):
    """SGLang's parallel sampling: n > 1 answers a list, one object per sample, from one prefill."""
    engine, url = served
    prompt = np.random.default_rng(12).integers(0, 256, 41).tolist()
    before = engine.stats["prefill_tokens"]
    r = httpx.post(url + "/generate", json={
        "input_ids": prompt, "return_routed_experts": True, "return_logprob": True, "rid": "g",
        "sampling_params": {"n": 3, "sampling_seed": 9, "temperature": 1.0, "max_new_tokens": 5}}, timeout=120)
    assert r.status_code == 200, r.text
    assert engine.stats["prefill_tokens"] - before == 41 + 2
    objs = r.json()
    assert isinstance(objs, list) and [o["meta_info"]["id"] for o in objs] == ["g-0", "g-1", "g-2"]
    for i, obj in enumerate(objs):
        [alone] = engine.generate([GenerateRequest(prompt, max_tokens=5, temperature=1.0, seed=9 + i,
                                                   return_routed_experts=True)])
        assert obj["output_ids"] == alone.output_ids
        routes = np.frombuffer(base64.b64decode(obj["meta_info"]["routed_experts"]), "<i4").reshape(-1, 2, 2)
        np.testing.assert_array_equal(routes, alone.routed_experts)


@pytest.mark.parametrize("binary", [False, True])
def test_r3jax_n_samples_share_one_prefill(served, binary):
    """r3jax's own n: ``{"outputs": [...]}`` in seed order from one prefill, each equal to its request
    alone; binary framing puts each sample's route frame after the JSON, in order."""
    engine, url = served
    prompt = np.random.default_rng(13 + binary).integers(0, 256, 41).tolist()
    before = engine.stats["prefill_tokens"]
    headers = {"Accept": BINARY_MEDIA_TYPE} if binary else {}
    r = httpx.post(url + "/v1/generate", headers=headers, timeout=120, json={
        "prompt_ids": prompt, "return_routed_experts": True,
        "sampling_params": {"n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 5,
                            "routed_experts_prompt_start": 3}})
    assert r.status_code == 200, r.text
    assert engine.stats["prefill_tokens"] - before == 41 + 2
    if binary:
        (head,) = struct.unpack_from("<I", r.content)
        objs, frames = json.loads(r.content[4:4 + head])["outputs"], r.content[4 + head:]
        assert sum(o["routed_experts_binary"] for o in objs) == len(frames)
    else:
        objs = r.json()["outputs"]
    assert len(objs) == 3
    for i, obj in enumerate(objs):
        [alone] = engine.generate([GenerateRequest(prompt, max_tokens=5, temperature=1.0, seed=5 + i,
                                                   return_routed_experts=True, routed_experts_prompt_start=3)])
        assert obj["output_ids"] == alone.output_ids and obj["prompt_tokens"] == 41
        np.testing.assert_allclose(obj["logprobs"], alone.logprobs, atol=2e-5)
        if binary:
            size = obj["routed_experts_binary"]
            routes, start, _ = decode_binary(frames[:size])
            frames = frames[size:]
        else:
            wire = obj["routed_experts"]
            routes = np.frombuffer(base64.b64decode(wire["data"]), wire["dtype"]).reshape(wire["shape"])
            start = wire["start"]
        assert start == 3
        np.testing.assert_array_equal(routes, alone.routed_experts)
    assert len({tuple(o["output_ids"]) for o in objs}) > 1


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                              {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42"}]


def test_chat_equals_completions_on_the_rendered_prompt_ids(served):
    """/v1/chat/completions renders messages with the server's tokenizer, then answers exactly what
    /v1/completions answers for those ids: tokens, logprobs, route rows; content is the decoded ids."""
    engine, url = served
    ids = ByteTokenizer().chat_ids([{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                                     else "".join(p["text"] for p in m["content"])} for m in CHAT])
    assert ids[:2] == [256, 261] and ids[-1] == 260  # <bos> <system> ... <user> 42 <assistant>
    common = {"max_tokens": 6, "temperature": 0.0, "return_token_ids": True, "return_routed_experts": True,
              "routed_experts_prompt_start": 3}
    chat = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "logprobs": True,
                                                          **common}, timeout=120)
    assert chat.status_code == 200, chat.text
    done = httpx.post(url + "/v1/completions", json={"prompt": ids, "logprobs": 0, **common}, timeout=120).json()
    c, want = chat.json(), done["choices"][0]
    assert c["object"] == "chat.completion" and c["prompt_token_ids"] == ids
    choice = c["choices"][0]
    assert choice["token_ids"] == want["token_ids"] and choice["finish_reason"] == want["finish_reason"]
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == want["logprobs"]["token_logprobs"]
    assert choice["routed_experts"] == want["routed_experts"]  # same rows [s, P + G - 1), same encoding
    assert choice["message"] == {"role": "assistant", "content": ByteTokenizer().decode(want["token_ids"]),
                                 "tool_calls": []}
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second hit the cache
    assert [c["usage"][k] for k in keys] == [done["usage"][k] for k in keys] == [len(ids), 6, len(ids) + 6]


def test_openai_client_drives_chat_completions(served):
    openai = pytest.importorskip("openai")
    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0.0, n=2, seed=1, extra_body={"return_token_ids": True})
    ids = ByteTokenizer().chat_ids([{"role": "user", "content": "Hi"}])
    [want] = engine.generate([GenerateRequest(ids, max_tokens=4, temperature=0.0)])
    assert resp.model_extra["prompt_token_ids"] == ids and len(resp.choices) == 2
    for choice in resp.choices:  # greedy: both samples the same
        assert choice.model_extra["token_ids"] == want.output_ids
        assert choice.message.content == ByteTokenizer().decode(want.output_ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "Hi"}])
    assert err.value.status_code == 400 and err.value.body["param"] == "messages[0].role"


TINY_T = 1e-30  # scaled logits would overflow: greedy below 1e-5, as vLLM
FORMS = [  # (path, body with a 41-token prompt P, the output ids and logprobs of the answer)
    ("/v1/generate", lambda p: {"prompt_ids": p, "sampling_params": {"max_tokens": 5, "temperature": TINY_T,
                                                                    "logprobs_mode": "processed_logprobs"}},
     lambda o: (o["output_ids"], o["logprobs"])),
    ("/skyrl/v1/generate", lambda p: {"token_ids": p, "sampling_params": {"max_tokens": 5, "temperature": TINY_T,
                                                                          "logprobs": 0}},
     lambda o: (o["choices"][0]["token_ids"], [c["logprob"] for c in o["choices"][0]["logprobs"]["content"]])),
    ("/v1/completions", lambda p: {"prompt": p, "max_tokens": 5, "temperature": TINY_T, "logprobs": 0,
                                   "return_token_ids": True},
     lambda o: (o["choices"][0]["token_ids"], o["choices"][0]["logprobs"]["token_logprobs"])),
    ("/generate", lambda p: {"input_ids": p, "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 5, "temperature": TINY_T}},
     lambda o: (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])),
]


@pytest.mark.parametrize("path,body,read", FORMS, ids=[f[0] for f in FORMS])
def test_a_tiny_temperature_is_greedy_and_no_nan_or_infinity_leaves(served, path, body, read):
    engine, url = served
    prompt = np.random.default_rng(14).integers(0, 256, 41).tolist()
    r = httpx.post(url + path, json=body(prompt), timeout=120)
    assert r.status_code == 200, r.text

    def refuse(constant):
        raise AssertionError(f"{constant} in the answer of {path}")

    ids, logprobs = read(json.loads(r.text, parse_constant=refuse))
    [greedy] = engine.generate([GenerateRequest(prompt, max_tokens=5, temperature=0.0)])
    assert ids == greedy.output_ids
    np.testing.assert_allclose(logprobs, greedy.logprobs, atol=2e-5)
    assert all(np.isfinite(logprobs))


def test_non_finite_logprobs_go_out_as_the_floor_in_every_form():
    """Whatever the engine hands over, every wire form sends -9999.0 (vLLM's floor) for a non-finite
    logprob, never NaN or Infinity."""
    from r3jax.serve.peers import sglang, skyrl, vllm
    from r3jax.serve.schema import output_json

    out = GenerateOutput([5, 6, 7], [float("-inf"), float("nan"), -0.5], "length", None, 3, 0, 0, 0)
    req = GenerateRequest([1, 2, 3], max_tokens=3)
    bodies = [output_json(out, [1, 2])[0], skyrl.render_generate(out, req, num_experts=8),
              vllm.render_completion(out, req, model="m", request_id="r", created=0, num_experts=8, text=""),
              sglang.render_generate(out, req, num_experts=8, rid="r", text="")]
    for body in bodies:
        text = json.dumps(body, allow_nan=True)
        assert "NaN" not in text and "Infinity" not in text, text
        assert "-9999.0" in text


BAD = [  # (path, body, status, the field the peer's error names)
    ("/skyrl/v1/generate", {"model": "m", "sampling_params": {"max_tokens": 2}}, 400, "token_ids"),
    ("/skyrl/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2,
                                                                      "routed_experts_prompt_start": 3}},
     400, "sampling_params.routed_experts_prompt_start"),
    ("/skyrl/v1/generate", {"token_ids": [1, 272]}, 400, "token_ids[1]"),
    ("/skyrl/v1/generate", {"token_ids": [1], "return_sample_support": True}, 400, "return_sample_support"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 2}}, 400, "sampling_params.n"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 63}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [[1], [2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1], "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": [1], "n": 257}, 400, "n"),
    ("/v1/completions", {"prompt": [1], "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": [1], "logprobs": 5}, 400, "logprobs"),
    ("/v1/completions", {"model": "other", "prompt": [1]}, 404, "model"),
    ("/generate", {"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3}, 400,
     "routed_experts_start_len"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "sampling_params.top_k"),
    ("/generate", {"input_ids": [1], "stream": True}, 400, "stream"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": 1}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "stop[0]"),
    ("/v1/completions", {"prompt": [1], "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": [1], "stop": ["a"] * 17}, 400, "stop"),
    ("/skyrl/v1/generate", {"token_ids": [1], "sampling_params": {"stop": ["a"]}}, 400, "sampling_params.stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200}, 400,
     "max_tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    # the engine's int32 / float32 limits (a top_k >= 2**31 used to fail the whole decode batch)
    ("/skyrl/v1/generate", {"token_ids": [1], "sampling_params": {"top_k": 2**31}}, 400, "sampling_params.top_k"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"top_k": 273}}, 400, "sampling_params.top_k"),
    ("/skyrl/v1/generate", {"token_ids": [1], "sampling_params": {"seed": 2**64}}, 400, "sampling_params.seed"),
    ("/v1/completions", {"prompt": [1], "top_k": 2**31}, 400, "top_k"),
    ("/v1/completions", {"prompt": [1], "stop_token_ids": [2**31]}, 400, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 2**63}, 400, "max_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 2**31}}, 400, "sampling_params.top_k"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "temperature": 1e39}}, 400,
     "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "sampling_seed": -2**63}}, 400,
     "sampling_params.sampling_seed"),
]


def _field(path: str, body: dict) -> str | None:
    err = body["error"]
    if path == "/generate":  # SGLang's body names no field: its message starts with it
        return err["message"].split("=")[0].split(":")[0]
    return err["param"]


@pytest.mark.parametrize("path,body,status,field", BAD)
def test_bad_input_is_the_peers_4xx(served, path, body, status, field):
    r = httpx.post(served[1] + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert _field(path, r.json()) == field, r.text
    if path != "/generate":  # vLLM's ErrorResponse (SkyRL reads error.message)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == status


def test_not_json_and_not_an_object(served):
    for path in ("/skyrl/v1/generate", "/inference/v1/generate", "/v1/completions", "/generate"):
        for content in (b"{not json", b"[1, 2]", b"7"):
            r = httpx.post(served[1] + path, content=content, timeout=60)
            assert r.status_code == 400 and "message" in r.json()["error"], (path, content, r.text)


SURROGATE = st.sampled_from(["\ud800", "a\udfff", "\udc00\ud800"])  # lone halves: valid JSON, not Unicode
DEEP = "deep:"  # a string "deep:N" is replaced by N nested lists in the raw body (no recursion to build it)
ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
                st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63, 2**64, -2**31 - 1, -2**63 - 1]),  # int32 / int64 edges
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), SURROGATE,
                st.integers(900, 1001).map(lambda n: f"{DEEP}{n}"),
                st.lists(st.integers(-5, 400), max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def dumps(obj) -> bytes:
    """The body as JSON bytes, each ``"deep:N"`` string replaced by a list nested N deep."""
    raw = json.dumps(obj, allow_nan=True)
    while f'"{DEEP}' in raw:
        i = raw.index(f'"{DEEP}')
        j = raw.index('"', i + 1)
        n = int(raw[i + 1 + len(DEEP):j])
        raw = raw[:i] + "[" * n + "1" + "]" * n + raw[j + 1:]
    return raw.encode()
_ids = st.one_of(st.lists(st.integers(0, 271), min_size=1, max_size=5), ODD)
_mt = st.one_of(st.integers(1, 3), ODD)
BODIES = {
    "/inference/v1/generate": st.fixed_dictionaries(
        {"token_ids": _ids}, optional={"sampling_params": st.one_of(st.fixed_dictionaries(
            {"max_tokens": _mt}, optional={"top_p": ODD, "top_k": ODD, "seed": ODD, "stop_token_ids": ODD}), ODD),
            "request_id": ODD}),
    "/skyrl/v1/generate": st.fixed_dictionaries(
        {"token_ids": _ids}, optional={"model": ODD, "sampling_params": st.one_of(st.fixed_dictionaries(
            {"max_tokens": _mt}, optional={"temperature": ODD, "top_k": ODD, "logprobs": ODD,
                                           "routed_experts_prompt_start": st.one_of(st.integers(0, 2), ODD)}), ODD),
            "junk": ODD}),
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": st.one_of(_ids, st.text(max_size=4)), "max_tokens": _mt},
        optional={"model": st.one_of(st.just("tiny"), ODD), "temperature": ODD, "seed": ODD, "logprobs": ODD,
                  "return_routed_experts": ODD, "routed_experts_prompt_start": st.one_of(st.integers(0, 2), ODD),
                  "stop_token_ids": ODD, "junk": ODD}),
    "/generate": st.fixed_dictionaries(
        {"input_ids": _ids}, optional={"sampling_params": st.one_of(st.fixed_dictionaries(
            {"max_new_tokens": _mt}, optional={"top_p": ODD, "top_k": ODD, "sampling_seed": ODD}), ODD),
            "return_routed_experts": ODD, "routed_experts_start_len": st.one_of(st.integers(0, 2), ODD),
            "return_logprob": ODD, "text": ODD, "junk": ODD}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), ODD),
             "content": st.one_of(st.text(max_size=4), ODD)}), max_size=3), ODD), "max_tokens": _mt},
        optional={"model": st.one_of(st.just("tiny"), ODD), "temperature": ODD, "logprobs": ODD, "n": ODD,
                  "top_logprobs": ODD, "tools": ODD, "junk": ODD}),
    "/detokenize": st.fixed_dictionaries({"tokens": _ids}, optional={"model": ODD}),
    "/tokenize": st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=4), ODD)}, optional={"model": ODD}),
}
BODIES["/v1/completions"] = st.one_of(BODIES["/v1/completions"], BODIES["/v1/completions"].map(  # more text prompts
    lambda b: {**b, "prompt": "Hi"}), st.fixed_dictionaries({"prompt": st.one_of(SURROGATE, ODD), "top_k": ODD}))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(sorted(BODIES)), data=st.data())
def test_fuzzed_peer_bodies_never_5xx(served, path, data):
    obj = data.draw(BODIES[path] if path != "/skyrl/v1/generate" else
                    st.one_of(BODIES[path], BODIES[path].map(lambda b: {**b, "sampling_params": {"max_tokens": 2}})))
    r = httpx.post(served[1] + path, content=dumps(obj), timeout=60)
    event(f"{path} HTTP {r.status_code}")
    assert r.status_code in (200, 400, 404), r.text
    assert r.headers["X-Weight-Version"] == str(served[0].weight_version)
    body = r.json()
    if r.status_code != 200:
        assert body["error"]["message"], r.text
    elif path in ("/skyrl/v1/generate", "/v1/completions"):
        assert 1 <= len(body["choices"][0]["token_ids"] or [0]) <= 64
    elif path == "/v1/chat/completions":
        assert body["object"] == "chat.completion" and isinstance(body["choices"][0]["message"]["content"], str)
    elif path == "/generate":
        assert 1 <= len(body["output_ids"]) <= 128


def test_tokenizer_endpoints_and_their_absence(serve_helpers):
    engine = serve_helpers.FakeEngine()
    with serve_helpers.thread_server(create_app(engine, tokenizer=ByteTokenizer(), served_model_name="m")) as srv:
        r = httpx.post(srv.url + "/tokenize", json={"model": "m", "prompt": "Hi!"})
        assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [72, 105, 33], "token_strs": None}
        assert httpx.post(srv.url + "/detokenize", json={"model": "m", "tokens": [72, 105]}).json() == {"prompt": "Hi"}
        # vLLM's chat form: the ids /v1/chat/completions prompts with
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        ids = ByteTokenizer().chat_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}])
        r = httpx.post(srv.url + "/tokenize", json={"model": "m", "messages": chat, "add_generation_prompt": True})
        assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
        done = httpx.post(srv.url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 1,
                                                                   "return_token_ids": True}).json()
        assert done["prompt_token_ids"] == ids
        for body, field in (({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]},
                                                             "messages[0].role"),
                            ({"messages": chat, "tools": [{"type": "function"}]}, "tools"),
                            ({"messages": chat, "add_generation_prompt": False}, "add_generation_prompt")):
            r = httpx.post(srv.url + "/tokenize", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        r = httpx.post(srv.url + "/finish_session", params={"session_id": "nobody"})
        assert r.status_code == 200 and r.json()["known"] is False
    with serve_helpers.thread_server(create_app(engine)) as srv:
        for path, body, field in (("/detokenize", {"tokens": [1]}, "tokens"), ("/tokenize", {"prompt": "x"}, "prompt"),
                                  ("/v1/completions", {"prompt": "x"}, "prompt"), ("/generate", {"text": "x"}, None)):
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"], (path, r.text)
            if field is not None:
                assert r.json()["error"]["param"] == field


def test_openapi_documents_every_endpoint_and_auth_covers_them(serve_helpers):
    engine = serve_helpers.FakeEngine()
    app = create_app(engine, api_key="k", served_model_name="m")
    routes = {r.path for r in app.routes if getattr(r, "include_in_schema", False)}
    with serve_helpers.thread_server(app) as srv:
        spec = httpx.get(srv.url + "/openapi.json").json()  # no token needed
        assert routes <= set(spec["paths"]) and {"/skyrl/v1/generate", "/inference/v1/generate", "/v1/completions",
                                                 "/v1/models", "/generate", "/tokenize", "/detokenize"} <= routes
        sky = spec["paths"]["/skyrl/v1/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"token_ids", "model", "sampling_params"} <= set(sky["properties"])
        assert "routed_experts_prompt_start" in sky["properties"]["sampling_params"]["properties"]
        sg = spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"input_ids", "return_routed_experts", "routed_experts_start_len"} <= set(sg["properties"])
        vl = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"prompt", "routed_experts_prompt_start", "return_routed_experts"} <= set(vl["properties"])
        for path in ("/skyrl/v1/generate", "/v1/completions", "/generate", "/detokenize"):
            assert httpx.post(srv.url + path, json={}).status_code == 401, path
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        req = GenerateRequest([1, 2], max_tokens=2, return_routed_experts=True)
        info = {"num_experts": 8, "top_k": 2, "moe_layer_ids": [1, 2], "vocab_size": 272}
        for protocol in ("skyrl", "vllm", "sglang"):
            with RemoteInferenceClient(srv.url, protocol=protocol, api_key="k", model="m", model_info=info) as c:
                [out] = c.generate([req])
            assert out.routed_experts.shape == (3, 2, 2)
            with RemoteInferenceClient(srv.url, protocol=protocol, model="m", model_info=info) as c, \
                    pytest.raises(RemoteInputError) as e:
                c.generate([req])
            assert e.value.status == 401


# ---- one bad request never fails another; no body causes a 5xx ------------------------------------

def _generate_body(path: str, prompt: list[int], **sp) -> dict:
    """A greedy 4-token request for ``prompt`` in ``path``'s own form, plus sampling fields ``sp``."""
    sp = {"temperature": 0.0, **sp}
    if path == "/v1/generate":
        return {"prompt_ids": prompt, "sampling_params": {"max_tokens": 4, **sp}}
    if path == "/v1/completions":
        return {"prompt": prompt, "max_tokens": 4, "return_token_ids": True, **sp}
    if path == "/generate":
        return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, **sp}}
    return {"token_ids": prompt, "sampling_params": {"max_tokens": 4, **sp}}  # SkyRL's two paths


def _output_ids(path: str, body: dict) -> list[int]:
    return body["output_ids"] if path in ("/v1/generate", "/generate") else body["choices"][0]["token_ids"]


GENERATE_PATHS = ["/v1/generate", "/v1/completions", "/skyrl/v1/generate", "/inference/v1/generate", "/generate"]


@contextlib.contextmanager
def _scheduler_paused(engine):
    """Hold the engine's scheduler in a control step, so requests queue and none is admitted until
    the block ends: the bad request then meets the others in the scheduler, whatever the timing."""
    inside, release = threading.Event(), threading.Event()

    def pause():
        inside.set()
        release.wait(120)

    holder = threading.Thread(target=engine._sched.control, args=(pause,), kwargs={"drain": False, "abort": False})
    holder.start()
    assert inside.wait(60)
    try:
        yield
    finally:
        release.set()
        holder.join(60)


def _in_flight(url: str) -> int:
    return httpx.get(url + "/v1/stats", timeout=60).json()["in_flight"]


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_top_k_beyond_int32_is_4xx_and_the_six_requests_beside_it_complete(served, path):
    """Before, ``top_k = 2**31`` passed the parsers and raised OverflowError while the scheduler built
    the decode batch's int32 arrays: that request and every request beside it got a 500."""
    engine, url = served
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(6)]
    want = [o.output_ids for o in engine.generate(
        [GenerateRequest(p, max_tokens=4, temperature=0.0) for p in prompts])]
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        with _scheduler_paused(engine):
            innocent = [pool.submit(httpx.post, url + path, json=_generate_body(path, p), timeout=120)
                        for p in prompts]
            while _in_flight(url) < 6:  # all six queued in the engine before the bad one arrives
                pass
            bad = pool.submit(httpx.post, url + path, json=_generate_body(path, [1, 2], top_k=2**31), timeout=120)
            while not bad.done() and _in_flight(url) < 7:  # refused at once, or queued beside them
                pass
        answers = [f.result() for f in innocent]
        refused = bad.result()
    assert refused.status_code == (422 if path == "/v1/generate" else 400), refused.text
    assert "top_k" in refused.text and "2147483648" in refused.text
    assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
    assert [_output_ids(path, r.json()) for r in answers] == want


SURROGATE_BODIES = [  # (path, raw body, the field the error names); "\ud800" is valid JSON, not valid Unicode
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/generate", b'{"text": "\\ud800"}', "text"),
    ("/generate", b'{"text": "ok \\udfff", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/skyrl/v1/generate", b'{"token_ids": [1], "model": "\\udc00"}', "model"),
    ("/v1/completions", b'{"prompt": [1], "\\ud800": 1}', "\\ud800 (a key)"),
    ("/v1/generate", b'{"prompt_ids": [1], "session_id": "x\\ud800"}', "session_id"),
]


@pytest.mark.parametrize("path,raw,field", SURROGATE_BODIES)
def test_lone_surrogates_are_4xx_naming_the_field(served, path, raw, field):
    r = httpx.post(served[1] + path, content=raw, timeout=60)
    assert r.status_code == (422 if path == "/v1/generate" else 400), r.text
    err = r.json()
    named = err["field"] if path == "/v1/generate" else _field(path, err) if path != "/generate" else \
        err["error"]["message"].split("=")[0]
    assert named == field and "valid Unicode" in r.text, r.text
    ok = httpx.post(served[1] + path, content=raw.replace(b"\\ud800", b"A").replace(b"\\udfff", b"B")
                    .replace(b"\\udc00", b"C"), timeout=60)
    assert ok.status_code in (200, 400), ok.text  # the same body with valid text is read normally
    assert "valid Unicode" not in ok.text


DEEP_FIELDS = [("/v1/completions", "prompt"), ("/skyrl/v1/generate", "token_ids"), ("/inference/v1/generate", "token_ids"),
               ("/generate", "input_ids"), ("/detokenize", "tokens"), ("/tokenize", "prompt"), ("/v1/generate", "prompt_ids")]


@pytest.mark.parametrize("path,key", DEEP_FIELDS)
def test_token_lists_nested_to_the_json_limit_are_4xx(served, path, key):
    """Every depth up to the point the JSON reader gives up: the error message is built without
    recursing (before, depths around 960 raised RecursionError while formatting it: a 500)."""
    statuses = set()
    for depth in range(900, 1002):
        raw = f'{{"{key}": {"[" * depth}1{"]" * depth}}}'.encode()
        r = httpx.post(served[1] + path, content=raw, timeout=60)
        assert r.status_code in (400, 422), (depth, r.status_code, r.text[:200])
        statuses.add(r.status_code)
    assert statuses <= ({400, 422} if path == "/v1/generate" else {400})


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_every_generate_answer_carries_x_weight_version(served, path):
    engine, url = served
    version = str(engine.weight_version)
    ok = httpx.post(url + path, json=_generate_body(path, [5, 6, 7]), timeout=60)
    bad = httpx.post(url + path, json=_generate_body(path, [5, 6, 7], top_k=-5), timeout=60)
    not_json = httpx.post(url + path, content=b"{", timeout=60)
    assert ok.status_code == 200 and bad.status_code in (400, 422) and not_json.status_code == 400
    for r in (ok, bad, not_json):
        assert r.headers.get("X-Weight-Version") == version, (r.status_code, dict(r.headers))
    if path == "/v1/generate":
        assert ok.json()["weight_version"] == engine.weight_version


@pytest.mark.parametrize("mode", ["keep", "abort"])
@pytest.mark.parametrize("protocol", ["r3jax", "skyrl", "vllm", "sglang"])
def test_weight_version_spans_and_aborts_reach_each_protocols_client(served, serve_helpers, protocol, mode):
    """A weight update lands while a request of ``protocol`` runs, on any machine: a second request's
    token callback holds the scheduler until the HTTP request is queued, then again, once both have run
    a while, until the update is queued. ``keep``: the client reads spans ``[(0, v), (k, v + 1)]`` from
    the protocol's own field (SGLang's ``meta_info.weight_versions``, the others' ``weight_versions``)
    and the request runs to its length; ``abort``: finish "abort" with the old version's tokens and
    their route rows ``P + G - 1``."""
    import jax

    engine, url = served
    params = nnx.state(MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0)), nnx.Param)  # the fixture's weights
    req = GenerateRequest([3, 4, 5], max_tokens=50, temperature=0.0, return_routed_experts=True)
    version = engine.weight_version
    with RemoteInferenceClient(url, protocol=protocol, model="tiny") as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        # the second hold comes a few decode calls later: a call dispatched before the HTTP request was
        # admitted may still be read after the first hold
        held = serve_helpers.HeldRequest(engine, at=(2, 34))
        held.reached(2)
        running = pool.submit(lambda: client.generate([req])[0])
        held.until(lambda: len(engine._sched.waiting) == 1)  # queued behind the held scheduler
        held.release(2)
        held.reached(34)  # both running since
        swap = pool.submit(engine.set_weights, jax.tree.map(lambda x: x * 1.5, params), mode=mode)
        held.until(lambda: len(engine._sched.controls) == 1)
        held.release(34)
        new, out = swap.result(timeout=120), running.result(timeout=120)
        held.future.result(timeout=120)
    engine.set_weights(params)  # back to the fixture's weights (a new version)
    assert new == version + 1
    g = len(out.output_ids)
    if mode == "keep":
        assert out.finish_reason == "length" and g == 50
        [(zero, v0), (k, v1)] = out.weight_versions
        assert (zero, v0, v1) == (0, version, version + 1) and 0 < k < 50
    else:
        assert out.finish_reason == "abort" and 1 <= g < 50
        assert tuple(out.weight_versions) == ((0, version),)
        assert out.routed_experts.shape == (3 + g - 1, 2, 2)


def test_chat_through_a_model_directorys_chat_template(tmp_path, serve_helpers):
    """`--tokenizer auto` on a model directory: tokenizer.json plus tokenizer_config.json's
    chat_template (ChatML here, a byte-level BPE made in the test) render chat requests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from r3jax.serve.server import build_tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chatml,
                                                                "eos_token": {"content": "<|im_end|>"}}))
    tok = build_tokenizer("auto", str(tmp_path), 272)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = raw.encode(text, add_special_tokens=False).ids
    assert tok.chat_ids(messages) == ids
    engine = serve_helpers.FakeEngine()
    with serve_helpers.thread_server(create_app(engine, tokenizer=tok, served_model_name="m")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                               "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["prompt_token_ids"] == ids
        choice = body["choices"][0]
        assert choice["token_ids"] == [(sum(ids) + t) % 272 for t in range(3)]  # the stand-in engine's reply
        assert choice["message"]["content"] == raw.decode(choice["token_ids"], skip_special_tokens=False)
        # this template reads no tools: a body with tools is a 400 naming them
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "tools": [{"type": "function"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    # a template that renders tools (and earlier tool calls) gets them
    with_tools = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}{% for m in messages %}<|im_start|>"
                  "{{ m['role'] }}\n{{ m['content'] }}{% for c in m.get('tool_calls', []) %}<tool_call>"
                  "{{ c['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": with_tools}))
    tok = build_tokenizer("auto", str(tmp_path), 272)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    turns = messages + [{"role": "assistant", "content": None,
                         "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c0", "content": "3"}]
    long = serve_helpers.FakeEngine(max_seq_len=512)  # the tool definitions make a long prompt
    with serve_helpers.thread_server(create_app(long, tokenizer=tok, served_model_name="m",
                                                tool_call_parser="hermes")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": turns, "tools": tools, "max_tokens": 2,
                                                               "return_token_ids": True})
        assert r.status_code == 200, r.text
        rendered = raw.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
        assert rendered.startswith('<tools>[{"type": "function", "function": {"name": "add"')
        assert '<tool_call>{"name": "add", "arguments": "{}"}</tool_call><|im_end|>' in rendered
        assert rendered.endswith("<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    # a tokenizer without a template has no chat: 400 naming messages
    (tmp_path / "tokenizer_config.json").write_text("{}")
    plain = build_tokenizer("auto", str(tmp_path), 272)
    with serve_helpers.thread_server(create_app(engine, tokenizer=plain, served_model_name="m")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "chat tokenizer" in r.json()["error"]["message"]


def test_text_stream_never_splits_a_utf8_character():
    from r3jax.serve.peers.stream import TextStream

    tok = ByteTokenizer()
    text = "Zürich costs 5 € 🙂"
    ts = TextStream(tok.decode)
    deltas = [ts.push([b]) for b in text.encode()] + [ts.flush()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "ü"  # 0xC3 alone is held back until 0xBC completes it


def test_a_streamed_reply_with_stop_strings_joins_to_the_cut_text_over_random_bytes():
    """Random bytes (invalid UTF-8 included), a stop string taken from the decoded text: the stream's
    deltas, limited by the stop string's start as soon as it is known, join to the cut text."""
    from r3jax.serve.peers.stream import StopWatch, TextStream

    tok, rng = ByteTokenizer(), np.random.default_rng(0)
    checked = 0
    for _ in range(1500):
        ids = rng.integers(0, 256, 12).tolist()
        text = tok.decode(ids)
        if len(text) < 6:
            continue
        watch = StopWatch([text[4:6]], tok.decode)
        stream = TextStream(tok.decode, hold=watch.hold)
        deltas = []
        for t in ids:
            stop = watch(t)
            deltas.append(stream.push([t], watch.cut))
            if stop:
                break
        deltas.append(stream.flush(watch.cut))
        assert "".join(deltas) == watch.text(tok.decode(watch.ids)), ids
        checked += 1
    assert checked > 1000


def _events(lines):
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_joins_to_the_answer_it_streams(served, path):
    """Token chunks as they arrive, routes on the chunk with finish_reason, usage last, [DONE]: joined,
    the same text, token ids, logprobs and route rows as the same request not streamed."""
    engine, url = served
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": FIRST}
    body = {**ask, "max_tokens": 12, "temperature": 0.0, "logprobs": True if chat else 0, "return_token_ids": True,
            "return_routed_experts": True, "routed_experts_prompt_start": 2}
    whole = httpx.post(url + path, json=body, timeout=120).json()
    with httpx.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = _events(lines)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    choices = [e["choices"][0] for e in events[:-1]]
    want = whole["choices"][0]
    assert sum((c["token_ids"] or [] for c in choices), []) == want["token_ids"]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == [want["finish_reason"]]
    assert choices[-1]["finish_reason"] and choices[-1]["routed_experts"] == want["routed_experts"]
    assert all(c["routed_experts"] is None for c in choices[:-1])
    if chat:
        assert "".join(c["delta"].get("content", "") for c in choices) == want["message"]["content"]
        assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        lps = [x["logprob"] for c in choices if c["logprobs"] for x in c["logprobs"]["content"]]
        assert lps == [x["logprob"] for x in want["logprobs"]["content"]]
    else:
        assert "".join(c["text"] for c in choices) == want["text"]
        lps = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert lps == want["logprobs"]["token_logprobs"]


def test_openai_client_streams_chat_and_completions(served):
    openai = pytest.importorskip("openai")
    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.0)
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.0,
                                                stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # completions: text, token ids and the last chunk's routes join to the non-streamed answer
    extra = {"return_token_ids": True, "return_routed_experts": True}
    whole = client.completions.create(model="tiny", prompt=FIRST, max_tokens=6, temperature=0.0, extra_body=extra)
    parts = list(client.completions.create(model="tiny", prompt=FIRST, max_tokens=6, temperature=0.0, stream=True,
                                           extra_body=extra))
    want = whole.choices[0]
    assert "".join(p.choices[0].text for p in parts) == want.text
    assert sum((p.choices[0].model_extra["token_ids"] or [] for p in parts), []) == want.model_extra["token_ids"]
    assert parts[-1].choices[0].model_extra["routed_experts"] == want.model_extra["routed_experts"]


def test_a_dropped_stream_frees_its_request(served):
    engine, url = served
    before = engine.stats["cancelled"]
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": FIRST, "max_tokens": 55, "temperature": 0.0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the client leaves
    deadline = time.time() + 30
    while time.time() < deadline and not (engine.stats["live_slots"] == 0 and engine.stats["cancelled"] > before):
        time.sleep(0.05)
    assert engine.stats["live_slots"] == 0 and engine.stats["cancelled"] == before + 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_string_ends_the_reply_streamed_or_not(served, path):
    """vLLM's stop strings: the request stops at the token that completes one; the text ends before
    it, finish_reason "stop", stop_reason the string; token ids and route rows are the unstopped run's
    prefix; a stream (the string spans tokens, so chunks) joins to the same cut text."""
    engine, url = served
    chat = path.endswith("chat/completions")
    ask = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": FIRST}
    body = {**ask, "max_tokens": 24, "temperature": 0.0, "return_token_ids": True, "return_routed_experts": True}
    read = (lambda c: c["message"]["content"]) if chat else (lambda c: c["text"])
    full = httpx.post(url + path, json=body, timeout=120).json()["choices"][0]
    text = read(full)
    stop = text[4:6]  # two bytes of the tiny model's greedy reply: two tokens
    assert len(stop) == 2 and text.index(stop) == 4, text
    cut = httpx.post(url + path, json={**body, "stop": ["never-said", stop]}, timeout=120).json()["choices"][0]
    assert read(cut) == text[:4] and cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    g = len(cut["token_ids"])
    assert cut["token_ids"] == full["token_ids"][:g] and ByteTokenizer().decode(cut["token_ids"]).endswith(stop)
    routes = lambda c: np.load(io.BytesIO(base64.b64decode(c["routed_experts"])))
    np.testing.assert_array_equal(routes(cut), routes(full)[:len(routes(cut))])
    assert len(routes(full)) - len(routes(cut)) == len(full["token_ids"]) - g
    with httpx.stream("POST", url + path, json={**body, "stop": stop, "stream": True}, timeout=120) as r:
        choices = [e["choices"][0] for e in _events([line for line in r.iter_lines() if line])]
    joined = "".join(c["delta"].get("content", "") if chat else c["text"] for c in choices)
    assert joined == text[:4] and choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop
    assert sum((c["token_ids"] or [] for c in choices), []) == cut["token_ids"]
