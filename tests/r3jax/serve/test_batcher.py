"""The bridge's submit_many: the first error raises and cancels the requests still running, whether the
engine queues a batch itself (submit_many) or only one request at a time (submit)."""

import asyncio
import concurrent.futures

import pytest


class _OneAtATime:
    """An engine-like object with submit alone: request "bad" fails at once, the others never finish."""

    max_batch_size = 4

    def __init__(self):
        self.futures = []

    def submit(self, request, on_token=None):
        f = concurrent.futures.Future()
        if request == "bad":
            f.set_exception(ValueError("bad request"))
        self.futures.append(f)
        return f


class _Batched(_OneAtATime):
    def submit_many(self, requests, on_tokens=None):
        return [self.submit(r) for r in requests]


@pytest.mark.parametrize("engine_cls", [_OneAtATime, _Batched])
def test_one_failure_cancels_the_others(engine_cls):
    from r3jax.serve.batcher import EngineBridge

    engine = engine_cls()
    bridge = EngineBridge(engine)

    async def go():
        with pytest.raises(ValueError, match="bad request"):
            await bridge.submit_many(["a", "bad", "b"])
        await asyncio.sleep(0)  # the cancelled tasks run their cleanup
        return bridge.in_flight

    assert asyncio.run(go()) == 0
    assert [f.cancelled() for f in engine.futures] == [True, False, True]
    assert bridge.stats["requests"] == 3
