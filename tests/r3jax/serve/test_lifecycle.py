"""Server behaviour that needs control over timing, with a gated fake engine (no JAX programs):
dynamic batching, a weight update while a batch runs, graceful shutdown with a request in flight."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time

import httpx
import pytest

from r3jax.serve import create_app


def poll(fn, timeout=30.0):
    """Call ``fn`` until it returns a truthy value (fail after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)
    return value


def stats(url):
    return httpx.get(url + "/v1/stats").json()


@pytest.fixture
def gated(serve_helpers):
    engine = serve_helpers.FakeEngine(max_batch_size=4)
    engine.gate = threading.Event()
    app = create_app(engine, load_weights=lambda path, fmt, eng: {"path": path})
    with serve_helpers.thread_server(app) as srv, concurrent.futures.ThreadPoolExecutor(16) as pool:
        yield engine, srv, pool
        engine.gate.set()


def post(url, prompt, max_tokens=2):
    return httpx.post(url + "/v1/generate", json={"prompt_ids": prompt, "sampling_params": {"max_tokens": max_tokens}},
                      timeout=30)


def test_concurrent_requests_are_gathered_into_batches(gated):
    engine, srv, pool = gated
    first = pool.submit(post, srv.url, [1])
    poll(lambda: stats(srv.url)["in_flight"] == 1)  # the engine is busy with a batch of one
    rest = [pool.submit(post, srv.url, [2, i]) for i in range(10)]
    poll(lambda: stats(srv.url)["queued"] == 10)
    engine.gate.set()
    replies = [f.result() for f in [first, *rest]]
    assert [r.status_code for r in replies] == [200] * 11
    assert [r.json()["output_ids"][0] for r in replies[1:]] == [(2 + i) % 272 for i in range(10)]
    assert engine.batches == [1, 4, 4, 2]  # bounded by max_batch_size=4, nothing lost
    s = stats(srv.url)
    assert (s["requests"], s["batches"], s["batched_requests"], s["max_batch"]) == (11, 4, 11, 4)


def test_weight_update_waits_for_the_running_batch(gated):
    engine, srv, pool = gated
    running = pool.submit(post, srv.url, [1, 2, 3])
    poll(lambda: stats(srv.url)["in_flight"] == 1)
    update = pool.submit(httpx.post, srv.url + "/v1/weights", json={"path": "/w", "format": "orbax"}, timeout=30)
    engine.gate.set()
    assert running.result().json()["weight_version"] == 0  # finished on the weights it started with
    assert update.result().json() == {"weight_version": 1}
    assert post(srv.url, [1, 2, 3]).json()["weight_version"] == 1


def test_graceful_shutdown_finishes_the_request_in_flight(gated):
    engine, srv, pool = gated
    running = pool.submit(post, srv.url, [7, 8], 3)
    poll(lambda: stats(srv.url)["in_flight"] == 1)
    srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's SIGTERM handler does

    def refused():
        try:
            httpx.get(srv.url + "/health", timeout=1.0)
            return False
        except httpx.TransportError:  # refused, or accepted in the last moment and closed unanswered
            return True
    poll(refused)  # no new requests once shutdown began...
    assert not running.done()
    engine.gate.set()
    r = running.result()  # ...but the request in flight completes normally
    assert r.status_code == 200 and r.json()["output_ids"] == [15, 16, 17]
    srv.thread.join(30)
    assert not srv.thread.is_alive()


def test_full_queue_is_503_and_the_client_retries_later(serve_helpers):
    from r3jax.engine import GenerateRequest
    from r3jax.serve import RemoteInferenceClient

    engine = serve_helpers.FakeEngine(max_batch_size=1)
    engine.gate = threading.Event()
    with serve_helpers.thread_server(create_app(engine, max_queue=2)) as srv, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(post, srv.url, [i + 1]) for i in range(3)]  # 1 running + 2 queued
        poll(lambda: stats(srv.url)["queued"] == 2 and stats(srv.url)["in_flight"] == 1)
        r = post(srv.url, [9])
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "max_queue=2" in r.json()["detail"]
        with RemoteInferenceClient(srv.url, backoff_s=0.01, max_backoff_s=0.05, health_interval_s=0.0,
                                   max_retries=1000) as client:
            later = pool.submit(client.generate, [GenerateRequest([9], max_tokens=2)])
            poll(lambda: client.retries >= 1)  # refused while full...
            engine.gate.set()
            assert later.result()[0].output_ids == [9, 10]  # ...served once there is room
        assert [f.result().status_code for f in held] == [200] * 3
