"""``RemoteInferenceClient``: the in-process ``Engine``'s ``generate`` over HTTP, to one or more servers.

- Same call and result type as ``Engine.generate``: ``generate(list[GenerateRequest]) ->
  list[GenerateOutput]`` (sync), ``await agenerate(...)`` (async, ``httpx.AsyncClient``). Outputs come
  back in request order, checked by :mod:`r3jax.serve.protocol` (routes: exactly ``P - s + G - 1``
  rows). ``routed_experts_prompt_start`` is checked before anything is sent.
- Retries (:mod:`.retry`): each request is resent whole while a new attempt can start within
  ``retry_timeout_s`` (default 120 s: a restart that finds its compilation cache) on connection
  errors, timeouts, 408, 429, 502, 503, 504 and "no live replica", with capped exponential backoff
  and full jitter, and the server's ``Retry-After`` honoured. While a replica reports
  ``warming_up`` on ``GET /health`` the budget is ``warmup_timeout_s`` instead (default 300 s: a
  cold start compiling every program). Other 4xx raise :class:`RemoteInputError` (a ValueError,
  like the engine's) at once; other 5xx raise :class:`RemoteError` at once.
- Several URLs (:mod:`.replicas`): sessions stick to a replica by rendezvous hashing, other requests
  go to the least loaded; a replica that fails, is warming up or reports a failed engine (503
  ``{"status": "failed", "reason": ...}``) is skipped until ``GET /health`` answers 200 again. A
  request that timed out asks its replica's ``/health`` (a slow replica stays in rotation, a
  warming or failed one leaves it).
- ``protocol`` (:mod:`.protocols`): ``"r3jax"`` (``binary_routes`` asks for raw route bytes),
  ``"skyrl"``, ``"vllm"`` or ``"sglang"`` (the peers' request forms: the same requests and outputs,
  the same row rule). The peers' servers do not report E, K and the MoE layers: pass ``model_info``
  (an r3jax server answers ``GET /v1/model``, which the client then reads itself); ``model`` is the
  name sent in SkyRL / vLLM bodies.
- ``stats`` (:mod:`.stats`): requests, attempts, retries, bytes and decode time, for experiments.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Sequence

import httpx

from r3jax.serve.client import protocols
from r3jax.serve.client.errors import RemoteError, RemoteInputError, Retryable, json_body, raise_for
from r3jax.serve.client.pool import Pools, Runner
from r3jax.serve.client.replicas import OK, Health, Replica, Replicas
from r3jax.serve.client.retry import RetryPolicy, call_with_retries
from r3jax.serve.client.stats import ClientStats
from r3jax.serve.protocol import ServedModel

_NOT_RETRIED = (httpx.LocalProtocolError, httpx.UnsupportedProtocol)  # our own request is malformed
_NOT_A_DEATH = (httpx.ReadTimeout, httpx.WriteTimeout)  # slow, not gone: in rotation unless /health says otherwise


class RemoteInferenceClient:
    """HTTP client with the ``Engine.generate`` interface. Use as a (async) context manager or call
    :meth:`close` / :meth:`aclose`.

    ``timeout``: seconds per HTTP operation (connect, each read). ``retry_timeout_s``: the retry
    budget in seconds from a request's first attempt; ``warmup_timeout_s``: that budget while a
    replica reports ``warming_up`` (it will serve once its programs are compiled; the larger of the
    two applies); ``max_retries``: an optional count limit on top (None: time only). ``backoff_s`` /
    ``max_backoff_s``: the first and the largest backoff cap. ``health_interval_s``: how often a
    replica out of rotation is asked ``GET /health``. ``transport``: an ``httpx.AsyncBaseTransport``
    for every connection (e.g. ``httpx.ASGITransport`` for an in-process app); None: TCP.
    """

    def __init__(self, urls: str | Sequence[str], *, api_key: str | None = None, timeout: float = 60.0,
                 retry_timeout_s: float = 120.0, max_retries: int | None = None, max_concurrency: int = 64,
                 backoff_s: float = 0.05, max_backoff_s: float = 2.0, binary_routes: bool = True,
                 protocol: str = "r3jax", model_info: dict | ServedModel | None = None,
                 model: str | None = None, health_interval_s: float = 0.5, warmup_timeout_s: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"urls={urls!r}: expected one or more http(s):// URLs")
        self._proto = protocols.make(protocol, binary_routes=binary_routes, model=model)
        self._proto_model = model
        self.protocol = self._proto.name
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency!r}: expected an int >= 1")
        self.retry = RetryPolicy(timeout_s=retry_timeout_s, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                                 max_retries=max_retries, warmup_timeout_s=warmup_timeout_s)
        self.timeout, self.max_concurrency, self.binary_routes = timeout, max_concurrency, binary_routes
        # the retry loop's clock and sleep (tests replace both to run minutes of retries in no time)
        self._clock, self._sleep = time.monotonic, asyncio.sleep
        self.replicas = Replicas(urls, self._healthy, health_interval_s=health_interval_s,
                                 clock=lambda: self._clock())
        if isinstance(model_info, dict):
            model_info = ServedModel.from_json(model_info)
        self._given_info = model_info
        for r in self.replicas:
            r.info = model_info
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        kw = {} if transport is None else {"transport": transport}
        self._pools = Pools(max_concurrency, timeout=timeout, headers=headers, **kw)
        self._runner = Runner()
        self._stats = ClientStats()

    # ---- observability ---------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Cumulative client counters (see :mod:`r3jax.serve.client.stats`)."""
        return self._stats.snapshot()

    @property
    def retries(self) -> int:
        """Attempts beyond the first, all requests together."""
        return self._stats["retries"]

    # ---- one attempt -----------------------------------------------------------------------
    async def _healthy(self, url: str) -> Health:
        """What ``GET /health`` of ``url`` says: 200 is "ok"; otherwise the body's ``status`` and
        ``reason`` (an r3jax server: ``warming_up``, ``failed``, ``shutting_down``), else the HTTP status."""
        try:
            async with self._pools.current().client() as client:
                r = await client.get(url + "/health", timeout=min(self.timeout, 2.0))
        except httpx.HTTPError as e:
            return Health("down", f"{type(e).__name__}: {e}")
        if r.status_code == 200:
            return OK
        body = json_body(r)
        status, reason = body.get("status"), body.get("reason") or body.get("detail")
        return Health(status if isinstance(status, str) and status != "ok" else f"HTTP {r.status_code}",
                      None if reason is None else str(reason))

    @contextlib.asynccontextmanager
    async def _on(self, replica: Replica):
        """Count an attempt on ``replica``; turn its transport failures into :class:`Retryable` and
        take it out of rotation when it looks gone."""
        replica.in_flight += 1
        try:
            yield
        except _NOT_RETRIED:
            raise
        except httpx.TransportError as e:
            if not isinstance(e, _NOT_A_DEATH):
                self.replicas.mark_dead(replica, health=Health("down", f"{type(e).__name__}: {e}"))
            else:  # slow, or queued behind a warm-up: /health tells (a warming or failed one leaves rotation)
                await self.replicas.probe(replica)
            raise Retryable(f"{replica.url}: {type(e).__name__}: {e}") from e
        except Retryable as e:
            # 408/429/502/503/504: warming up, draining, full, or a failed engine; /health tells which
            self.replicas.mark_dead(replica, e.retry_after, Health("unavailable", str(e)))
            if e.retry_after is not None and self.replicas.any_alive():
                # its Retry-After is about that replica: another live one can take the retry now
                raise Retryable(str(e)) from e
            raise
        finally:
            replica.in_flight -= 1

    async def _get(self, replica: Replica, path: str) -> dict:
        async with self._pools.current().client() as client:
            r = await client.get(replica.url + path)
        raise_for(r, replica.url)
        return r.json()

    async def _info(self, replica: Replica) -> ServedModel:
        if replica.info is None:
            try:
                replica.info = ServedModel.from_json(await self._get(replica, "/v1/model"))
            except RemoteInputError as e:
                if e.status != 404:
                    raise
                raise ValueError(f"model_info=None: {replica.url} has no GET /v1/model (not an r3jax server); "
                                 f"protocol={self.protocol!r} needs model_info={{'num_experts', 'top_k', "
                                 "'moe_layer_ids'}") from None
        return replica.info

    async def _attempt(self, request, body: bytes, proto=None):
        proto = self._proto if proto is None else proto
        replica = await self.replicas.pick(request.session_id)
        replica.sent += 1
        self._stats.add(attempts=1)
        async with self._on(replica):
            info = await self._info(replica)
            async with self._pools.current().client() as client:
                r = await client.post(replica.url + proto.path(request), content=body, headers=proto.headers(request))
            raise_for(r, replica.url)
        media_type = r.headers.get("content-type", "")
        t0 = time.perf_counter()
        out = proto.decode(r.content, media_type, request, info, replica.url, r.headers)
        routes = getattr(out, "routed_experts", None)
        rows = 0 if routes is None else int(routes.shape[0])
        self._stats.add(responses=1, decode_s=time.perf_counter() - t0, body_bytes=len(r.content),
                        route_bytes=proto.route_bytes(r.content, media_type), route_rows=rows)
        return out

    def _count_retry(self, error: Retryable, wait: float) -> None:
        self._stats.add(retries=1, retry_wait_s=wait)

    async def _one(self, request, body: bytes, proto=None):
        async with self._pools.current().sem:
            t0 = time.perf_counter()
            try:
                out = await call_with_retries(lambda: self._attempt(request, body, proto), self.retry,
                                              clock=self._clock, sleep=self._sleep, on_retry=self._count_retry,
                                              warming=self.replicas.warming)
            except BaseException:
                self._stats.add(failed=1)
                raise
            self._stats.add(requests=1, request_s=time.perf_counter() - t0)
            return out

    # ---- the Engine interface --------------------------------------------------------------
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
        bodies = [self._proto.encode(r) for r in requests]  # validates s before anything is sent
        tasks = []
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._one(r, b)) for r, b in zip(requests, bodies)]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    def generate(self, requests: Sequence) -> list:
        """Synchronous :meth:`agenerate` (same signature and result as ``Engine.generate``)."""
        return self._runner.run(self.agenerate(requests))

    async def achat(self, requests: Sequence) -> list:
        """``POST /v1/chat/completions`` for each :class:`~r3jax.serve.client.chat.ChatRequest`, in order:
        :class:`~r3jax.serve.client.chat.ChatOutput` (the rendered ``prompt_ids``, tokens, logprobs, the
        route rows ``[s, P + G - 1)`` of the rendered prompt, the assistant message). Retries, replicas
        and failure handling as :meth:`agenerate`."""
        from r3jax.serve.client.chat import ChatRequest

        if isinstance(requests, ChatRequest) or not isinstance(requests, Sequence):
            raise ValueError(f"requests={type(requests).__name__}: expected a list of ChatRequest")
        for i, req in enumerate(requests):
            if not isinstance(req, ChatRequest):
                raise ValueError(f"requests[{i}]={type(req).__name__}: expected a ChatRequest")
        proto = protocols.VLLMChat(model=self._proto_model)
        bodies = [proto.encode(r) for r in requests]
        tasks = []
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._one(r, b, proto)) for r, b in zip(requests, bodies)]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    def chat(self, requests: Sequence) -> list:
        """Synchronous :meth:`achat`."""
        return self._runner.run(self.achat(requests))

    async def atokenize_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
                             session_id: str | None = None) -> list[int]:
        """vLLM's chat ``POST /tokenize``: the prompt ids the server's chat template makes of ``messages``
        (with the generation prompt), i.e. what ``/v1/chat/completions`` would prompt with."""
        from r3jax.serve.client.chat import ChatRequest

        request = ChatRequest(messages=messages, tools=tools, session_id=session_id)
        proto = protocols.ChatTokenize(model=self._proto_model)
        return await self._one(request, proto.encode(request), proto)

    def tokenize_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
                      session_id: str | None = None) -> list[int]:
        """Synchronous :meth:`atokenize_chat`."""
        return self._runner.run(self.atokenize_chat(messages, tools, session_id=session_id))

    async def amodel_info(self) -> dict:
        """``GET /v1/model`` of a live replica (or the ``model_info`` given to the client)."""
        info = self._given_info
        if info is not None:
            return {"num_experts": info.num_experts, "top_k": info.top_k, "num_moe_layers": len(info.moe_layer_ids),
                    "moe_layer_ids": list(info.moe_layer_ids), "vocab_size": info.vocab_size,
                    "max_seq_len": info.max_seq_len}

        async def attempt():
            replica = await self.replicas.pick(None)
            async with self._on(replica):
                return await self._get(replica, "/v1/model")
        return await call_with_retries(attempt, self.retry, clock=self._clock, sleep=self._sleep,
                                       warming=self.replicas.warming, what="GET /v1/model")

    def model_info(self) -> dict:
        return self._runner.run(self.amodel_info())

    async def ahealth(self) -> dict[str, bool]:
        """``{url: answers GET /health with 200}`` for every replica (also refreshes liveness; what
        each said is ``client.replicas.all[i].health``: status and reason)."""
        return dict(zip([r.url for r in self.replicas],
                        await asyncio.gather(*(self.replicas.probe(r) for r in self.replicas))))

    def health(self) -> dict[str, bool]:
        return self._runner.run(self.ahealth())

    async def aupdate_weights(self, path: str, format: str = "orbax") -> list[int]:
        """``POST /v1/weights`` to every replica (each loads ``path`` itself); their new weight_versions.
        Not retried: a lost answer would make a retry load the weights twice."""
        async def post(replica):
            async with self._pools.current().client() as client:
                r = await client.post(replica.url + "/v1/weights", json={"path": str(path), "format": format})
            try:
                raise_for(r, replica.url)
            except Retryable as e:
                raise RemoteError(f"POST /v1/weights: {e}") from None
            return int(r.json()["weight_version"])
        return list(await asyncio.gather(*(post(r) for r in self.replicas)))

    def update_weights(self, path: str, format: str = "orbax") -> list[int]:
        return self._runner.run(self.aupdate_weights(path, format))

    # ---- lifecycle -------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close the connections opened from the running event loop (and the sync runner's)."""
        await self._pools.aclose_current()
        runner_loop = self._runner.loop
        if runner_loop is not None and runner_loop is not asyncio.get_running_loop():
            await self._runner.arun(self._pools.aclose_current())
            self._runner.stop()

    def close(self) -> None:
        """Close the sync runner's connections and stop its thread."""
        if self._runner.loop is not None:
            self._runner.run(self._pools.aclose_current())
            self._runner.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
