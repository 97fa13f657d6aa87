"""RemoteInferenceClient logic against fake servers (no JAX programs): retries on 503 but not on
4xx/500, the row rule enforced on whatever a server answers, the start checked before sending,
sticky sessions and load spreading over replicas, a dead replica skipped until /health answers,
a warming replica waited for within the cold-start budget, a failed one routed around, and
SGLang's /generate format."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from r3jax.engine import GenerateOutput, GenerateRequest
from r3jax.routes import encode_binary
from r3jax.serve import ProtocolError, RemoteError, RemoteInferenceClient, RemoteInputError, create_app

REQ = GenerateRequest([1, 2, 3], max_tokens=3, return_routed_experts=True, routed_experts_prompt_start=1)


def fast(urls, **kw):
    return RemoteInferenceClient(urls, backoff_s=0.001, max_backoff_s=0.01, health_interval_s=0.0, **kw)


class Flaky:
    """ASGI wrapper: answer the first ``n`` POST /v1/generate with ``status`` (and ``headers``);
    count the POSTs."""

    def __init__(self, app, n, status, headers=None):
        self.app, self.n, self.status, self.posts, self.headers = app, n, status, 0, headers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/generate":
            self.posts += 1
            if self.posts <= self.n:
                body = json.dumps({"error": "x", "detail": f"injected {self.status}"}).encode()
                return await Response(body, self.status, self.headers, media_type="application/json")(
                    scope, receive, send)
        await self.app(scope, receive, send)


@pytest.mark.parametrize("status,n,fails", [(503, 3, None), (502, 1, None), (504, 1, None), (408, 1, None),
                                            (429, 2, None), (500, 1, RemoteError), (422, 1, RemoteInputError),
                                            (400, 1, RemoteInputError), (404, 1, RemoteInputError),
                                            (503, 9, RemoteError)])
def test_retry_policy(serve_helpers, status, n, fails):
    engine = serve_helpers.FakeEngine()
    app = Flaky(create_app(engine), n, status)
    with serve_helpers.thread_server(app) as srv, fast(srv.url, max_retries=4) as client:
        if fails is None:
            [out] = client.generate([REQ])
            assert out.output_ids == [6, 7, 8] and client.retries == n and app.posts == n + 1
        else:
            with pytest.raises(fails, match=f"{status}|after 5 attempts"):
                client.generate([REQ])
            assert app.posts == (5 if status == 503 else 1)  # 503: 1 + max_retries; others: never retried
            assert client.stats["failed"] == 1 and client.stats["requests"] == 0


def test_503_retry_after_is_honoured(serve_helpers):
    """A warming-up / draining server answers 503 with Retry-After: the client waits that long
    (not its own 1-10 ms backoff) and the request then succeeds."""
    app = Flaky(create_app(serve_helpers.FakeEngine()), 2, 503, {"Retry-After": "0.2"})
    with serve_helpers.thread_server(app) as srv, fast(srv.url) as client:
        [out] = client.generate([REQ])
        assert out.output_ids == [6, 7, 8] and app.posts == 3
        s = client.stats
        assert (s["requests"], s["attempts"], s["retries"]) == (1, 3, 2)
        assert 0.4 <= s["retry_wait_s"] < 0.45  # two waits of Retry-After (0.2 s), each plus nothing
    # a Retry-After past the budget ends the request at once, saying why
    app = Flaky(create_app(serve_helpers.FakeEngine()), 9, 503, {"Retry-After": "30"})
    with serve_helpers.thread_server(app) as srv, fast(srv.url, retry_timeout_s=5.0) as client:
        with pytest.raises(RemoteError, match="server asked to retry after 30 s"):
            client.generate([REQ])
        assert app.posts == 1 and client.stats["retry_wait_s"] == 0.0


def test_retry_after_of_one_replica_does_not_hold_the_request_when_another_is_live(serve_helpers):
    busy = Flaky(create_app(serve_helpers.FakeEngine()), 10**6, 503, {"Retry-After": "30"})
    with serve_helpers.thread_server(busy) as a, serve_helpers.thread_server(create_app(serve_helpers.FakeEngine())) as b, \
            fast([a.url, b.url]) as client:
        outs = client.generate([GenerateRequest([1, 2], max_tokens=1, session_id=f"s{i}") for i in range(8)])
        assert len(outs) == 8 and 1 <= busy.posts <= 8  # sessions hashed to A moved to B at once...
        assert client.stats["retries"] == busy.posts and client.stats["retry_wait_s"] < 1.0  # ...without waiting 30 s
        assert client.health() == {a.url: True, b.url: True}  # A answers /health: back in rotation for later


def test_retry_budget_is_a_time(serve_helpers):
    """No count limit by default: a server that keeps answering 503 is retried until
    retry_timeout_s, far more than the old 5 attempts, then the error names the budget."""
    app = Flaky(create_app(serve_helpers.FakeEngine()), 10**6, 503)
    with serve_helpers.thread_server(app) as srv, fast(srv.url, retry_timeout_s=0.5) as client:
        with pytest.raises(RemoteError, match=r"attempts in 0\.\d s \(retry_timeout_s=0\.5\): .*HTTP 503"):
            client.generate([REQ])
        assert app.posts > 5 and client.stats["attempts"] == app.posts


@pytest.mark.parametrize("binary", [True, False])
def test_stats_count_requests_bytes_and_decode_time(serve_helpers, binary):
    from r3jax.serve.protocol import request_body

    with serve_helpers.thread_server(create_app(serve_helpers.FakeEngine())) as srv, \
            fast(srv.url, binary_routes=binary) as client:
        outs = client.generate([REQ, REQ, GenerateRequest([1, 2], max_tokens=2)])
        s = client.stats
        # REQ: P - s + G - 1 = 4 rows of [L=2, K=2] uint8 = 16 raw bytes; the third asks for no routes
        assert (s["requests"], s["attempts"], s["retries"], s["responses"], s["route_rows"]) == (3, 3, 0, 3, 8)
        if binary:  # the frame: its header (48 bytes here) and the 16 raw bytes
            frame = encode_binary(outs[0].routed_experts, 1, [0, 1])
            assert len(frame) == 48 + 16 and s["route_bytes"] == 2 * len(frame)
        else:  # the routed_experts JSON value, as the server wrote it
            body = httpx.post(srv.url + "/v1/generate", json=request_body(REQ)).json()
            member = json.dumps(body["routed_experts"], separators=(",", ":"))
            assert s["route_bytes"] == 2 * len(member)
        assert s["body_bytes"] > s["route_bytes"] and s["decode_s"] > 0 and s["request_s"] >= s["decode_s"]
        assert [o.routed_experts is None for o in outs] == [False, False, True]


class BadEngine:
    """Wraps FakeEngine and corrupts its outputs in one way."""

    def __init__(self, inner, how):
        self.inner, self.how = inner, how

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests):
        outs = self.inner.generate(requests)
        o = outs[0]
        r = o.routed_experts
        r, start, ids = {"extra_row": (np.concatenate([r, r[:1]]), o.routed_experts_start, o.output_ids),
                         "missing_row": (r[1:], o.routed_experts_start, o.output_ids),
                         "start": (r, o.routed_experts_start + 1, o.output_ids),
                         "expert_id": (r + 8, o.routed_experts_start, o.output_ids),
                         "too_many_tokens": (r, o.routed_experts_start, o.output_ids + [1])}[self.how]
        return [GenerateOutput(ids, o.logprobs, o.finish_reason, r, o.prompt_tokens, o.cached_tokens,
                               o.weight_version, start)]


@pytest.mark.parametrize("how,binary", [("extra_row", True), ("extra_row", False), ("missing_row", True),
                                        ("start", False), ("expert_id", True), ("too_many_tokens", False)])
def test_contract_breaking_answers_raise(serve_helpers, how, binary):
    engine = BadEngine(serve_helpers.FakeEngine(), how)
    with serve_helpers.thread_server(create_app(engine)) as srv, fast(srv.url, binary_routes=binary) as client:
        with pytest.raises(ProtocolError, match="P - s \\+ G - 1|start=2|expert id|output_ids"):
            client.generate([REQ])
        assert client.retries == 0


def test_start_checked_before_sending(serve_helpers):
    engine = serve_helpers.FakeEngine()
    with serve_helpers.thread_server(create_app(engine)) as srv, fast(srv.url) as client:
        for s in (True, -1, 4, 1.0, "1"):
            bad = GenerateRequest([1, 2, 3], routed_experts_prompt_start=s)
            with pytest.raises(ValueError, match="routed_experts_prompt_start"):
                client.generate([REQ, bad])
        for bad in (REQ, [REQ, {"prompt_ids": [1]}]):  # Engine.generate's argument checks, too
            with pytest.raises(ValueError, match="expected a list of GenerateRequest|expected a GenerateRequest"):
                client.generate(bad)
        assert httpx.get(srv.url + "/v1/stats").json()["requests"] == 0  # nothing was sent
        outs = client.generate([GenerateRequest([1, 2, 3], max_tokens=2, return_routed_experts=True,
                                                routed_experts_prompt_start=s) for s in (0, 3)])
        assert [o.routed_experts.shape[0] for o in outs] == [3 - 0 + 2 - 1, 3 - 3 + 2 - 1]


def test_sticky_sessions_spread_load_and_skip_a_dead_replica(serve_helpers):
    engines = [serve_helpers.FakeEngine(), serve_helpers.FakeEngine()]
    a = serve_helpers.ThreadServer(create_app(engines[0]))
    b = serve_helpers.ThreadServer(create_app(engines[1]))
    counts = lambda: [httpx.get(s.url + "/v1/stats").json()["requests"] for s in (a, b)]
    try:
        with fast([a.url, b.url], max_retries=3) as client:
            sessions = [f"s{i}" for i in range(8)]
            for _ in range(3):  # three turns per session
                client.generate([GenerateRequest([1, 2], max_tokens=1, session_id=s) for s in sessions])
            per = [httpx.get(s.url + "/v1/stats").json()["sessions"] for s in (a, b)]
            for s in sessions:  # every turn of a session on one replica
                assert sorted([per[0].get(s, 0), per[1].get(s, 0)]) == [0, 3]
            before = counts()
            client.generate([GenerateRequest([1, 2], max_tokens=1) for _ in range(8)])
            after = counts()
            assert after[0] - before[0] >= 2 and after[1] - before[1] >= 2  # no session: spread by load

            b.stop()  # B dies: everything goes to A, nothing fails
            outs = client.generate([GenerateRequest([1, 2], max_tokens=1, session_id=s) for s in sessions])
            assert len(outs) == 8 and client.health() == {a.url: True, b.url: False}
            b = serve_helpers.ThreadServer(create_app(engines[1]), port=b.port)  # B is back
            assert client.health() == {a.url: True, b.url: True}
            b_before = httpx.get(b.url + "/v1/stats").json()["requests"]
            client.generate([GenerateRequest([1, 2], max_tokens=1, session_id=s) for s in sessions])
            assert httpx.get(b.url + "/v1/stats").json()["requests"] > b_before  # used again
    finally:
        for s in (a, b):
            if s.thread.is_alive():
                s.stop()


def test_sglang_protocol(serve_helpers):
    """A fake SGLang /generate: routes for the whole sequence as base64 int32; the client keeps [s:]."""
    seen = []
    app = FastAPI()

    @app.get("/health")
    def health():
        return {}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        seen.append(body)
        p, g = len(body["input_ids"]), body["sampling_params"]["max_new_tokens"]
        rows = np.arange((p + g - 1) * 2 * 2, dtype=np.int32).reshape(p + g - 1, 2, 2) % 8
        if body["input_ids"][0] == 99:
            rows = rows[1:]  # a broken server: one row short
        out = [10 + t for t in range(g)]
        return {"text": "", "output_ids": out, "meta_info": {
            "output_token_logprobs": [[-0.25 * t, tok, None] for t, tok in enumerate(out)],
            "finish_reason": {"type": "length"}, "prompt_tokens": p, "cached_tokens": 1,
            "weight_version": "3", "routed_experts": base64.b64encode(rows.tobytes()).decode()}}

    info = {"num_experts": 8, "top_k": 2, "moe_layer_ids": [1, 2]}
    with serve_helpers.thread_server(app) as srv, fast(srv.url, protocol="sglang", model_info=info) as client:
        req = GenerateRequest([5, 6, 7, 8], max_tokens=3, top_k=0, seed=3, return_routed_experts=True,
                              routed_experts_prompt_start=2)
        [out] = client.generate([req])
        full = np.arange(6 * 4, dtype=np.int32).reshape(6, 2, 2) % 8
        np.testing.assert_array_equal(out.routed_experts, full[2:])
        assert out.routed_experts.dtype == np.uint8 and out.routed_experts_start == 2 and out.weight_version == 3
        assert (out.output_ids, out.logprobs, out.finish_reason, out.cached_tokens) == ([10, 11, 12], [0.0, -0.25, -0.5],
                                                                                         "length", 1)
        assert seen[0]["input_ids"] == [5, 6, 7, 8] and seen[0]["return_routed_experts"] is True
        assert seen[0]["sampling_params"]["top_k"] == -1 and seen[0]["sampling_params"]["sampling_seed"] == 3
        with pytest.raises(ProtocolError, match="has 2 rows: expected P - s \\+ G - 1 = 2 - 0 \\+ 2 - 1 = 3"):
            client.generate([GenerateRequest([99, 1], max_tokens=2, return_routed_experts=True)])
        assert seen[0]["routed_experts_start_len"] == 2  # asked for; this server sends every row anyway
        with fast(srv.url, protocol="sglang") as blind, pytest.raises(ValueError, match="has no GET /v1/model .not "
                                                                          "an r3jax server.; protocol='sglang' needs model_info"):
            blind.generate([req])


def test_parse_response_reads_the_skyrl_form_and_checks_it():
    from r3jax.routes import encode
    from r3jax.serve.protocol import ServedModel, parse_response

    info = ServedModel(num_experts=8, top_k=2, moe_layer_ids=(1, 2), vocab_size=272)
    rows = np.arange(4 * 4, dtype=np.int32).reshape(4, 2, 2) % 8  # P - s + G - 1 = 3 - 1 + 3 - 1
    skyrl = {k: v for k, v in encode(rows, 1, [1, 2]).items() if k in ("data", "shape", "dtype")}
    obj = {"output_ids": [1, 2, 3], "logprobs": [-1.0, -2.0, -3.0], "finish_reason": "stop", "routed_experts": skyrl,
           "prompt_tokens": 3, "cached_tokens": 0, "weight_version": 4}
    out = parse_response(json.dumps(obj).encode(), "application/json", REQ, info, "test")
    np.testing.assert_array_equal(out.routed_experts, rows)
    assert out.routed_experts.dtype == np.uint8 and (out.finish_reason, out.weight_version) == ("stop", 4)
    for change, match in (({"routed_experts": None}, "missing"), ({"logprobs": [-1.0]}, "logprobs"),
                          ({"finish_reason": "aborted"}, "finish_reason"),
                          ({"weight_versions": [[1, 4]]}, "weight_versions"), ({"weight_versions": [[0, 4], [3, 5]]},
                                                                              "weight_versions"), ({"output_ids": []}, "output_ids"),
                          ({"routed_experts": {**skyrl, "layers": [0, 1]}}, "layers"),
                          ({"routed_experts": [[[0, 1]]]}, "packed form")):
        with pytest.raises(ProtocolError, match=match):
            parse_response(json.dumps({**obj, **change}).encode(), "application/json", REQ, info, "test")


class FakeTime:
    """The client's retry clock, moved only by its own sleeps (and by the fake replica's timeouts)."""

    def __init__(self):
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s
        await asyncio.sleep(0)


def timed(client, t: FakeTime):
    client._clock, client._sleep = t.clock, t.sleep
    return client


MODEL = {"num_experts": 8, "top_k": 2, "num_moe_layers": 2, "moe_layer_ids": [1, 2], "vocab_size": 272,
         "max_seq_len": 64, "weight_version": 0}
ANSWER = {"output_ids": [5, 6], "logprobs": [-0.5, -0.5], "finish_reason": "length", "routed_experts": None,
          "prompt_tokens": 3, "cached_tokens": 0, "weight_version": 0}


def restarting_replica(t: FakeTime, listening_at: float, ready_at: float):
    """An httpx handler: no connection before ``listening_at``, then ``warming_up`` on /health until
    ``ready_at`` (a generate request sent meanwhile sits behind the warm-up past the client's 60 s
    read timeout), then serving. Returns ``(handler, times of the generate requests it received)``."""
    posts = []

    def handle(request: httpx.Request) -> httpx.Response:
        if t.now < listening_at:
            raise httpx.ConnectError("connection refused", request=request)
        warming = t.now < ready_at
        if request.url.path == "/health":
            if warming:
                return httpx.Response(503, json={"status": "warming_up"}, headers={"Retry-After": "1"})
            return httpx.Response(200, json={"status": "ok", "weight_version": 0})
        if request.url.path == "/v1/model":
            return httpx.Response(200, json=MODEL)
        posts.append(t.now)
        if warming:
            t.now += 60.0
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json=ANSWER)
    return handle, posts


@pytest.mark.parametrize("listening_at", [0.0, 10.0])  # warming when first met / down, then warming (a restart)
def test_client_rides_through_a_warm_up_longer_than_its_retry_budget(listening_at):
    """A cold start (no compilation cache) warms up for 200 s, past retry_timeout_s=120: the client
    tells warming from dead, keeps waiting within warmup_timeout_s, and the request completes."""
    t = FakeTime()
    handle, posts = restarting_replica(t, listening_at, ready_at=200.0)
    req = GenerateRequest([1, 2, 3], max_tokens=2)
    with timed(RemoteInferenceClient("http://a:1", transport=httpx.MockTransport(handle)), t) as client:
        assert (client.retry.timeout_s, client.retry.warmup_timeout_s) == (120.0, 300.0)  # the defaults
        [out] = client.generate([req])
        assert out.output_ids == [5, 6] and client.stats["failed"] == 0
        assert t.now >= 200.0 and posts[-1] >= 200.0  # served once warm, long past the 120 s budget
        assert len(posts) == (2 if listening_at == 0.0 else 1)  # sent to a warming replica only before it said so
    t = FakeTime()
    handle, posts = restarting_replica(t, listening_at, ready_at=200.0)
    with timed(RemoteInferenceClient("http://a:1", transport=httpx.MockTransport(handle),
                                     warmup_timeout_s=150.0), t) as client:
        with pytest.raises(RemoteError, match=r"warmup_timeout_s=150 while a replica warms up.*warming_up"):
            client.generate([req])  # the cold-start budget is what carried it
        assert t.now < 200.0


def test_a_replica_whose_engine_failed_leaves_rotation_and_the_other_serves(serve_helpers):
    """A's engine cannot continue: its /health answers 503 failed with the reason, and generate 503.
    The client moves A's requests to B at once and keeps A out of rotation afterwards, however long
    it waits (A is re-probed and still says failed)."""
    from r3jax.engine import EngineFailedError

    reason = "rebuilding the device state after a failed step raised RuntimeError: device lost"

    class FailedEngine(serve_helpers.FakeEngine):
        failure = reason

        def generate(self, requests):
            raise EngineFailedError(reason)

    a_app = Flaky(create_app(FailedEngine()), 0, 503)  # counts A's generate requests
    t = FakeTime()
    with serve_helpers.thread_server(a_app, wait=False) as a, \
            serve_helpers.thread_server(create_app(serve_helpers.FakeEngine())) as b, \
            timed(fast([a.url, b.url]), t) as client:
        r = httpx.get(a.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "failed", "reason": reason}
        reqs = [GenerateRequest([1, 2], max_tokens=1) for _ in range(8)]
        assert [o.output_ids for o in client.generate(reqs)] == [[3]] * 8  # A's share moved to B
        sent_to_a = a_app.posts
        assert 1 <= sent_to_a <= 8 and client.stats["failed"] == 0
        for _ in range(3):
            t.now += 10.0  # past A's Retry-After and health interval: it is asked again
            assert len(client.generate(reqs)) == 8
        assert a_app.posts == sent_to_a  # never back in rotation
        [replica_a, _] = client.replicas.all
        assert not replica_a.alive and (replica_a.health.status, replica_a.health.reason) == ("failed", reason)
