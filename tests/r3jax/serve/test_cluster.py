"""Real servers in subprocesses (``python -m r3jax serve --model tiny``): 64 concurrent requests
equal the same requests sent alone; SIGKILL mid-run and a restart lose and duplicate nothing, and a
request sent while its only server is down completes once it is back, with the client's default
retry budget; two replicas keep sessions sticky so the prefix cache hits; SIGTERM exits cleanly.

The server processes share a persistent JAX compilation cache (in pytest's cache directory, used by
these server processes only), so a restarted server does not recompile."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import pytest

from r3jax.engine import GenerateRequest
from r3jax.serve import RemoteInferenceClient

# one decode bucket and one prefill row (2 + 64 tokens a step): 2 programs to compile
ARGS = ("--max-batch-size", "2", "--max-seq-len", "64", "--decode-buckets", "1", "--max-num-batched-tokens", "66")


@pytest.fixture(scope="module")
def cluster(serve_helpers, request, tmp_path_factory):
    """Server A (started here), its port and the shared cache; tests restart A and add B."""
    store = getattr(request.config, "cache", None)  # pytest's cache dir: kept across runs
    cache = store.mkdir("r3jax-serve-jax-cache") if store else tmp_path_factory.mktemp("jax-cache")
    h = serve_helpers
    state = {"procs": {}, "cache": cache}

    def start(name, port=None):
        port = port or h.free_port()
        proc = h.start_process(port, *ARGS, cache_dir=cache)
        state["procs"][name] = (proc, port)
        h.wait_healthy(f"http://127.0.0.1:{port}", timeout=240, proc=proc)
        return f"http://127.0.0.1:{port}"

    state["start"] = start
    state["a"] = start("a")
    yield state
    for proc, _ in state["procs"].values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def requests_(n):
    return [GenerateRequest([3 + i % 5, 7, 11 + i][: 2 + i % 2], max_tokens=4, temperature=0.0,
                            return_routed_experts=True, routed_experts_prompt_start=i % 3) for i in range(n)]


def assert_same(got, want):
    """Tokens and routes exactly; logprobs to float32 rounding (a batch of another size runs
    another XLA program, whose reductions may round differently)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def alone(cluster):
    with RemoteInferenceClient(cluster["a"]) as client:
        return [client.generate([r])[0] for r in requests_(64)]  # one at a time


def test_64_concurrent_requests_equal_each_sent_alone(cluster, alone):
    url = cluster["a"]
    before = httpx.get(url + "/v1/stats").json()
    with RemoteInferenceClient(url, max_concurrency=64) as client:
        together = client.generate(requests_(64))
    assert_same(together, alone)
    after = httpx.get(url + "/v1/stats").json()
    assert after["requests"] - before["requests"] == 64
    # gathered into batches: fewer decoding steps than tokens decoded, never more than 2 requests a step
    decoded = sum(len(o.output_ids) - 1 for o in together)
    assert after["batches"] - before["batches"] < decoded and after["max_batch"] == 2


def test_kill_mid_run_and_restart_loses_and_duplicates_nothing(cluster, alone, serve_helpers):
    url = cluster["a"]
    proc, port = cluster["procs"]["a"]
    result = {}
    with RemoteInferenceClient(url, max_concurrency=2) as client:  # the default retry budget
        base = httpx.get(url + "/v1/stats").json()["requests"]
        run = threading.Thread(target=lambda: result.setdefault("outs", client.generate(requests_(64))))
        run.start()
        poll = lambda: httpx.get(url + "/v1/stats").json()["requests"] - base >= 4
        while not poll():
            pass
        proc.send_signal(signal.SIGKILL)  # mid-run: requests in flight and still to send
        proc.wait(30)
        cluster["start"]("a", port)  # same port; the client retries until it answers again
        run.join(300)
        assert not run.is_alive()
        assert client.retries >= 1 and client.stats["failed"] == 0 and client.stats["requests"] == 64
    assert_same(result["outs"], alone)  # one output per request, in order, each the right one
    assert httpx.get(url + "/v1/stats").json()["requests"] <= 64  # the restarted server saw only the rest


def test_request_survives_its_only_server_being_killed_and_restarted(cluster, alone):
    """Default client settings. The server is SIGKILLed, a request is sent while it is down, and it
    is restarted on the same port only after the client has retried more than the old budget (5
    retries, ~1.5 s of backoff) allowed: the request completes with the right answer."""
    url = cluster["a"]
    proc, port = cluster["procs"]["a"]
    request = requests_(1)
    result = {}
    with RemoteInferenceClient(url) as client:
        assert_same(client.generate(request), alone[:1])  # connected, model info cached
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        run = threading.Thread(target=lambda: result.setdefault("outs", client.generate(request)))
        run.start()
        while client.retries <= 5 and run.is_alive():
            time.sleep(0.05)
        assert run.is_alive(), "the request ended while its only server was down"
        cluster["start"]("a", port)  # start + warm-up; the client keeps retrying meanwhile
        run.join(120)
        assert not run.is_alive()
        s = client.stats
    assert_same(result["outs"], alone[:1])
    assert s["requests"] == 2 and s["failed"] == 0 and s["retries"] > 5


def test_two_replicas_sticky_sessions_hit_the_prefix_cache(cluster):
    a, b = cluster["a"], cluster["start"]("b")
    sessions = [f"conv-{i}" for i in range(4)]
    # 16-token first turns: one full prefix-cache block, and the prefill shape earlier tests compiled
    prompts = {s: [(7 * i + j) % 200 + 1 for j in range(16)] for i, s in enumerate(sessions)}
    starts = {s: 0 for s in sessions}
    cached = []
    with RemoteInferenceClient([a, b]) as client:
        for turn in range(3):
            reqs = [GenerateRequest(prompts[s], max_tokens=3, temperature=0.0, return_routed_experts=True,
                                    routed_experts_prompt_start=starts[s], session_id=s) for s in sessions]
            outs = client.generate(reqs)
            for s, out in zip(sessions, outs):
                assert out.routed_experts.shape[0] == len(prompts[s]) - starts[s] + len(out.output_ids) - 1
                starts[s] = len(prompts[s]) + len(out.output_ids) - 1
                prompts[s] = prompts[s] + out.output_ids + [5, 6]  # next turn: the conversation so far
                cached.append(out.cached_tokens if turn else None)
    per = [httpx.get(u + "/v1/stats").json()["sessions"] for u in (a, b)]
    for s in sessions:
        assert sorted([per[0].get(s, 0), per[1].get(s, 0)]) == [0, 3], (s, per)  # one replica per session
    assert all(c >= 16 for c in cached if c is not None), cached  # later turns reuse the earlier blocks


def test_sigterm_mid_run_answers_or_refuses_cleanly_and_exits_0(cluster):
    """Requests racing SIGTERM either complete (200, a full answer) or are refused cleanly (no
    connection, or 503); never a 5xx or a cut-off body. Then the processes exit with status 0."""
    url = cluster["a"]
    results = []

    def hammer():
        body = {"prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(2000):
                try:
                    r = http.post("/v1/generate", json=body)
                except httpx.TransportError:
                    results.append("refused")
                    return
                results.append(r.status_code if r.status_code != 200 else len(r.json()["output_ids"]))

    base = httpx.get(url + "/v1/stats").json()["requests"]
    thread = threading.Thread(target=hammer)
    thread.start()
    while httpx.get(url + "/v1/stats").json()["requests"] - base < 3:
        pass
    for name in list(cluster["procs"]):
        proc, _ = cluster["procs"][name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
            assert "Traceback" not in out, out
    thread.join(60)
    assert results.count(4) >= 3 and results[-1] in ("refused", 503), results[-5:]
    assert set(results) <= {4, 503, "refused"}, set(results)
