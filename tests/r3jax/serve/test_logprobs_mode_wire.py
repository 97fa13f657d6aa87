"""``logprobs_mode`` on every wire form: the client of each protocol sends it, the server's endpoint of
that family reads it into the engine's ``GenerateRequest``, absent or null means raw_logprobs, and a
bad value is the peer's 4xx naming the field (a recording stand-in engine: no compilation)."""

from __future__ import annotations

import httpx
import pytest

from r3jax.engine import GenerateRequest
from r3jax.serve import RemoteInferenceClient, create_app

PROTOCOLS = [("r3jax", True), ("r3jax", False), ("skyrl", False), ("vllm", False), ("sglang", False)]


@pytest.fixture(scope="module")
def served(serve_helpers):
    class Recording(serve_helpers.FakeEngine):
        def generate(self, requests):
            self.requests.extend(requests)
            return super().generate(requests)

    engine = Recording()
    engine.requests = []
    with serve_helpers.thread_server(create_app(engine, served_model_name="tiny")) as srv:
        yield engine, srv.url


@pytest.mark.parametrize("protocol,binary", PROTOCOLS)
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_every_client_and_endpoint_carries_the_mode_to_the_engine(served, protocol, binary, mode):
    engine, url = served
    req = GenerateRequest([1, 2, 3], max_tokens=2, temperature=0.7, top_k=5, seed=3, logprobs_mode=mode,
                          return_routed_experts=True)
    with RemoteInferenceClient(url, protocol=protocol, binary_routes=binary, model="tiny") as client:
        [out] = client.generate([req])
    got = engine.requests[-1]
    assert got.logprobs_mode == mode and got.prompt_ids == [1, 2, 3] and got.temperature == 0.7
    assert out.logprobs is not None and len(out.output_ids) == 2


# (path, body without the mode, where the mode goes: None = top level, else the sampling-params key)
FORMS = [("/v1/generate", {"prompt_ids": [1, 2]}, "sampling_params"),
         ("/skyrl/v1/generate", {"token_ids": [1, 2]}, "sampling_params"),
         ("/inference/v1/generate", {"token_ids": [1, 2]}, "sampling_params"),
         ("/v1/completions", {"prompt": [1, 2], "logprobs": 0}, None),
         ("/generate", {"input_ids": [1, 2], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}},
          "sampling_params")]


def _with(body, where, value):
    if where is None:
        return {**body, "logprobs_mode": value}
    return {**body, where: {**body.get(where, {}), "logprobs_mode": value}}


@pytest.mark.parametrize("path,body,where", FORMS)
def test_each_endpoint_reads_the_field_and_defaults_to_raw(served, path, body, where):
    engine, url = served
    for value, want in (("processed_logprobs", "processed_logprobs"), ("raw_logprobs", "raw_logprobs")):
        r = httpx.post(url + path, json=_with(body, where, value), timeout=30)
        assert r.status_code == 200, r.text
        assert engine.requests[-1].logprobs_mode == want
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200 and engine.requests[-1].logprobs_mode == "raw_logprobs"
    if path != "/v1/generate":  # the peers read null as absent; r3jax's strict schema wants a string
        r = httpx.post(url + path, json=_with(body, where, None), timeout=30)
        assert r.status_code == 200 and engine.requests[-1].logprobs_mode == "raw_logprobs"


@pytest.mark.parametrize("path,body,where", FORMS)
@pytest.mark.parametrize("bad", ["processed", "raw_logits", 1])
def test_a_bad_mode_is_the_peers_4xx_naming_the_field(served, path, body, where, bad):
    engine, url = served
    before = len(engine.requests)
    r = httpx.post(url + path, json=_with(body, where, bad), timeout=30)
    field = "logprobs_mode" if where is None else f"{where}.logprobs_mode"
    err = r.json()
    if path == "/v1/generate":
        assert r.status_code == 422 and err["field"] == field, r.text
    elif path == "/generate":  # SGLang's error names no field: its message starts with it
        assert r.status_code == 400 and err["error"]["message"].startswith(field), r.text
    else:
        assert r.status_code == 400 and err["error"]["param"] == field, r.text
    assert len(engine.requests) == before  # refused before the engine


def test_the_client_refuses_a_bad_mode_naming_the_field():
    from r3jax.checks import FieldError
    from r3jax.serve.client.protocols import make

    req = GenerateRequest([1, 2], logprobs_mode="processed")
    for name in ("r3jax", "skyrl", "vllm", "sglang"):
        with pytest.raises(FieldError) as err:
            make(name).encode(req)
        assert err.value.field == "logprobs_mode"
