"""The HTTP server around the real tiny Engine (uvicorn in a thread on a free loopback port):
round trip equals the in-process engine, every bad input is a 4xx naming its field, a fuzz finds no
5xx, auth, model info / OpenAPI, and weight updates from orbax and safetensors directories."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateRequest
from r3jax.serve import RemoteInferenceClient, RemoteInputError, create_app

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def model():
    return MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))


# the engine tests' configuration (tests/r3jax/engine/conftest.py): run together, they share programs
ENGINE_KW = dict(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, block_size=8, prefill_chunk=32,
                 prefill_rows=2, decode_buckets=1, moe_impl="dense")


@pytest.fixture(scope="module")
def served(serve_helpers, model):
    engine = Engine(model, **ENGINE_KW)
    with serve_helpers.thread_server(create_app(engine, max_body_bytes=64 << 10)) as srv:  # waits for warm-up
        yield engine, srv.url
    engine.close()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[1], timeout=60) as client:
        yield client


def same(a, b) -> None:
    """Two GenerateOutputs are equal field by field (routes: values and dtype)."""
    assert (a.output_ids, a.logprobs, a.finish_reason) == (b.output_ids, b.logprobs, b.finish_reason)
    assert (a.prompt_tokens, a.cached_tokens, a.weight_version, a.routed_experts_start) == \
        (b.prompt_tokens, b.cached_tokens, b.weight_version, b.routed_experts_start)
    if b.routed_experts is None:
        assert a.routed_experts is None
    else:
        assert a.routed_experts.dtype == b.routed_experts.dtype
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


REQUESTS = [
    GenerateRequest([5, 6, 7, 8, 9], max_tokens=4, temperature=0.0, return_routed_experts=True),
    GenerateRequest([5, 6, 7, 8, 9], max_tokens=4, temperature=0.0, return_routed_experts=True,
                    routed_experts_prompt_start=3, session_id="a"),
    GenerateRequest([11, 3], max_tokens=4, temperature=0.0, return_routed_experts=True, routed_experts_prompt_start=2),
    GenerateRequest([1, 2, 3], max_tokens=4, temperature=0.9, top_k=20, top_p=0.9, seed=123, stop_token_ids=(7, 9),
                    return_routed_experts=True, routed_experts_prompt_start=1),
    GenerateRequest([4, 4, 4], max_tokens=3, seed=7, return_logprobs=False),
]


@pytest.mark.parametrize("binary", [True, False])
def test_round_trip_equals_in_process_engine(served, binary):
    engine, url = served
    with RemoteInferenceClient(url, binary_routes=binary) as client:
        for req in REQUESTS:
            [remote] = client.generate([req])
            [local] = engine.generate([req])
            same(remote, local)
            if req.return_routed_experts:
                p, s, g = len(req.prompt_ids), req.routed_experts_prompt_start, len(remote.output_ids)
                assert remote.routed_experts.shape == (p - s + g - 1, 2, 2)


def test_json_wire_form(served, monkeypatch):
    import r3jax.serve.dispatch as app_module

    engine, url = served
    body = {"prompt_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_tokens": 4, "temperature": 0.0,
                                                               "routed_experts_prompt_start": 3},
            "return_routed_experts": True}
    r = httpx.post(url + "/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    monkeypatch.setattr(app_module, "OFFLOAD_BYTES", 0)  # large-payload path: encoded in a thread
    assert httpx.post(url + "/v1/generate", json=body, timeout=60).content == r.content
    obj = r.json()
    assert set(obj) == {"output_ids", "logprobs", "finish_reason", "routed_experts", "prompt_tokens",
                        "cached_tokens", "weight_version", "weight_versions"}
    assert obj["weight_versions"] == [[0, obj["weight_version"]]]
    wire = obj["routed_experts"]
    assert (wire["shape"], wire["dtype"], wire["start"], wire["layers"]) == ([5 - 3 + 4 - 1, 2, 2], "uint8", 3, [1, 2])
    [local] = engine.generate([REQUESTS[1]])
    assert obj["output_ids"] == local.output_ids and obj["logprobs"] == local.logprobs


def body(**sp):
    return {"prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, **sp}}


BAD = [  # (raw body or JSON object, status, field)
    (b"{not json", 400, "body"),
    (b"\xff\xfe", 400, "body"),
    (b"[" * 50_000, 400, "body"),
    ([1, 2], 422, "body"),
    ({}, 422, "prompt_ids"),
    ({"prompt_ids": "1 2 3"}, 422, "prompt_ids"),
    ({"prompt_ids": []}, 422, "prompt_ids"),
    ({"prompt_ids": [1, True]}, 422, "prompt_ids[1]"),
    ({"prompt_ids": [1, 2.0]}, 422, "prompt_ids[1]"),
    ({"prompt_ids": [1, 272]}, 422, "prompt_ids[1]"),
    ({"prompt_ids": [-1]}, 422, "prompt_ids[0]"),
    ({"prompt_ids": [1] * MAX_SEQ_LEN}, 422, "prompt_ids"),
    ({"prompt_ids": [1], "extra": 1}, 422, "extra"),
    ({"prompt_ids": [1], "sampling_params": []}, 422, "sampling_params"),
    (body(max_token=3), 422, "sampling_params.max_token"),
    (body(max_tokens=True), 422, "sampling_params.max_tokens"),
    (body(max_tokens=2.0), 422, "sampling_params.max_tokens"),
    (body(max_tokens=0), 422, "sampling_params.max_tokens"),
    (body(max_tokens=MAX_SEQ_LEN - 2), 422, "sampling_params.max_tokens"),
    (body(max_tokens=10**30), 422, "sampling_params.max_tokens"),
    (body(routed_experts_prompt_start=-1), 422, "sampling_params.routed_experts_prompt_start"),
    (body(routed_experts_prompt_start=4), 422, "sampling_params.routed_experts_prompt_start"),
    (body(routed_experts_prompt_start=False), 422, "sampling_params.routed_experts_prompt_start"),
    (body(routed_experts_prompt_start="0"), 422, "sampling_params.routed_experts_prompt_start"),
    (body(temperature=-0.5), 422, "sampling_params.temperature"),
    (body(temperature="hot"), 422, "sampling_params.temperature"),
    (b'{"prompt_ids": [1], "sampling_params": {"temperature": NaN}}', 422, "sampling_params.temperature"),
    (b'{"prompt_ids": [1], "sampling_params": {"top_p": Infinity}}', 422, "sampling_params.top_p"),
    (body(top_p=0.0), 422, "sampling_params.top_p"),
    (body(top_k=-1), 422, "sampling_params.top_k"),
    (body(top_k=273), 422, "sampling_params.top_k"),
    (body(top_k=2**31), 422, "sampling_params.top_k"),
    (body(temperature=1e39), 422, "sampling_params.temperature"),  # float32 would make it inf
    (body(seed=-1), 422, "sampling_params.seed"),
    (body(seed=2**64), 422, "sampling_params.seed"),
    (body(stop_token_ids=[1, 999]), 422, "sampling_params.stop_token_ids[1]"),
    (body(stop_token_ids=5), 422, "sampling_params.stop_token_ids"),
    (body(n=0), 422, "sampling_params.n"),
    (body(n=257), 422, "sampling_params.n"),
    (body(n="3"), 422, "sampling_params.n"),
    (body(n=True), 422, "sampling_params.n"),
    ({"prompt_ids": [1], "return_routed_experts": 1}, 422, "return_routed_experts"),
    ({"prompt_ids": [1], "return_logprobs": "yes"}, 422, "return_logprobs"),
    ({"prompt_ids": [1], "session_id": 5}, 422, "session_id"),
    ({"prompt_ids": [1], "session_id": "s" * 300}, 422, "session_id"),
    (b'{"prompt_ids": [1], "session_id": "\\ud800"}', 422, "session_id"),  # a lone surrogate: not Unicode text
    (b'{"prompt_ids": [1], "sampling_params": {"\\udc00": 1}}', 422, "sampling_params.\\udc00 (a key)"),
    (b'{"prompt_ids": ' + b"[" * 960 + b"1" + b"]" * 960 + b"}", 422, "prompt_ids[0]"),
    (b'{"prompt_ids": [' + b"1," * 40_000 + b"1]}", 413, "body"),
]


@pytest.mark.parametrize("raw,status,field", BAD, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(BAD)])
def test_bad_input_is_4xx_naming_the_field(http, raw, status, field):
    content = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    r = http.post("/v1/generate", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["error"] == "invalid_request" and err["field"] == field
    assert field.split(".")[-1].split("[")[0] in err["detail"] or field == "body"
    assert http.get("/health").status_code == 200  # still serving


def test_streamed_body_over_limit_is_413(http):

    def chunks():  # no Content-Length: the limit must be enforced while reading
        yield b'{"prompt_ids": ['
        for _ in range(20):
            yield b"1," * 4000
        yield b"1]}"
    r = http.post("/v1/generate", content=chunks())
    assert r.status_code == 413 and r.json()["field"] == "body"
    ok = http.post("/v1/generate", json=body(temperature=0.0))
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


_any = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
                 st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63, 2**64, -2**31 - 1]),  # int32 / int64 edges
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                 st.sampled_from(["\ud800", "a\udfff", "\udc00\ud800"]),  # lone surrogates: JSON, not Unicode
                 st.lists(st.integers(-5, 400), max_size=6), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_valid_sp = st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}, optional={ "temperature": st.sampled_from([0.0, 0.7, 1]), "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.integers(0, 50), "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "stop_token_ids": st.lists(st.integers(0, 271), max_size=3), "routed_experts_prompt_start": st.integers(0, 1)})
_sp = st.one_of(_valid_sp, st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed",
                                                            "stop_token_ids", "routed_experts_prompt_start", "bogus"]),
                                           _any, max_size=4), _any)
_body = st.fixed_dictionaries(  # sampling_params always present: few distinct engine shapes
    {"prompt_ids": st.one_of(st.lists(st.integers(0, 271), min_size=1, max_size=6), _any), "sampling_params": _sp},
    optional={"return_routed_experts": st.one_of(st.booleans(), _any),
              "return_logprobs": st.one_of(st.booleans(), _any), "session_id": st.one_of(st.none(), st.text(max_size=4), _any),
              "junk": _any})


_valid_body = st.fixed_dictionaries(
    {"prompt_ids": st.lists(st.integers(0, 271), min_size=1, max_size=6), "sampling_params": _valid_sp},
    optional={"return_routed_experts": st.booleans(), "return_logprobs": st.booleans(),
              "session_id": st.one_of(st.none(), st.text(max_size=4))})


_deep = st.integers(900, 1001).map(lambda n: b'{"prompt_ids": [1], "sampling_params": {"stop_token_ids": ' + b"[" * n
                                   + b"1" + b"]" * n + b"}}")  # nested to the JSON reader's limit


@pytest.fixture(scope="module")
def host_only(serve_helpers):
    """The same app over a JAX-free engine: every check a body meets before device work, no device."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(serve_helpers.FakeEngine(max_seq_len=MAX_SEQ_LEN), max_body_bytes=64 << 10)) as c:
        yield c


def _post_fuzzed(client, obj, raw):
    content = raw if raw is not None else json.dumps(obj, allow_nan=True).encode()
    r = client.post("/v1/generate", content=content)
    event(f"HTTP {r.status_code}")
    assert r.status_code in (200, 400, 422), r.text
    assert r.headers["X-Weight-Version"].lstrip("-").isdigit()
    out = r.json()
    if r.status_code == 200:
        assert 1 <= len(out["output_ids"]) <= obj["sampling_params"].get("max_tokens", 16)
    else:
        assert out["error"] == "invalid_request" and isinstance(out["field"], str) and out["detail"]
    return r.status_code, out.get("field")


_fuzz_bodies = dict(obj=st.one_of(_valid_body, _body, _body, _any),
                    raw=st.one_of(st.none(), st.none(), st.none(), st.binary(max_size=20), _deep))


# The validation runs on the host before any device work: many bodies against it, a few on the engine
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(**_fuzz_bodies)
def test_fuzzed_bodies_never_5xx_host_side(host_only, obj, raw):
    _post_fuzzed(host_only, obj, raw)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(**_fuzz_bodies)
def test_fuzzed_bodies_never_5xx_and_the_engine_agrees_with_the_host_checks(http, host_only, obj, raw):
    assert _post_fuzzed(http, obj, raw) == _post_fuzzed(host_only, obj, raw)


def test_auth_on_and_off(served, serve_helpers):
    engine, open_url = served
    ok = {"prompt_ids": [1, 2], "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
    assert httpx.post(open_url + "/v1/generate", json=ok, timeout=60).status_code == 200  # auth off: no token needed
    with serve_helpers.thread_server(create_app(engine, api_key="s3cret")) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cre"}, {"Authorization": "Bearer s3cret2"}):
            for method, path in (("POST", "/v1/generate"), ("GET", "/v1/model"), ("POST", "/v1/weights")):
                r = httpx.request(method, srv.url + path, json=ok, headers=headers, timeout=60)
                assert r.status_code == 401 and r.json()["field"] == "Authorization", (headers, path)
        assert httpx.get(srv.url + "/health").status_code == 200  # liveness stays open
        r = httpx.post(srv.url + "/v1/generate", json=ok, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert r.status_code == 200
        req = GenerateRequest([1, 2], max_tokens=2, temperature=0.0)
        with RemoteInferenceClient(srv.url, api_key="s3cret") as client:
            assert client.generate([req])[0].output_ids == r.json()["output_ids"]
        with RemoteInferenceClient(srv.url) as client, pytest.raises(RemoteInputError) as e:
            client.generate([req])
        assert e.value.status == 401


def test_model_info_health_and_openapi(served):
    engine, url = served
    with RemoteInferenceClient(url) as client:
        info = client.model_info()
        assert client.health() == {url: True}
    assert info == {"num_experts": 8, "top_k": 2, "num_moe_layers": 2, "moe_layer_ids": [1, 2], "vocab_size": 272,
                    "max_seq_len": MAX_SEQ_LEN, "weight_version": engine.weight_version}
    spec = httpx.get(url + "/openapi.json").json()
    assert {"/health", "/v1/model", "/v1/generate", "/v1/weights"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert "prompt_ids" in schemas["GenerateBody"]["properties"]
    assert "routed_experts_prompt_start" in schemas["SamplingParams"]["properties"]
    assert "routed_experts" in schemas["GenerateResponse"]["properties"]


def test_weight_updates_orbax_and_safetensors(served, model, tmp_path):
    """Load other weights (orbax) -> outputs change; load the original ones back (safetensors) ->
    outputs are bit-identical to before: the loaded weights are the ones served."""
    import jax

    from models.hf import save_pretrained
    from r3jax.train import export_params

    engine, url = served
    params = nnx.state(model, nnx.Param)
    req = GenerateRequest([5, 6, 7, 8, 9], max_tokens=3, temperature=0.0, return_routed_experts=True)
    with RemoteInferenceClient(url) as client:
        [before] = client.generate([req])
        v0 = engine.weight_version
        flipped = jax.tree.map(lambda x: -np.asarray(x), params)  # negated router logits: other experts, other tokens
        assert client.update_weights(str(export_params(tmp_path / "orbax", flipped)), "orbax") == [v0 + 1]
        [after] = client.generate([req])
        assert after.weight_version == v0 + 1
        assert not np.array_equal(after.routed_experts, before.routed_experts)

        reshaped = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype), params)
        for raw, field in ((b'{"path": "/nonexistent", "format": "orbax"}', "path"),
                           (b'{"path": "/tmp", "format": "pickle"}', "format"),
                           (b'{"path": 3, "format": "orbax"}', "path"),
                           (json.dumps({"path": str(tmp_path / "orbax"), "format": "safetensors"}).encode(), "path"),
                           (json.dumps({"path": str(export_params(tmp_path / "bad", reshaped)),
                                        "format": "orbax"}).encode(), "path")):
            r = httpx.post(url + "/v1/weights", content=raw, timeout=60)
            assert r.status_code == 422 and r.json()["field"] == field, r.text
        assert engine.weight_version == v0 + 1  # refused loads change nothing
        good = str(export_params(tmp_path / "orbax", flipped))
        for version in (v0 + 1, True, "9"):  # not above the current one; not an int
            r = httpx.post(url + "/v1/weights", json={"path": good, "format": "orbax", "weight_version": version})
            assert r.status_code == 422 and r.json()["field"] == "weight_version", r.text
        assert engine.weight_version == v0 + 1
        r = httpx.post(url + "/v1/weights", json={"path": good, "format": "orbax", "weight_version": v0 + 10})
        assert r.status_code == 200 and r.json() == {"weight_version": v0 + 10}  # the trainer's numbering
        v0 = v0 + 10 - 1  # so the pushes below read as before: v0 + 1 is the current version

        save_pretrained(model, tmp_path / "hf")
        assert client.update_weights(str(tmp_path / "hf"), "safetensors") == [v0 + 2]
        [back] = client.generate([req])
    assert back.weight_version == v0 + 2
    assert back.output_ids == before.output_ids and back.logprobs == before.logprobs
    np.testing.assert_array_equal(back.routed_experts, before.routed_experts)


def test_weight_pushes_of_unreadable_files_are_4xx_and_change_nothing(served, model, tmp_path):
    """A junk or empty ``.safetensors`` and a ``config.json`` of ``[]`` are refused (422 naming
    ``path`` and the file) before anything is loaded; the engine keeps its weights and version."""
    import shutil

    from models.hf import save_pretrained

    engine, url = served
    good = save_pretrained(model, tmp_path / "good") or tmp_path / "good"
    cases = {  # directory name -> (file to overwrite, its new bytes, words the error must contain)
        "junk": ("model.safetensors", bytes(range(256)) * 4, "model.safetensors: header length"),
        "empty": ("model.safetensors", b"", "model.safetensors: 0 bytes"),
        "truncated": ("model.safetensors", (good / "model.safetensors").read_bytes()[:-100], "truncated"),
        "header_list": ("model.safetensors", len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]", "not a JSON object"),
        "config_list": ("config.json", b"[]", "config.json: a JSON list: expected an object"),
        "config_junk": ("config.json", b"\x00\x01", "config.json: not valid JSON"),
    }
    v0 = engine.weight_version
    req = GenerateRequest([5, 6, 7], max_tokens=3, temperature=0.0)
    [before] = engine.generate([req])
    for name, (file, content, words) in cases.items():
        shutil.copytree(good, tmp_path / name)
        (tmp_path / name / file).write_bytes(content)
        r = httpx.post(url + "/v1/weights", json={"path": str(tmp_path / name), "format": "safetensors"}, timeout=60)
        assert r.status_code == 422 and r.json()["field"] == "path", (name, r.text)
        assert words in r.json()["detail"], (name, r.text)
        assert engine.weight_version == v0, name
    [after] = engine.generate([req])
    assert after.output_ids == before.output_ids and after.weight_version == v0


def test_weight_loads_build_no_model_and_put_nothing_on_devices(served, model, tmp_path, monkeypatch):
    """``POST /v1/weights`` reads orbax and safetensors directories straight into host arrays: no
    model of zeros (the old ``template``) and no device copy of its own, measured as the live device
    bytes at the moment every tensor has been read. The engine then serves exactly the pushed
    weights, placed like its old ones."""
    import gc

    import jax

    import models.hf
    from models.hf import save_pretrained
    from models.weights import WEIGHTS
    from r3jax import tree_io
    from r3jax.serve import weights
    from r3jax.train import export_params

    engine, url = served
    assert not hasattr(weights, "template")
    pushed = jax.tree.map(lambda x: -np.asarray(x), nnx.state(model, WEIGHTS))
    orbax = export_params(tmp_path / "orbax", pushed)
    save_pretrained(model, tmp_path / "hf")
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(pushed))
    live = lambda: sum(x.nbytes for x in jax.live_arrays())
    seen = []

    def spy(fn):  # live device bytes when ``fn`` returns: every tensor read, nothing handed over yet
        def wrapped(*a, **k):
            out = fn(*a, **k)
            seen.append(live())
            return out
        return wrapped

    monkeypatch.setattr(tree_io, "from_nested", spy(tree_io.from_nested))  # the end of read_weights
    monkeypatch.setattr(models.hf, "read_state", spy(models.hf.read_state))  # the end of a safetensors read
    for path, fmt in ((orbax, "orbax"), (tmp_path / "hf", "safetensors")):
        seen.clear()
        gc.collect()
        before = live()
        state = weights.load_state(str(path), fmt, engine)
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(state)), fmt  # host arrays only
        assert seen and max(seen) - before < 0.05 * model_bytes, (fmt, before, seen, model_bytes)
    monkeypatch.undo()

    def engine_weights():
        return [np.asarray(x) for x in jax.tree.leaves(nnx.merge_state(engine._params, engine._rest))]

    old = [x.sharding for x in jax.tree.leaves(engine._params)]
    v0 = engine.weight_version
    with RemoteInferenceClient(url) as client:
        assert client.update_weights(str(orbax), "orbax") == [v0 + 1]
        assert [x.sharding for x in jax.tree.leaves(engine._params)] == old  # placed like the old ones
        for got, want in zip(engine_weights(), jax.tree.leaves(pushed), strict=True):
            np.testing.assert_array_equal(got, want)
        assert client.update_weights(str(tmp_path / "hf"), "safetensors") == [v0 + 2]
    for got, want in zip(engine_weights(), jax.tree.leaves(nnx.state(model, WEIGHTS)), strict=True):
        np.testing.assert_array_equal(got, want)


def test_model_flag_loads_presets_hf_and_orbax_directories(model, tmp_path):
    """``--model``: preset, Hugging Face dir, orbax params dir (config from --config or its config.json)."""
    import jax

    from models.hf import config_to_hf, save_pretrained
    from r3jax.serve.weights import build_model
    from r3jax.train import export_params

    want = jax.tree.leaves(nnx.state(model, nnx.Param))
    same_params = lambda m: all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.Param)), want))
    assert build_model("tiny", seed=0).config == MoeConfig.tiny()
    save_pretrained(model, tmp_path / "hf")
    assert same_params(build_model(str(tmp_path / "hf")))
    orbax = export_params(tmp_path / "orbax", model)
    with pytest.raises(ValueError, match="without config.json: pass --config"):
        build_model(str(orbax))
    assert same_params(build_model(str(orbax), config="tiny"))
    assert same_params(build_model(str(orbax), config=str(tmp_path / "hf")))
    (orbax / "config.json").write_text(json.dumps(config_to_hf(MoeConfig.tiny())))
    assert same_params(build_model(str(orbax)))
    with pytest.raises(ValueError, match="preset='nope'"):
        build_model("nope")


def test_a_preset_builds_where_the_cpu_backend_is_left_out(monkeypatch):
    """``--model tiny`` in a process whose ``JAX_PLATFORMS`` has no ``cpu`` (``jax.devices("cpu")`` raises
    there): the random init runs on the default device instead, and the state still comes back as host
    arrays equal to the usual init's."""
    import jax

    from r3jax.serve.weights import build_model

    real = jax.devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu requested, but no platforms that are instances of cpu are present")
        return real(backend)

    want = jax.tree.leaves(nnx.state(build_model("tiny", seed=1)))
    monkeypatch.setattr(jax, "devices", no_cpu)
    got = jax.tree.leaves(nnx.state(build_model("tiny", seed=1)))
    assert {type(x) for x in got} == {np.ndarray} and len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_cli_arguments_are_checked(capsys):
    from r3jax.serve.server import parse_args

    args = parse_args(["--port", "0", "--prefix-cache-mb", "0", "--compilation-cache", "/tmp/x", "--static"])
    assert (args.model, args.host, args.port, args.max_seq_len) == ("tiny", "127.0.0.1", 0, 256)
    assert (args.compilation_cache, args.static) == ("/tmp/x", True)
    assert parse_args(["--decode-steps", "4"]).decode_steps == 4
    assert (args.decode_buckets, args.mixed_decode_buckets) == (3, 1)
    assert args.logits_dot_in_fp32 is True and parse_args(["--no-logits-dot-in-fp32"]).logits_dot_in_fp32 is False
    # the server's engine defaults (kept apart so --help starts no JAX) are the Engine's
    import inspect

    from r3jax.engine import Engine
    from r3jax.serve.server import ENGINE_DEFAULTS

    params = inspect.signature(Engine).parameters
    assert {k: params[k].default for k in ENGINE_DEFAULTS} == ENGINE_DEFAULTS
    for bad, msg in ((["--max-batch-size", "0"], "--max-batch-size"), (["--port", "70000"], "--port"),
                     (["--decode-steps", "0"], "--decode-steps=0: expected >= 1"),
                     (["--mixed-decode-buckets", "0"], "--mixed-decode-buckets=0: expected >= 1"),
                     (["--port", "-1"], "--port"), (["--block-size", "0"], "--block-size"),
                     (["--prefix-cache-mb", "-1"], "--prefix-cache-mb")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert msg in capsys.readouterr().err


def test_bad_port_fails_cleanly_under_python_O(serve_helpers):
    """Input checks are not asserts: with -O (asserts stripped) a bad --port is still refused by name."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-O", "-m", "r3jax", "serve", "--port", "-1"], cwd=serve_helpers.REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--port=-1: expected 0..65535" in r.stderr and "Traceback" not in r.stderr


def test_stats_report_route_transfer_and_a_fixed_program_count(served):
    engine, url = served
    before = httpx.get(url + "/v1/stats").json()
    programs = before["engine"]["compiled_programs"]
    assert engine.warmed_up and programs > 0
    rows = 0
    for binary, (p, s, g) in zip((False, True, False), ((5, 0, 4), (9, 3, 6), (4, 4, 1))):
        body = {"prompt_ids": list(range(1, p + 1)), "return_routed_experts": True,
                "sampling_params": {"max_tokens": g, "temperature": 0.0, "routed_experts_prompt_start": s}}
        headers = {"Accept": "application/vnd.r3jax.generate+binary"} if binary else {}
        assert httpx.post(url + "/v1/generate", json=body, headers=headers, timeout=60).status_code == 200
        rows += p - s + g - 1
    httpx.post(url + "/v1/generate", json={"prompt_ids": [1, 2]}, timeout=60)  # no routes: not counted
    after = httpx.get(url + "/v1/stats").json()
    r0, r1 = before["routes"], after["routes"]
    assert set(r1) == {"gather_s", "encode_s", "rows", "bytes", "responses"}
    assert r1["responses"] - r0["responses"] == 3 and r1["rows"] - r0["rows"] == rows
    # bytes on the wire: base64 of rows * L * K uint8 (JSON), the raw frame (binary)
    assert r1["bytes"] - r0["bytes"] >= rows * 2 * 2
    # gather_s: the engine's own counter of copying route rows out of its steps' outputs
    assert r1["gather_s"] > r0["gather_s"] and r1["encode_s"] > r0["encode_s"]
    assert r1["gather_s"] == after["engine"]["route_gather_s"]
    assert after["engine"]["route_rows"] - before["engine"]["route_rows"] == rows
    assert after["engine"]["compiled_programs"] == programs  # nothing compiled after warm-up


def test_weight_update_with_abort_is_503_retryable(served, serve_helpers, model):
    import concurrent.futures
    import time

    engine, _ = served
    params = nnx.state(model, nnx.Param)
    app = create_app(engine, load_weights=lambda path, fmt, eng: params)
    long = {"prompt_ids": [3, 4, 5], "sampling_params": {"max_tokens": 60, "temperature": 0.0}}
    with serve_helpers.thread_server(app) as srv, concurrent.futures.ThreadPoolExecutor(4) as pool:
        # HTTP requests arrive staggered, so on a fast machine they may all finish before the abort
        # lands: then the attempt proves nothing and is repeated (never spin on a passed window)
        for _attempt in range(20):
            version = engine.weight_version
            running = [pool.submit(httpx.post, srv.url + "/v1/generate", json=long, timeout=60)
                       for _ in range(4)]
            deadline = time.monotonic() + 30
            while (engine.stats["live_slots"] < 4 and not all(f.done() for f in running)
                   and time.monotonic() < deadline):
                time.sleep(0.001)
            r = httpx.post(srv.url + "/v1/weights?abort_in_flight=true", json={"path": "/w", "format": "orbax"},
                           timeout=60)
            assert r.status_code == 200 and r.json() == {"weight_version": version + 1}
            replies = [f.result() for f in running]
            for reply in replies:  # aborted, or wholly on one version (finished before / queued past the swap)
                assert reply.status_code in (200, 503), reply.text
                if reply.status_code == 200:
                    assert reply.json()["weight_version"] in (version, version + 1), reply.text
            aborted = [x for x in replies if x.status_code == 503]
            if aborted:
                break
        else:
            pytest.fail("no request was in flight at the abort in 20 attempts")
        for reply in aborted:
            assert reply.headers["retry-after"] == "1", reply.text
            assert reply.json()["retryable"] is True and reply.json()["error"] == "aborted"
        version = engine.weight_version - 1
        again = httpx.post(srv.url + "/v1/generate", json=long, timeout=60).json()
        assert again["weight_version"] == version + 1 and len(again["output_ids"]) == 60
        bad = httpx.post(srv.url + "/v1/weights?abort_in_flight=maybe", json={"path": "/w", "format": "orbax"})
        assert bad.status_code == 422 and bad.json()["field"] == "abort_in_flight"


def test_weight_update_mode_wait_over_http_lets_running_requests_finish_first(served, serve_helpers, model):
    """``POST /v1/weights`` (mode wait, the default): a request running when it arrives finishes on the old
    weights (one span, its full length) before the swap, and the update answers after it; the next
    request runs on the new version. The scheduler is held (a direct request's token callback) so the
    update lands mid-request on any machine."""
    import concurrent.futures

    import jax

    engine, _ = served
    params = nnx.state(model, nnx.Param)
    app = create_app(engine, load_weights=lambda path, fmt, eng: jax.tree.map(lambda x: x * 1.5, params))
    body = {"prompt_ids": [3, 4, 5], "sampling_params": {"max_tokens": 50, "temperature": 0.0}}
    with serve_helpers.thread_server(app) as srv, concurrent.futures.ThreadPoolExecutor(2) as pool:
        version = engine.weight_version
        held = serve_helpers.HeldRequest(engine, at=(2, 34))
        held.reached(2)
        running = pool.submit(httpx.post, srv.url + "/v1/generate", json=body, timeout=120)
        held.until(lambda: len(engine._sched.waiting) == 1)
        held.release(2)
        held.reached(34)  # the HTTP request is running
        update = pool.submit(httpx.post, srv.url + "/v1/weights", json={"path": "/w", "format": "orbax"}, timeout=120)
        held.until(lambda: len(engine._sched.controls) == 1)
        held.release(34)
        reply, answer = running.result(timeout=120).json(), update.result(timeout=120)
        held.future.result(timeout=120)
        assert answer.status_code == 200 and answer.json() == {"weight_version": version + 1}
        # drained first: all 50 tokens sampled by the old weights, though the update came mid-request
        assert reply["weight_versions"] == [[0, version]] and len(reply["output_ids"]) == 50
        after = httpx.post(srv.url + "/v1/generate", json=body, timeout=120).json()
        assert after["weight_versions"] == [[0, version + 1]]
    engine.set_weights(params)  # leave the served engine on its own weights


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weight_update_modes_over_http(served, serve_helpers, model, mode):
    """``POST /v1/weights?mode=keep``: requests in flight go on with the new weights and their answers'
    ``weight_versions`` spans say from which token; ``mode=abort``: they answer at once with what they have
    (``finish_reason: "abort"``, tokens, logprobs and routes of the old weights), and the prompt plus those
    tokens resubmitted goes on. Every reply is a 200; the client reads both."""
    import concurrent.futures
    import time

    import jax

    from r3jax.serve.protocol import ServedModel, parse_response

    engine, _ = served
    params = nnx.state(model, nnx.Param)
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    pushes = iter([scaled, params] * 20)
    app = create_app(engine, load_weights=lambda path, fmt, eng: next(pushes))
    long = {"prompt_ids": [3, 4, 5], "sampling_params": {"max_tokens": 60, "temperature": 0.0},
            "return_routed_experts": True}
    with serve_helpers.thread_server(app) as srv, concurrent.futures.ThreadPoolExecutor(4) as pool:
        info = ServedModel.from_json(httpx.get(srv.url + "/v1/model").json())
        for _attempt in range(20):  # as above: repeat until a request was in flight at the update
            version = engine.weight_version
            running = [pool.submit(httpx.post, srv.url + "/v1/generate", json=long, timeout=60) for _ in range(4)]
            deadline = time.monotonic() + 30
            while (engine.stats["live_slots"] < 4 and not all(f.done() for f in running)
                   and time.monotonic() < deadline):
                time.sleep(0.001)
            r = httpx.post(srv.url + f"/v1/weights?mode={mode}", json={"path": "/w", "format": "orbax"}, timeout=60)
            assert r.status_code == 200 and r.json() == {"weight_version": version + 1}
            replies = [f.result() for f in running]
            assert all(x.status_code == 200 for x in replies), [x.text for x in replies]
            bodies = [x.json() for x in replies]
            crossed = [b for b in bodies if len(b["weight_versions"]) == 2 or b["finish_reason"] == "abort"]
            if crossed:
                break
            httpx.post(srv.url + "/v1/weights", json={"path": "/w", "format": "orbax"}, timeout=60)  # back
        else:
            pytest.fail(f"no request was in flight at the update in 20 attempts ({mode})")
        for b in crossed:
            g = len(b["output_ids"])
            if mode == "keep":
                assert b["finish_reason"] == "length" and g == 60
                [[zero, v0], [k, v1]] = b["weight_versions"]
                assert (zero, v0, v1) == (0, version, version + 1) and 0 < k < 60
            else:
                assert b["finish_reason"] == "abort" and 1 <= g < 60
                assert b["weight_versions"] == [[0, version]]
                assert b["routed_experts"]["shape"][0] == 3 + g - 1
                rest = {"prompt_ids": [3, 4, 5] + b["output_ids"],
                        "sampling_params": {"max_tokens": 60 - g, "temperature": 0.0,
                                            "routed_experts_prompt_start": 3 + g - 1},
                        "return_routed_experts": True}
                more = httpx.post(srv.url + "/v1/generate", json=rest, timeout=60).json()
                assert more["weight_versions"] == [[0, version + 1]] and len(more["output_ids"]) == 60 - g
                assert more["routed_experts"]["shape"][0] == 1 + (60 - g) - 1
        # the client reads what it got (the r3jax form with its spans and finish reason)
        b = crossed[0]
        req = GenerateRequest([3, 4, 5], max_tokens=60, temperature=0.0, return_routed_experts=True)
        out = parse_response(json.dumps(b).encode(), "application/json", req, info, "test")
        assert out.finish_reason == b["finish_reason"] and list(map(list, out.weight_versions)) == b["weight_versions"]
        bad = httpx.post(srv.url + "/v1/weights?mode=later", json={"path": "/w", "format": "orbax"})
        assert bad.status_code == 422 and bad.json()["field"] == "mode"
        bad = httpx.post(srv.url + "/v1/weights?mode=keep&abort_in_flight=true", json={"path": "/w", "format": "orbax"})
        assert bad.status_code == 422 and bad.json()["field"] == "abort_in_flight"
    engine.set_weights(params)  # leave the served engine on its own weights
