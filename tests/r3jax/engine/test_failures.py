"""A device program that fails mid-way fails the requests it hit (with its error) instead of leaving
them waiting forever, and the engine keeps serving the next ones."""

import pytest

from r3jax.engine import GenerateRequest


def test_a_failing_prefill_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    req = GenerateRequest([3, 1, 4, 1, 5], max_tokens=3, temperature=0.0, return_routed_experts=True)
    [want] = engine.generate([req])
    real = engine.prefill

    def broken(jobs, slots):
        raise RuntimeError("Array has been deleted with shape=float32[1,16].")  # what a lost buffer raises

    monkeypatch.setattr(engine, "prefill", broken)
    futures = [engine.submit(req) for _ in range(3)]
    for f in futures:
        with pytest.raises(RuntimeError, match="Array has been deleted"):
            f.result(timeout=60)  # never a hang
    monkeypatch.setattr(engine, "prefill", real)
    [again] = engine.generate([req])
    assert again.output_ids == want.output_ids and (again.routed_experts == want.routed_experts).all()
