"""A device program that fails mid-way fails the requests it hit (with its error) instead of leaving
them waiting forever, and the engine keeps serving the next ones; a request whose own preparation
fails fails alone; an engine that cannot recover says so at once (EngineFailedError, /health 503)."""

import threading

import pytest

from r3jax.engine import GenerateRequest


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    req = GenerateRequest([3, 1, 4, 1, 5], max_tokens=3, temperature=0.0, return_routed_experts=True)
    [want] = engine.generate([req])
    real = engine.dispatch

    def broken(layout, inputs):
        raise RuntimeError("Array has been deleted with shape=float32[1,16].")  # what a lost buffer raises

    monkeypatch.setattr(engine, "dispatch", broken)
    futures = [engine.submit(req) for _ in range(3)]
    for f in futures:
        with pytest.raises(RuntimeError, match="Array has been deleted"):
            f.result(timeout=60)  # never a hang
    monkeypatch.setattr(engine, "dispatch", real)
    [again] = engine.generate([req])
    assert again.output_ids == want.output_ids and (again.routed_experts == want.routed_experts).all()


def _hold(engine):
    """Hold the scheduler thread (a control operation that waits); returns the ``release()`` call.
    Requests submitted meanwhile are all admitted together in the next turn."""
    entered, gate = threading.Event(), threading.Event()

    def hold():
        entered.set()
        gate.wait(60)

    thread = threading.Thread(target=engine._sched.control, args=(hold,), kwargs={"drain": False, "abort": False})
    thread.start()
    entered.wait(60)

    def release():
        gate.set()
        thread.join(60)
    return release


def test_a_request_whose_preparation_raises_fails_alone_and_the_others_beside_it_complete(engine, monkeypatch):
    import r3jax.engine.engine as engine_module

    reqs = [GenerateRequest([2, 7, 1, 8][: 2 + i], max_tokens=3, temperature=0.0, seed=i, return_routed_experts=True)
            for i in range(3)]
    want = [engine.generate([r])[0] for r in reqs]
    real = engine_module.seed_words

    def seed_words(seed):
        if seed == 1:
            raise OverflowError("Python integer out of bounds for uint32")  # injected: one request's own data
        return real(seed)

    monkeypatch.setattr(engine_module, "seed_words", seed_words)
    before = engine.stats
    release = _hold(engine)
    futures = [engine.submit(r) for r in reqs]
    release()
    with pytest.raises(OverflowError, match="out of bounds"):
        futures[1].result(timeout=60)
    for i in (0, 2):
        got = futures[i].result(timeout=60)
        assert got.output_ids == want[i].output_ids and (got.routed_experts == want[i].routed_experts).all()
    after = engine.stats
    assert after["failed"] - before["failed"] == 1 and after["requests"] - before["requests"] == 2
    # the other two were admitted together: one step fed both prompts (one prefill row each)
    assert after["prefill_calls"] - before["prefill_calls"] == 2
    assert after["pages_in_use"] == before["pages_in_use"] and after["pages_reserved"] == 0
    assert after["failure"] is None


def test_a_scheduler_that_cannot_recover_fails_fast_with_the_reason_and_health_says_so(tiny_model, make_engine,
                                                                                       monkeypatch):
    from fastapi.testclient import TestClient

    from r3jax.engine import EngineClosed, EngineFailedError
    from r3jax.serve import create_app

    eng = make_engine(tiny_model)
    req = GenerateRequest([3, 1, 4], max_tokens=2, temperature=0.0)

    def broken_dispatch(layout, inputs):
        raise RuntimeError("device lost")

    def broken_reset():
        raise RuntimeError("RESOURCE_EXHAUSTED: cannot allocate the page pool")

    monkeypatch.setattr(eng, "dispatch", broken_dispatch)
    monkeypatch.setattr(eng, "reset_state", broken_reset)
    release = _hold(eng)
    futures = [eng.submit(req) for _ in range(eng.max_batch_size + 1)]  # one more than the slots: it waits
    release()
    for f in futures[:-1]:  # in the failed step: its error
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(timeout=60)  # never a hang
    with pytest.raises(EngineFailedError, match="cannot allocate") as waited:
        futures[-1].result(timeout=60)
    reason = waited.value.reason
    assert "device lost" in reason and "RESOURCE_EXHAUSTED" in reason
    assert eng.failure == reason and eng.stats["failure"] == reason
    with pytest.raises(EngineFailedError, match="cannot allocate") as refused:
        eng.submit(req)  # at once: nothing is queued on a thread that is gone
    assert refused.value.reason == reason and isinstance(refused.value, EngineClosed)  # retryable elsewhere
    with pytest.raises(EngineFailedError):
        eng.warmup()
    http = TestClient(create_app(eng, warmup=False))
    health = http.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "failed", "reason": reason}
    answer = http.post("/v1/generate", json={"prompt_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert answer.status_code == 503 and answer.json()["error"] == "engine_failed"  # retry on another replica
    assert reason in answer.json()["detail"]
