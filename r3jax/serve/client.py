"""``RemoteInferenceClient``: the in-process ``Engine``'s ``generate`` over HTTP, to one or more servers.

- Same call and result type as ``Engine.generate``: ``generate(list[GenerateRequest]) ->
  list[GenerateOutput]`` (sync), ``await agenerate(...)`` (async, ``httpx.AsyncClient``). Outputs come
  back in request order, checked by :mod:`r3jax.serve.protocol` (routes: exactly ``P - s + G - 1``
  rows). ``routed_experts_prompt_start`` is checked before anything is sent.
- Each request is sent and retried whole (exponential backoff with jitter) on connection errors,
  timeouts and 502/503/504, at most ``max_retries`` times. Generation is stateless on the server, so a
  retried request cannot be half-applied; 4xx answers raise :class:`RemoteInputError` (a ValueError,
  like the engine's) at once.
- Several URLs: requests with the same ``session_id`` go to the same replica (rendezvous hashing over
  the live replicas, so the prefix cache hits); the others go to the replica with the fewest requests
  in flight. A replica that fails a connection is skipped until it answers ``GET /health`` again.
- ``protocol="sglang"`` drives SGLang's native ``/generate`` instead (pass ``model_info``: SGLang does
  not report E, K and the MoE layers); ``binary_routes`` asks an r3jax server for raw route bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import threading
import time
from typing import Sequence

import httpx

from r3jax.serve import protocol
from r3jax.serve.protocol import ServedModel

try:
    import sniffio  # noqa: F401
except ImportError:
    # httpcore imports sniffio on every async request; when it is absent each failing import walks
    # sys.path (~0.4 ms). Caching the miss keeps the same outcome (asyncio) at no cost.
    import sys

    sys.modules.setdefault("sniffio", None)

_RETRY_STATUS = (502, 503, 504)
_NOT_RETRIED = (httpx.LocalProtocolError, httpx.UnsupportedProtocol)  # our own request is malformed


class RemoteError(RuntimeError):
    """The request could not be served (replicas down past the retries, or a 5xx)."""


class RemoteInputError(ValueError):
    """The server refused the request (4xx): ``status``, ``field`` and ``detail`` from its JSON body."""

    def __init__(self, status: int, field: str | None, detail: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {detail}" + (f" (field {field})" if field else ""))
        self.status, self.field, self.detail = status, field, detail


class _Retryable(Exception):
    pass


class _Replica:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.alive, self.in_flight, self.next_probe = True, 0, 0.0
        self.info: ServedModel | None = None
        self.probe: asyncio.Future | None = None
        self.sent = 0  # requests sent (attempts), for tests and load reports


class _Pool:
    """Connections of one event loop: ``ceil(max_concurrency / SHARD)`` ``httpx.AsyncClient``s of at
    most SHARD connections each, and a semaphore of ``max_concurrency``. (httpcore's pool does work
    proportional to its size for every request; small shards keep that cost flat.)"""

    SHARD = 8

    def __init__(self, max_concurrency: int, **kw):
        n = -(-max_concurrency // self.SHARD)
        size = -(-max_concurrency // n)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self.clients = [httpx.AsyncClient(limits=limits, **kw) for _ in range(n)]
        self.active = [0] * n
        self.sem = asyncio.Semaphore(max_concurrency)

    @contextlib.asynccontextmanager
    async def client(self):
        i = min(range(len(self.clients)), key=self.active.__getitem__)  # least busy shard
        self.active[i] += 1
        try:
            yield self.clients[i]
        finally:
            self.active[i] -= 1

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


class RemoteInferenceClient:
    """HTTP client with the ``Engine.generate`` interface. Use as a (async) context manager or call
    :meth:`close` / :meth:`aclose`."""

    def __init__(self, urls: str | Sequence[str], *, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 5, max_concurrency: int = 64, backoff_s: float = 0.05,
                 max_backoff_s: float = 2.0, binary_routes: bool = True, protocol: str = "r3jax",
                 model_info: dict | ServedModel | None = None, health_interval_s: float = 0.5):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"urls={urls!r}: expected one or more http(s):// URLs")
        if protocol not in ("r3jax", "sglang"):
            raise ValueError(f"protocol={protocol!r}: expected 'r3jax' or 'sglang'")
        if protocol == "sglang" and model_info is None:
            raise ValueError("model_info=None: protocol='sglang' needs model_info (num_experts, top_k, "
                             "moe_layer_ids): SGLang does not report them")
        for name, value, lo in (("max_retries", max_retries, 0), ("max_concurrency", max_concurrency, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name}={value!r}: expected an int >= {lo}")
        self.replicas = [_Replica(u) for u in urls]
        self.timeout, self.max_retries, self.max_concurrency = timeout, max_retries, max_concurrency
        self.backoff_s, self.max_backoff_s, self.health_interval_s = backoff_s, max_backoff_s, health_interval_s
        self.binary_routes, self.protocol = binary_routes, protocol
        if isinstance(model_info, dict):
            model_info = ServedModel.from_json(model_info)
        for r in self.replicas:
            r.info = model_info
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._loops: dict[asyncio.AbstractEventLoop, _Pool] = {}
        self._runner: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None
        self._runner_lock = threading.Lock()
        self._rr = 0
        self.retries = 0  # attempts beyond the first, all requests together

    # ---- plumbing --------------------------------------------------------------------------
    def _http(self) -> "_Pool":
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            for stale in [lp for lp in self._loops if lp.is_closed()]:  # e.g. an earlier asyncio.run
                del self._loops[stale]
            self._loops[loop] = _Pool(self.max_concurrency, timeout=self.timeout, headers=self._headers)
        return self._loops[loop]

    def _sync(self, coro):
        """Run ``coro`` on the client's private event loop thread and wait for it."""
        with self._runner_lock:
            if self._runner is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="r3jax-client", daemon=True)
                thread.start()
                self._runner = (loop, thread)
        return asyncio.run_coroutine_threadsafe(coro, self._runner[0]).result()

    def _backoff(self, attempt: int) -> float:
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return cap / 2 + random.uniform(0, cap / 2)  # "equal jitter": spread, but never ~0

    # ---- replica choice --------------------------------------------------------------------
    async def _probe(self, replica: _Replica) -> None:
        try:
            async with self._http().client() as client:
                r = await client.get(replica.url + "/health", timeout=min(self.timeout, 2.0))
            replica.alive = r.status_code == 200
        except httpx.HTTPError:
            replica.alive = False
        if not replica.alive:
            replica.next_probe = time.monotonic() + self.health_interval_s

    def _mark_dead(self, replica: _Replica) -> None:
        replica.alive = False
        replica.next_probe = time.monotonic() + self.health_interval_s

    async def _pick(self, session_id: str | None) -> _Replica:
        now, loop = time.monotonic(), asyncio.get_running_loop()
        for r in self.replicas:  # re-probe dead replicas in the background
            if not r.alive and r.next_probe <= now and (r.probe is None or r.probe.done()
                                                         or r.probe.get_loop() is not loop):
                r.probe = loop.create_task(self._probe(r))
        alive = [r for r in self.replicas if r.alive]
        if not alive:  # wait for this round of probes rather than fail at once
            probes = [r.probe for r in self.replicas if r.probe is not None and r.probe.get_loop() is loop]
            await asyncio.gather(*probes, return_exceptions=True)
            alive = [r for r in self.replicas if r.alive]
            if not alive:
                raise _Retryable(f"no live replica among {[r.url for r in self.replicas]}")
        if session_id is not None:  # rendezvous hashing: stable, and only moves if its replica dies
            key = lambda r: hashlib.blake2b(f"{session_id}\0{r.url}".encode(), digest_size=8).digest()
            return max(alive, key=key)
        self._rr += 1
        return min(alive, key=lambda r: (r.in_flight, (self.replicas.index(r) - self._rr) % len(self.replicas)))

    async def _info(self, replica: _Replica) -> ServedModel:
        if replica.info is None:
            replica.info = ServedModel.from_json(await self._get(replica, "/v1/model"))
        return replica.info

    # ---- requests --------------------------------------------------------------------------
    async def _get(self, replica: _Replica, path: str) -> dict:
        async with self._http().client() as client:
            r = await client.get(replica.url + path)
        self._raise_for(r, replica)
        return r.json()

    def _raise_for(self, r: httpx.Response, replica: _Replica) -> None:
        if r.status_code < 400:
            return
        if r.status_code in _RETRY_STATUS:
            raise _Retryable(f"{replica.url}: HTTP {r.status_code}")
        try:
            body = r.json()
        except ValueError:
            body = {"detail": r.text[:200]}
        body = body if isinstance(body, dict) else {"detail": str(body)}
        if r.status_code < 500:
            raise RemoteInputError(r.status_code, body.get("field"), str(body.get("detail")), replica.url)
        raise RemoteError(f"{replica.url}: HTTP {r.status_code}: {body.get('detail')}")

    async def _attempt(self, request, body: bytes, replica: _Replica):
        info = await self._info(replica)
        headers = {"Content-Type": "application/json"}
        if self.protocol == "sglang":
            async with self._http().client() as client:
                r = await client.post(replica.url + "/generate", content=body, headers=headers)
            self._raise_for(r, replica)
            return protocol.parse_sglang(r.content, request, info, replica.url)
        if self.binary_routes:
            headers["Accept"] = f"{protocol.BINARY_MEDIA_TYPE}, application/json"
        async with self._http().client() as client:
            r = await client.post(replica.url + "/v1/generate", content=body, headers=headers)
        self._raise_for(r, replica)
        return protocol.parse_response(r.content, r.headers.get("content-type", ""), request, info, replica.url)

    async def _one(self, request, body: bytes):
        async with self._http().sem:
            attempt = 0
            while True:
                replica = None
                try:
                    replica = await self._pick(request.session_id)
                    replica.in_flight += 1
                    replica.sent += 1
                    try:
                        return await self._attempt(request, body, replica)
                    finally:
                        replica.in_flight -= 1
                except _NOT_RETRIED:
                    raise
                except (httpx.TransportError, _Retryable) as e:
                    if replica is not None and not isinstance(e, (httpx.ReadTimeout, httpx.WriteTimeout)):
                        self._mark_dead(replica)  # refused, reset, 503: skip it until /health answers
                    attempt += 1
                    if attempt > self.max_retries:
                        raise RemoteError(f"request failed after {attempt} attempts: "
                                          f"{type(e).__name__}: {e}") from e
                    self.retries += 1
                    await asyncio.sleep(self._backoff(attempt))

    async def agenerate(self, requests: Sequence) -> list:
        """``Engine.generate`` over HTTP: one output per request, in order. If any request fails for
        good the others are cancelled and the error is raised (a call never half-succeeds)."""
        from r3jax.engine import GenerateRequest

        if isinstance(requests, GenerateRequest) or not isinstance(requests, Sequence):
            raise ValueError(f"requests={type(requests).__name__}: expected a list of GenerateRequest")
        for i, req in enumerate(requests):
            if not isinstance(req, GenerateRequest):
                raise ValueError(f"requests[{i}]={type(req).__name__}: expected a GenerateRequest")
        requests = list(requests)
        encode = protocol.sglang_body if self.protocol == "sglang" else protocol.request_body
        bodies = [json.dumps(encode(r), separators=(",", ":")).encode() for r in requests]  # validates s
        tasks = []
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._one(r, b)) for r, b in zip(requests, bodies)]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    def generate(self, requests: Sequence) -> list:
        """Synchronous :meth:`agenerate` (same signature and result as ``Engine.generate``)."""
        return self._sync(self.agenerate(requests))

    async def amodel_info(self) -> dict:
        """``GET /v1/model`` of a live replica (with ``protocol="sglang"``: the given ``model_info``)."""
        if self.protocol == "sglang":
            info = self.replicas[0].info
            return {"num_experts": info.num_experts, "top_k": info.top_k, "num_moe_layers": len(info.moe_layer_ids),
                    "moe_layer_ids": list(info.moe_layer_ids), "vocab_size": info.vocab_size,
                    "max_seq_len": info.max_seq_len}
        return await self._retrying(lambda r: self._get(r, "/v1/model"))

    def model_info(self) -> dict:
        return self._sync(self.amodel_info())

    async def ahealth(self) -> dict[str, bool]:
        """``{url: answers GET /health with 200}`` for every replica (also refreshes liveness)."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
        return {r.url: r.alive for r in self.replicas}

    def health(self) -> dict[str, bool]:
        return self._sync(self.ahealth())

    async def aupdate_weights(self, path: str, format: str = "orbax") -> list[int]:
        """``POST /v1/weights`` to every replica (each loads ``path`` itself); their new weight_versions."""
        async def post(replica):
            async with self._http().client() as client:
                r = await client.post(replica.url + "/v1/weights", json={"path": str(path), "format": format})
            self._raise_for(r, replica)
            return int(r.json()["weight_version"])
        return list(await asyncio.gather(*(post(r) for r in self.replicas)))

    def update_weights(self, path: str, format: str = "orbax") -> list[int]:
        return self._sync(self.aupdate_weights(path, format))

    async def _retrying(self, fn):
        attempt = 0
        while True:
            replica = None
            try:
                replica = await self._pick(None)
                return await fn(replica)
            except _NOT_RETRIED:
                raise
            except (httpx.TransportError, _Retryable) as e:
                if replica is not None:
                    self._mark_dead(replica)
                attempt += 1
                if attempt > self.max_retries:
                    raise RemoteError(f"failed after {attempt} attempts: {type(e).__name__}: {e}") from e
                await asyncio.sleep(self._backoff(attempt))

    # ---- lifecycle -------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close the connections opened from the running event loop (and the sync runner's)."""
        loop = asyncio.get_running_loop()
        if loop in self._loops:
            await self._loops.pop(loop).aclose()
        if self._runner is not None and self._runner[0] is not loop:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close_runner_client(), self._runner[0]))
            self._stop_runner()

    async def _close_runner_client(self) -> None:
        loop = asyncio.get_running_loop()
        if loop in self._loops:
            await self._loops.pop(loop).aclose()

    def _stop_runner(self) -> None:
        if self._runner is not None:
            loop, thread = self._runner
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._runner = None

    def close(self) -> None:
        """Close the sync runner's connections and stop its thread."""
        if self._runner is not None:
            self._sync(self._close_runner_client())
            self._stop_runner()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
