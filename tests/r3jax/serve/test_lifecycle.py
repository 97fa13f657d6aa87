"""Server behaviour that needs control over timing, with a gated fake engine (no JAX programs):
/health while warming up and after a failed warm-up, graceful shutdown with a request in flight, a
full queue, and a client that disconnects cancelling its request."""

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


def post(url, prompt, max_tokens=2, timeout=30):
    return httpx.post(url + "/v1/generate", json={"prompt_ids": prompt, "sampling_params": {"max_tokens": max_tokens}},
                      timeout=timeout)


def test_health_is_503_warming_up_until_every_program_is_compiled(serve_helpers):
    engine = serve_helpers.FakeEngine()
    engine.warm_gate = threading.Event()

    def health(url):
        try:
            return httpx.get(url + "/health", timeout=2.0)
        except httpx.TransportError:  # not listening yet
            return None

    with serve_helpers.thread_server(create_app(engine), wait=False) as srv:
        r = poll(lambda: health(srv.url))
        assert r.status_code == 503 and r.json() == {"status": "warming_up"} and r.headers["retry-after"] == "1"
        assert not engine.warmed_up
        engine.warm_gate.set()
        serve_helpers.wait_healthy(srv.url)
        assert engine.warmed_up and health(srv.url).json()["status"] == "ok"
        warm = stats(srv.url)["warmup"]
        assert (warm["programs"], warm["seconds"]) == (0, 0.0) and warm["ready_s"] > 0  # since create_app


def test_wait_healthy_waits_out_warm_up_and_reports_a_dead_server_or_a_timeout(serve_helpers):
    from r3jax.serve.client import wait_healthy

    class Exited:  # a server process that has exited
        returncode = 3

        def poll(self):
            return 3

    engine = serve_helpers.FakeEngine()
    engine.warm_gate = threading.Event()
    with serve_helpers.thread_server(create_app(engine), wait=False) as srv:
        with pytest.raises(TimeoutError, match=r"/health did not answer 200 within 0.2 s"):
            wait_healthy(srv.url, timeout=0.2, poll_s=0.01)  # 503 warming_up all along
        with pytest.raises(RuntimeError, match=r"exited with 3 before /health answered 200"):
            wait_healthy(srv.url, timeout=5.0, poll_s=0.01, proc=Exited())
        threading.Timer(0.1, engine.warm_gate.set).start()
        assert wait_healthy(srv.url, timeout=30.0, poll_s=0.01) >= 0.05  # returned only once warm
        assert engine.warmed_up


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


def test_client_disconnect_cancels_its_request(gated):
    engine, srv, pool = gated
    with pytest.raises(httpx.ReadTimeout):
        post(srv.url, [1, 2], timeout=0.5)  # the client gives up and closes the connection
    poll(lambda: stats(srv.url)["cancelled"] == 1)  # the server noticed and cancelled the engine request
    engine.gate.set()
    poll(lambda: stats(srv.url).get("cancelled_in_engine") == 1)  # its output was never delivered
    assert stats(srv.url)["in_flight"] == 0


def test_full_queue_is_503_and_the_client_retries_later(serve_helpers):
    from r3jax.engine import GenerateRequest
    from r3jax.serve import RemoteInferenceClient

    engine = serve_helpers.FakeEngine(max_batch_size=1)
    engine.gate = threading.Event()
    with serve_helpers.thread_server(create_app(engine, max_queue=2)) as srv, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(post, srv.url, [i + 1]) for i in range(3)]  # 1 in the slot + 2 queued
        poll(lambda: stats(srv.url)["queued"] == 2 and stats(srv.url)["in_flight"] == 3)
        r = post(srv.url, [9])
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "max_queue=2" in r.json()["detail"]
        assert r.json()["retryable"] is True
        with RemoteInferenceClient(srv.url, backoff_s=0.01, max_backoff_s=0.05, health_interval_s=0.0,
                                   max_retries=1000) as client:
            later = pool.submit(client.generate, [GenerateRequest([9], max_tokens=2)])
            poll(lambda: client.retries >= 1)  # refused while full...
            engine.gate.set()
            assert later.result()[0].output_ids == [9, 10]  # ...served once there is room
        assert [f.result().status_code for f in held] == [200] * 3


def test_health_is_503_failed_with_the_reason_when_warm_up_fails(serve_helpers):
    class NoCompile(serve_helpers.FakeEngine):
        def warmup(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory compiling decode")

    with serve_helpers.thread_server(create_app(NoCompile()), wait=False) as srv:
        r = poll(lambda: (r := httpx.get(srv.url + "/health")).json()["status"] != "warming_up" and r)
        assert r.status_code == 503 and "retry-after" not in r.headers
        reason = "warm-up failed: RuntimeError: RESOURCE_EXHAUSTED: out of memory compiling decode"
        assert r.json() == {"status": "failed", "reason": reason}
