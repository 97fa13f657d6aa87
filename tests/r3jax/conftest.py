"""Helpers for the tests that serve over HTTP (tests/r3jax/serve, rollout, ...): uvicorn in a
background thread or a subprocess on a free loopback port, readiness by polling GET /health, a
deterministic fake engine for client-logic tests, and SkyRL's own client modules."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def wait_healthy(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``GET /health`` until it answers 200 (or fail after ``timeout`` s / if ``proc`` died)."""
    from r3jax.serve.client import wait_healthy as wait

    try:
        wait(url, timeout=timeout, poll_s=0.02, proc=proc)
    except RuntimeError as e:
        raise RuntimeError(f"{e}: {proc.stdout.read() if proc is not None and proc.stdout else ''}") from None


class ThreadServer:
    """uvicorn running ``app`` in a daemon thread on 127.0.0.1 (port 0: a free one)."""

    def __init__(self, app, port: int = 0, graceful_timeout: float = 10.0, wait: bool = True):
        import uvicorn

        from r3jax.serve.server import bind

        self.sock = bind("127.0.0.1", port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False,
                                                    timeout_graceful_shutdown=graceful_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        if wait:  # until /health says 200: the app has warmed up its engine
            wait_healthy(self.url, timeout=300)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server thread did not stop"


@contextlib.contextmanager
def thread_server(app, port: int = 0, **kw):
    srv = ThreadServer(app, port, **kw)
    try:
        yield srv
    finally:
        if srv.thread.is_alive():
            srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(port: int, *args: str, cache_dir: Path) -> subprocess.Popen:
    """``python -m r3jax serve --model tiny`` in a subprocess. A persistent JAX compilation cache in
    ``cache_dir`` (shared by the test's server processes only) makes restarts cheap."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           "XLA_FLAGS": os.environ.get("R3JAX_TEST_XLA_FLAGS", "")}  # one device
    cmd = [sys.executable, "-m", "r3jax", "serve", "--model", "tiny", "--host", "127.0.0.1",
           "--port", str(port), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class FakeEngine:
    """Engine stand-in (no JAX): token t of a reply is (sum(prompt) + t) % V; route row i is
    ``(i + l + k) % E``; ``gate`` (a threading.Event) can hold every generate call. It has no
    ``submit``: the app's bridge runs ``generate([request])`` on ``max_batch_size`` threads (its
    "slots"); ``warm_gate`` can hold ``warmup``."""

    def __init__(self, max_seq_len: int = 64, max_batch_size: int = 4):
        from models import MoeConfig

        self.config = MoeConfig.tiny()
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.moe_layer_ids = self.config.moe_layer_ids
        self.weight_version, self.batches, self.gate, self.warm_gate = 0, [], None, None
        self.stats = {"requests": 0}
        self.warmed_up = False

    def warmup(self):
        if self.warm_gate is not None:
            self.warm_gate.wait(30)
        self.warmed_up = True
        return {"programs": 0, "seconds": 0.0}

    def generate(self, requests):
        from r3jax.engine import GenerateOutput
        from r3jax.routes import route_dtype

        if self.gate is not None:
            self.gate.wait(30)
        self.batches.append(len(requests))
        outs = []
        for r in requests:
            r.validate(vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len)
            p, g, s = len(r.prompt_ids), r.max_tokens, r.routed_experts_prompt_start
            lk = np.add.outer(np.arange(2), np.arange(2))
            rows = ((np.arange(p + g - 1)[:, None, None] + lk) % 8).astype(route_dtype(8))
            outs.append(GenerateOutput(
                [(sum(r.prompt_ids) + t) % self.config.vocab_size for t in range(g)],
                [-0.5 * t for t in range(g)] if r.return_logprobs else None, "length",
                rows[s:] if r.return_routed_experts else None, p, 0, self.weight_version, s))
        self.stats["requests"] += len(requests)
        return outs

    def set_weights(self, state, abort_in_flight: bool = False, *, mode=None, version=None) -> int:
        from r3jax.checks import check_int

        if version is not None:
            check_int("version", version, self.weight_version + 1)
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version


SKYRL_DIR = REPO / ".venv" / "peers" / "skyrl-0.4.0"  # unpacked by `make venv` (Makefile: skyrl-client)


def update_mid_call(engine, requests, params, mode: str, at: int = 3):
    """Submit ``requests``; once the first has sampled ``at`` tokens, hold the scheduler (inside its token
    callback) until ``engine.set_weights(params, mode=mode)`` is queued, so the update lands mid-request
    whatever the machine's speed. Returns (futures, new version)."""
    import threading
    import time

    ready, queued, count, result = threading.Event(), threading.Event(), [0], {}

    def on_token(token, logprob):
        count[0] += 1
        if count[0] == at:
            ready.set()
            queued.wait(60)

    futures = [engine.submit(requests[0], on_token=on_token)] + [engine.submit(r) for r in requests[1:]]
    assert ready.wait(60)
    swap = threading.Thread(target=lambda: result.setdefault("v", engine.set_weights(params, mode=mode)))
    swap.start()
    deadline = time.monotonic() + 60
    while not engine._sched.controls and time.monotonic() < deadline:
        time.sleep(0.001)
    queued.set()
    swap.join(120)
    return futures, result["v"]


class HeldRequest:
    """A request submitted straight to ``engine`` whose token callback holds the scheduler at each
    token count in ``at`` until :meth:`release` (so whatever a test queues meanwhile, over HTTP too,
    lands at a known point on any machine). :meth:`reached` waits for a hold; :meth:`until` polls a
    condition (e.g. ``len(engine._sched.waiting) == 1``)."""

    def __init__(self, engine, at=(2, 34), max_tokens: int = 45):
        import threading

        from r3jax.engine import GenerateRequest

        self._reached = {n: threading.Event() for n in at}
        self._go = {n: threading.Event() for n in at}
        self._count = 0
        self.future = engine.submit(GenerateRequest([9, 8], max_tokens=max_tokens, temperature=0.0), on_token=self._hold)

    def _hold(self, token, logprob):
        self._count += 1
        if self._count in self._reached:
            self._reached[self._count].set()
            assert self._go[self._count].wait(60)

    def reached(self, n: int) -> None:
        assert self._reached[n].wait(60), f"the held request never sampled token {n}"

    def release(self, n: int) -> None:
        self._go[n].set()

    @staticmethod
    def until(cond, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert cond()


@pytest.fixture(scope="session")
def skyrl_client():
    """SkyRL 0.4.0's own client modules, imported from its unpacked wheel: ``(remote_inference_client,
    generate_wire, routed_experts)``. Only ``skyrl.backends``' package ``__init__`` is skipped (it pulls
    in the Tinker API, whose pydantic TypedDicts need Python 3.12); the client's code runs unchanged."""
    import importlib
    import types

    root = Path(os.environ.get("R3JAX_SKYRL_DIR", SKYRL_DIR))
    if not (root / "skyrl" / "backends").is_dir():
        pytest.skip(f"SkyRL 0.4.0 not unpacked at {root} (run `make skyrl-client`; needs PyPI)")
    for dep in ("aiohttp", "orjson", "pybase64", "loguru", "rich", "torch"):
        pytest.importorskip(dep, reason=f"SkyRL's client imports {dep} (the 'peers' / 'parity' extras)")
    sys.path.append(str(root))  # stays: SkyRL's modules may import more of themselves later
    importlib.import_module("skyrl")
    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [str(root / "skyrl" / "backends")]
    sys.modules.setdefault("skyrl.backends", backends)
    base = "skyrl.backends.skyrl_train."
    return tuple(importlib.import_module(base + m) for m in
                 ("inference_servers.remote_inference_client", "inference_servers.generate_wire",
                  "utils.routed_experts"))


@pytest.fixture(scope="session")
def serve_helpers():
    """The helpers above, as one namespace (test modules cannot import this conftest)."""
    class H:
        pass
    h = H()
    h.wait_healthy, h.thread_server, h.ThreadServer = wait_healthy, thread_server, ThreadServer
    h.free_port, h.start_process, h.FakeEngine, h.REPO = free_port, start_process, FakeEngine, REPO
    h.update_mid_call, h.HeldRequest = update_mid_call, HeldRequest
    return h
