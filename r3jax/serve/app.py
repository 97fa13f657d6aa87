"""FastAPI app around an :class:`r3jax.engine.Engine` (docs/design.md §5).

Endpoints::

    GET  /health        {"status": "ok", "weight_version": n}     (no auth; 503 {"status": "warming_up"}
                        until every device program is compiled, 503 {"status": "failed", "reason": ...}
                        once the engine cannot continue (or its warm-up failed), 503 while shutting down)
    GET  /v1/model      ModelInfo: E, K, L, moe_layer_ids, vocab_size, max_seq_len, weight_version
    POST /v1/generate   GenerateBody -> GenerateResponse (n > 1: GenerateSamplesResponse)
    POST /v1/weights    {"path": dir, "format": "orbax" | "safetensors", "weight_version": n (optional,
                        above the current one; default current + 1)} -> {"weight_version": n};
                        ``?mode=wait`` (default) lets requests in flight finish on the old weights
                        first, ``keep`` swaps between two device steps and lets them go on with the new
                        ones (``weight_versions`` spans say which tokens came from which), ``abort``
                        answers them with what they have (``finish_reason: "abort"``; resubmit prompt +
                        output_ids to go on); ``?abort_in_flight=true`` fails them (503, retryable)
    GET  /v1/stats      request counters, requests per recent session_id, route transfer costs
                        (``routes``: gather_s, encode_s, rows, bytes, responses; gather_s: the engine's
                        seconds copying route rows out of its steps' outputs), the device mesh
                        (``mesh``: data, tensor, expert, devices, expert_parallel) and the engine's stats
    GET  /openapi.json  the schema (no auth)

The peers' forms on the same engine (:mod:`r3jax.serve.peer_app`): SkyRL ``POST /skyrl/v1/generate``
and ``/inference/v1/generate``, vLLM ``POST /v1/completions`` and ``GET /v1/models``, SGLang
``POST /generate``, and ``/tokenize``, ``/detokenize``, ``/finish_session``.

**Binary routes.** A client that sends ``Accept: application/vnd.r3jax.generate+binary`` (the
:data:`BINARY_MEDIA_TYPE`) to ``/v1/generate`` gets a body of
``u32 little-endian n | n bytes of the JSON response | the r3jax.routes.encode_binary frame``; the
JSON has ``routed_experts: null`` and ``routed_experts_binary``: the frame's byte length (with
``n`` > 1 samples, each object of ``outputs`` has its own, and the frames follow in that order). Route bytes
on the wire then equal the raw array plus a small header (no base64).

**Errors.** Bad input is a 4xx with ``{"error": "invalid_request", "field": ..., "detail": ...}``:
400 body not JSON, 413 body over ``max_body_bytes``, 422 a field of the wrong type or value (a string
that is not valid Unicode, e.g. a lone ``"\\ud800"``, included; every number within the engine's
int32 / float32 limits, so one bad request can never fail the others decoding beside it), 401 a
missing or wrong ``Authorization: Bearer <api_key>`` on ``/v1/*`` when ``api_key`` is set. 503
(with ``Retry-After`` and ``"retryable": true``) for requests not served for a reason a retry fixes:
shutting down, too many queued, or a weight update with ``abort_in_flight`` stopped it mid-way.
A client that disconnects cancels its request (its decode slot is freed at once). Every answer carries
``X-Weight-Version``: a generate answer the version that produced it, any other the current one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import struct
import threading
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from r3jax.checks import FieldError
from r3jax.engine.engine import WEIGHT_UPDATE_MODES
from r3jax.serve import schema
from r3jax.serve.batcher import EngineBridge
from r3jax.serve.dispatch import Disconnected, ServeContext, Unavailable
from r3jax.serve.peer_app import add_peer_endpoints, with_version
from r3jax.serve.peers.common import samples
from r3jax.serve.protocol import BINARY_MEDIA_TYPE

DEFAULT_MAX_BODY_BYTES = 4 << 20
RETRY_AFTER = {"Retry-After": "1"}
OPEN_PATHS = frozenset({"/health", "/openapi.json"})  # liveness and the schema need no token
VERSION_HEADER = b"x-weight-version"
log = logging.getLogger("r3jax.serve")


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    # logprobs leave clamped (schema.output_json); allow_nan stays a backstop: never a 500 over a float
    body = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    return Response(body, status, headers=headers, media_type="application/json")


def _error(err: schema.InputError) -> Response:
    return _json(err.body(), err.status)


class Guard:
    """ASGI middleware: bearer-token check on every path but ``OPEN_PATHS`` (when a token is set:
    r3jax's ``/v1/*`` and every peer endpoint), then the body buffered
    up to ``limit`` bytes (413 beyond it, by ``Content-Length`` or by counting a streamed body), so
    the app never holds more than ``limit`` bytes of one request. ``version()``: the engine's weight
    version, put in ``X-Weight-Version`` on every answer that does not carry its own (a generate
    answer carries the version that produced it; errors, 401 and 413 the current one)."""

    def __init__(self, app, limit: int, token: bytes | None = None, version: Callable[[], int] | None = None):
        self.app, self.limit, self.token, self.version = app, limit, token, version

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.version is not None:
            send = self._versioned(send)
        headers = dict(scope.get("headers") or [])
        if self.token is not None and scope["path"] not in OPEN_PATHS:
            # compare_digest: the time taken does not depend on how much of the token matched
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.token):
                body = {"error": "unauthorized", "field": "Authorization",
                        "detail": "missing or wrong bearer token"}
                return await _json(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get(b"content-length")
        too_big = length is not None and (not length.isdigit() or int(length) > self.limit)
        chunks, total, more = [], 0, not too_big
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                too_big = True
                break
            chunks.append(chunk)
            more = msg.get("more_body", False)
        if too_big:
            err = schema.InputError("body", f"body exceeds max_body_bytes={self.limit}", 413)
            return await _error(err)(scope, receive, send)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _versioned(self, send):
        async def versioned_send(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(k.lower() == VERSION_HEADER for k, _ in headers):
                    headers.append((VERSION_HEADER, str(int(self.version())).encode()))
                    message = {**message, "headers": headers}
            await send(message)
        return versioned_send


def _response(outs: list, layers: list[int], binary: bool, many: bool) -> tuple[Response, int]:
    """The ``/v1/generate`` answer and its route bytes on the wire: one output's object, or with
    ``many`` (n > 1) ``{"outputs": [...]}``; binary framing puts every route frame after the JSON, in order."""
    parts = [schema.output_json(out, layers, binary_routes=binary) for out in outs]
    objs = [obj for obj, _ in parts]
    obj = {"outputs": objs} if many else objs[0]
    if not binary:
        return _json(obj), sum(len(o["routed_experts"]["data"]) for o in objs if o.get("routed_experts"))
    head = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    frames = b"".join(frame for _, frame in parts)
    return Response(struct.pack("<I", len(head)) + head + frames, media_type=BINARY_MEDIA_TYPE), len(frames)


def _unavailable(detail: str, error: str = "unavailable") -> Response:
    return _json({"error": error, "retryable": True, "detail": detail}, 503, RETRY_AFTER)


# GenerateRequest fields that live under "sampling_params" in the HTTP body
_SAMPLING_FIELDS = frozenset(schema.SamplingParams.model_fields)


def _body_field(field: str) -> str:
    """The body path of an engine request field (``max_tokens`` -> ``sampling_params.max_tokens``)."""
    name = field.split("[", 1)[0].split(".", 1)[0]
    return f"sampling_params.{field}" if name in _SAMPLING_FIELDS else (field or "body")


def model_info(engine) -> dict:
    cfg = engine.config
    return {"num_experts": cfg.num_experts, "top_k": cfg.top_k, "num_moe_layers": len(engine.moe_layer_ids),
            "moe_layer_ids": list(engine.moe_layer_ids), "vocab_size": cfg.vocab_size,
            "max_seq_len": int(engine.max_seq_len), "weight_version": int(engine.weight_version)}


def mesh_info(engine) -> dict:
    """The engine's device mesh: ``{"data", "tensor", "expert", "devices", "engine_cores",
    "expert_parallel"}`` (sizes all 1 on one device); empty for an engine without a placement (a
    stand-in). An :class:`r3jax.engine.group.EngineGroup` reports its cores along ``data`` (each core's
    own mesh is ``(1, tensor, expert)``). ``expert_parallel``: how a core's MoE layers split
    (``tokens_over``, ``experts_over``, ``hidden_over`` mesh axes) in a step whose token count is a
    multiple of ``tokens_multiple`` (other steps leave the layer to XLA's partitioner), or None (one
    device per core)."""
    cores = getattr(engine, "cores", None)
    if cores:
        one = mesh_info(cores[0])
        return {**one, "data": len(cores) * one["data"], "devices": len(cores) * one["devices"],
                "engine_cores": len(cores)}
    placement = getattr(engine, "placement", None)
    if placement is None:
        return {}
    sizes = {axis: int(placement.size(axis)) for axis in ("data", "tensor", "expert")}
    devices = sizes["data"] * sizes["tensor"] * sizes["expert"]
    ep = None
    if placement.mesh is not None and devices > 1:
        import jax

        from models import expert_parallel

        cfg = engine.config
        with jax.sharding.use_abstract_mesh(placement.mesh.abstract_mesh):
            p = expert_parallel.plan(devices, cfg.num_experts, cfg.moe_intermediate_size)
        if p is not None:
            ep = {"tokens_over": list(p.batch), "experts_over": list(p.expert), "hidden_over": list(p.hidden),
                  "tokens_multiple": devices}
    return {**sizes, "devices": devices, "engine_cores": 1, "expert_parallel": ep}


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return repr(obj)


def create_app(engine, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_queue: int = 4096,
               load_weights: Callable[[str, str, Any], Any] | None = None, warmup: bool = True,
               served_model_name: str = "r3jax", tokenizer: Any = None,
               return_routed_experts_default: bool = False, started_at: float | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
    """The ASGI app serving ``engine``.

    Requests go straight to the engine's continuous-batching scheduler (``engine.submit``).
    max_queue: requests waiting for admission beyond this many get 503 (the client retries with backoff).
    warmup: on start, compile every engine program in the background (``engine.warmup()``); until it
    is done ``/health`` answers 503 ``{"status": "warming_up"}`` (generate requests queue meanwhile);
    if it fails, or the engine cannot continue (``engine.failure``), 503 ``{"status": "failed",
    "reason": ...}``.
    load_weights: ``(path, format, engine) -> params state`` for ``POST /v1/weights`` (default
    :func:`r3jax.serve.weights.load_state`); it runs in a worker thread while generation continues.
    served_model_name, tokenizer, return_routed_experts_default, tool_call_parser: for the peers' endpoints
    (:func:`r3jax.serve.peer_app.add_peer_endpoints`: SkyRL, vLLM, SGLang forms on the same engine).
    started_at: ``time.perf_counter()`` when the serving process started (default: now); ``/v1/stats``
    ``warmup.ready_s`` counts from it to the end of warm-up (``/health`` 200), beside the warm-up's
    programs, seconds, and programs ``loaded`` from the persistent compilation cache or ``compiled``.
    """
    started_at = time.perf_counter() if started_at is None else started_at
    if load_weights is None:
        from r3jax.serve.weights import load_state as load_weights
    bridge = EngineBridge(engine, max_queue=max_queue)
    limits = schema.Limits(vocab_size=engine.config.vocab_size, max_seq_len=int(engine.max_seq_len))
    layers = list(engine.moe_layer_ids)
    weights_lock = asyncio.Lock()
    token = None if api_key is None else f"Bearer {api_key}".encode()
    ctx = ServeContext(engine, bridge)
    ready = threading.Event()
    warm: dict[str, Any] = {}

    def warm_up():
        try:
            result = engine.warmup() if warmup and hasattr(engine, "warmup") else None
            if result is not None:
                warm.update(result, ready_s=time.perf_counter() - started_at)
                print(f"r3jax serve: warm-up built {result['programs']} programs in {result['seconds']:.1f} s "
                      f"({result.get('compiled', 0)} compiled, {result.get('loaded', 0)} from the compilation "
                      f"cache); ready {warm['ready_s']:.1f} s after the process started", flush=True)
                log.info("warm-up: %d device programs in %.1f s", result["programs"], result["seconds"])
        except Exception as e:  # reported: /health answers 503 failed with it, and the log has the traceback
            warm["error"] = f"warm-up failed: {type(e).__name__}: {e}"
            log.exception("warm-up failed")
        finally:
            ready.set()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        bridge.start()
        threading.Thread(target=warm_up, name="r3jax-warmup", daemon=True).start()
        try:
            yield
        finally:
            await bridge.stop()  # uvicorn has already let in-flight requests finish (or timed out)

    app = FastAPI(title="r3jax inference server", version="1", lifespan=lifespan,
                  description=__doc__, docs_url=None, redoc_url=None)
    app.state.engine, app.state.batcher, app.state.ready = engine, bridge, ready

    app.add_middleware(Guard, limit=max_body_bytes, token=token, version=lambda: engine.weight_version)

    @app.exception_handler(schema.InputError)
    async def input_error(request, err: schema.InputError):
        return _error(err)

    @app.get("/health")
    async def health():
        if bridge.closing:
            return _json({"status": "shutting_down"}, 503, {"Retry-After": "1"})
        # an engine that cannot continue, or could not compile its programs: no Retry-After, it stays so
        failure = getattr(engine, "failure", None) or warm.get("error")
        if failure is not None:
            return _json({"status": "failed", "reason": failure}, 503)
        if not ready.is_set():
            return _json({"status": "warming_up"}, 503, {"Retry-After": "1"})
        return {"status": "ok", "weight_version": int(engine.weight_version)}

    @app.get("/v1/model", response_model=schema.ModelInfo)
    async def get_model():
        return model_info(engine)

    @app.get("/v1/stats")
    async def stats():
        eng = _jsonable(dict(getattr(engine, "stats", {}) or {}))
        return {**bridge.stats, "in_flight": bridge.in_flight, "queued": bridge.queued,
                "batches": eng.get("decode_calls", 0), "max_batch": eng.get("max_live_slots", 0),
                "sessions": dict(ctx.sessions), "warmup": warm, "protocols": dict(ctx.protocols),
                "mesh": mesh_info(engine),
                "routes": {"gather_s": float(eng.get("route_gather_s", 0.0)), **ctx.route_stats},
                "engine": eng}

    @app.post("/v1/generate", responses={200: {"model": schema.GenerateResponse | schema.GenerateSamplesResponse},
                                         422: {"description": "invalid field"},
                                         503: {"description": "not served; retry (see Retry-After)"}},
              openapi_extra=_body_schema("GenerateBody"))
    async def generate(request: Request):
        body = schema.parse_json(await request.body(), schema.GenerateBody)
        req = schema.to_request(body, limits)
        n = body.sampling_params.n
        try:
            outs = await ctx.generate_all(request, [req] if n == 1 else samples(req, n))
        except Disconnected:
            return Response(status_code=499)
        except Unavailable as e:
            return _unavailable(e.detail, e.kind)
        except FieldError as e:  # the engine refused it: still the client's input
            raise schema.InputError(_body_field(e.field), e.message) from None
        binary = BINARY_MEDIA_TYPE in request.headers.get("accept", "")
        response = await ctx.render("r3jax", outs, lambda: _response(outs, layers, binary, n > 1))
        return with_version(response, outs[0].weight_version)  # the weights that produced this answer

    @app.post("/v1/weights", openapi_extra=_body_schema("WeightsBody"))
    async def weights(request: Request):
        body = schema.parse_json(await request.body(), schema.WeightsBody)
        abort = request.query_params.get("abort_in_flight", "false").lower()
        if abort not in ("true", "false", "1", "0"):
            raise schema.InputError("abort_in_flight", f"abort_in_flight={abort!r}: expected true or false")
        mode = request.query_params.get("mode")
        if mode is not None and mode not in WEIGHT_UPDATE_MODES:
            raise schema.InputError("mode", f"mode={mode!r}: expected one of {', '.join(WEIGHT_UPDATE_MODES)}")
        if mode not in (None, "abort") and abort in ("true", "1"):
            raise schema.InputError("abort_in_flight", f"abort_in_flight={abort!r}: expected false with mode={mode!r}")
        async with weights_lock:  # one load at a time; generation keeps running meanwhile
            try:
                state = await asyncio.to_thread(load_weights, body.path, body.format, engine)
            except schema.InputError:
                raise
            except (ValueError, OSError) as e:  # a missing, unreadable or mismatched checkpoint: bad input
                log.warning("weights load failed: %s", e)
                raise schema.InputError("path", f"path={body.path!r} ({body.format}): "
                                        f"{type(e).__name__}: {e}") from None
            kwargs = {"abort_in_flight": True} if abort in ("true", "1") else {"mode": mode}
            if body.weight_version is not None:
                kwargs["version"] = body.weight_version
            try:
                version = await bridge.run_exclusive(lambda: engine.set_weights(state, **kwargs))
            except FieldError as e:
                if e.field != "version":
                    raise schema.InputError("path", f"path={body.path!r}: {e}") from None
                raise schema.InputError("weight_version", f"weight_version={body.weight_version}: expected an int "
                                        f"> the current weight_version={engine.weight_version}") from None
            except ValueError as e:  # the engine's own structure / shape check
                raise schema.InputError("path", f"path={body.path!r}: {e}") from None
        return {"weight_version": int(version)}

    add_peer_endpoints(app, ctx, vocab_size=limits.vocab_size, max_seq_len=limits.max_seq_len,
                       num_experts=engine.config.num_experts, served_model=served_model_name, tokenizer=tokenizer,
                       routes_default=return_routed_experts_default, tool_call_parser=tool_call_parser)
    _register_body_schemas(app, schema.GenerateBody, schema.WeightsBody)
    return app


def _body_schema(name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _register_body_schemas(app: FastAPI, *models) -> None:
    """Bodies are parsed by hand (so every error names its field); publish their schemas anyway."""
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            spec = base()
            comps = spec.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                s = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(s.pop("$defs", {}))
                comps[m.__name__] = s
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
