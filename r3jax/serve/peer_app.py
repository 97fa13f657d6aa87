"""The peers' endpoints on the r3jax server: thin adapters over the same engine call as ``/v1/generate``.

    POST /skyrl/v1/generate     SkyRL 0.4.0 (routes wanted: the path says so; X-Session-ID sticky)
    POST /inference/v1/generate vLLM's tokens-in/tokens-out route (SkyRL's plain path)
    POST /v1/completions        vLLM OpenAI-compatible, token-id prompt, routed_experts(_prompt_start)
    GET  /v1/models             vLLM's ModelList
    POST /generate              SGLang native, input_ids, return_routed_experts, routed_experts_start_len
    POST /tokenize, /detokenize vLLM's forms (what SkyRL's client calls), when the server has a tokenizer
    POST /finish_session        SkyRL's best-effort session end

Bodies are parsed and answers rendered by :mod:`r3jax.serve.peers` (each peer's field names,
defaults, route encodings and error shapes; sources in docs/peers.md). Every answer carries an
``X-Weight-Version`` header (peers' bodies have no integer version; headers are invisible to their
parsers), which :class:`~r3jax.serve.RemoteInferenceClient` reads. Bad input is the peer's own 4xx;
503 (``Retry-After``) when a retry would help; never a 5xx.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import Response

from r3jax.checks import FieldError, check_text
from r3jax.serve.dispatch import Disconnected, ServeContext, Unavailable
from r3jax.serve.peers import sglang, skyrl, tool_calls, vllm, vllm_chat
from r3jax.serve.peers import openapi as peer_openapi
from r3jax.serve.peers.common import samples as peer_samples
from r3jax.serve.peers.common import token_ids
from r3jax.serve.schema import load_json
from r3jax.serve.peers.stream import StopWatch, stop_strings
from r3jax.serve.streaming import stream_answer, stream_request

# engine request fields (GenerateRequest) -> the field each peer calls them
_ENGINE_FIELDS = {
    "skyrl": {"prompt_ids": "token_ids", "*": "sampling_params.{}"},
    "vllm": {"prompt_ids": "prompt", "*": "{}"},
    "sglang": {"prompt_ids": "input_ids", "max_tokens": "sampling_params.max_new_tokens",
               "seed": "sampling_params.sampling_seed", "routed_experts_prompt_start": "routed_experts_start_len",
               "return_logprobs": "return_logprob", "session_id": "rid", "*": "sampling_params.{}"},
}
VERSION_HEADER = "X-Weight-Version"
NO_TOKENIZER = "this server has no tokenizer: start it with --tokenizer"
_ERRORS = {"skyrl": skyrl.error_response, "vllm": vllm.error_response, "sglang": sglang.error_response}


def _peer_field(peer: str, err: FieldError) -> FieldError:
    """An engine refusal renamed to the peer's field (``max_tokens`` -> ``sampling_params.max_new_tokens``)."""
    field, table = err.field, _ENGINE_FIELDS[peer]
    cut = min((i for i in (field.find("."), field.find("[")) if i >= 0), default=len(field))
    head, rest = field[:cut], field[cut:]
    renamed = table.get(head) or table["*"].format(head)
    return FieldError(renamed + rest, err.value, err.expected, err.message.replace(field, renamed + rest, 1))


def with_version(response: Response, version: int) -> Response:
    """``response`` carrying ``X-Weight-Version: version``, the weights that produced it."""
    response.headers[VERSION_HEADER] = str(int(version))
    return response


def _json_response(obj: Any, status: int = 200, headers: Mapping | None = None, raw: bytes | None = None) -> Response:
    body = raw if raw is not None else json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return Response(body, status, headers=dict(headers or {}), media_type="application/json")


def _error(peer: str, err: FieldError) -> Response:
    status, body = _ERRORS[peer](err)
    return _json_response(body, status)


def _unavailable(peer: str, detail: str) -> Response:
    info = {"message": detail} if peer == "sglang" else \
        {"message": detail, "type": "ServiceUnavailableError", "param": None, "code": 503}
    return _json_response({"error": info}, 503, {"Retry-After": "1"})


def _load(raw: bytes) -> Any:
    """The body as JSON with valid Unicode strings (:func:`r3jax.serve.schema.load_json`), or FieldError."""
    return load_json(raw)


def add_peer_endpoints(app: FastAPI, ctx: ServeContext, *, vocab_size: int, max_seq_len: int, num_experts: int,
                       served_model: str, tokenizer: Any = None, routes_default: bool = False,
                       tool_call_parser: str | None = None) -> None:
    """Register the peers' endpoints on ``app``.

    served_model: the model name ``/v1/models`` reports and ``/v1/completions`` accepts.
    tokenizer: an object with ``encode(text) -> ids`` and ``decode(ids) -> text`` (e.g.
    :class:`r3jax.rollout.ByteTokenizer`), or None: text prompts and ``/tokenize`` are then a 400
    naming the missing tokenizer, and response ``text`` is ''.
    routes_default: vLLM's ``--enable-return-routed-experts``: completions return routes unless the
    body says ``"return_routed_experts": false`` (an r3jax extension, e.g. openai's ``extra_body``).
    tool_call_parser: vLLM's ``--tool-call-parser`` ("hermes", :mod:`r3jax.serve.peers.tool_calls`) for
    chat replies, or None (tool calls stay text).
    """
    if tool_call_parser is not None and tool_call_parser not in tool_calls.PARSERS:
        raise FieldError("tool_call_parser", tool_call_parser, f"one of {tool_calls.PARSERS} or None")
    created = int(time.time())
    limits = dict(vocab_size=vocab_size, max_seq_len=max_seq_len)

    def text_of(ids) -> str:
        return "" if tokenizer is None else tokenizer.decode(list(ids))

    def stopped_text(out, watch) -> str:
        """The reply's text, cut before its stop string when one stopped it."""
        text = text_of(out.output_ids)
        return text if watch is None else watch.text(text)

    def encode_text(field: str, text: Any) -> list[int]:
        if tokenizer is None:
            raise FieldError(field, text, f"token ids ({NO_TOKENIZER})")
        return list(tokenizer.encode(check_text(field, text)))

    def refusal(peer: str, err: BaseException) -> Response:
        if isinstance(err, FieldError):
            return _error(peer, _peer_field(peer, err))
        if isinstance(err, Unavailable):
            return _unavailable(peer, err.detail)
        raise err

    async def run(peer: str, request: Request, parse: Callable[[Any, Request], Any],
                  render: Callable[[Any, Any, Any], tuple[Response, int]], stream_kind: str | None = None) -> Response:
        """One request of ``peer``'s form; ``stream_kind`` ("completion" / "chat"): the body may ask for
        ``stream: true`` (:mod:`r3jax.serve.streaming`)."""
        try:
            body = _load(await request.body())
            streamed, usage, stops = False, False, []
            if stream_kind is not None:
                streamed, usage, body = stream_request(body)
                if isinstance(body, dict):
                    stops, body = stop_strings(body)
            req = parse(body, request)
        except FieldError as e:
            return _error(peer, e)
        if streamed:
            return await stream_answer(ctx, req, kind=stream_kind, request_id=_request_id(body), model=served_model,
                                       num_experts=num_experts, decode=text_of, include_usage=usage,
                                       return_token_ids=body.get("return_token_ids") is True,
                                       on_error=lambda e: refusal(peer, e), stops=stops)
        reqs = req if isinstance(req, list) else [req]  # several: one prompt's samples, submitted together
        watches = [StopWatch(stops, text_of) for _ in reqs] if stops else None
        try:
            outs = await ctx.generate_all(request, reqs, on_tokens=watches)
        except FieldError as e:
            return _error(peer, _peer_field(peer, e))
        except Unavailable as e:
            return _unavailable(peer, e.detail)
        except Disconnected:
            return Response(status_code=499)
        out = outs if isinstance(req, list) else outs[0]
        kw = {} if stream_kind is None else {"watches": watches or [None] * len(outs)}
        response = await ctx.render(peer, outs, lambda: render(body, req, out, **kw))
        return with_version(response, outs[0].weight_version)  # the answer's own (errors: the app's Guard)

    # ---- SkyRL ------------------------------------------------------------------------------------
    def skyrl_route(path: str, routes: bool):
        def parse(body, request):
            return skyrl.parse_generate(body, return_routed_experts=routes,
                                        session_id=request.headers.get(skyrl.SESSION_HEADER), **limits)

        def render(body, req, out):
            if routes:  # SkyRL's own server: packed routes, compact JSON with "data" first
                obj = skyrl.render_generate(out, req, num_experts=num_experts)
                packed = obj["choices"][0]["routed_experts"]
                return _json_response(None, raw=skyrl.dumps(obj)), len(packed["data"]) if packed else 0
            return _json_response(vllm.render_generate(out, req, request_id=_request_id(body))), 0

        async def endpoint(request: Request):
            return await run("skyrl", request, parse, render)

        summary = ("SkyRL 0.4.0 generate with routed experts" if routes else
                   "vLLM tokens-in/tokens-out generate (SkyRL's plain path)")
        app.post(path, openapi_extra=peer_openapi.skyrl_body(routes), tags=["SkyRL / vLLM"],
                 summary=summary)(endpoint)

    skyrl_route(skyrl.ROUTES_PATH, True)
    skyrl_route(skyrl.PLAIN_PATH, False)

    # ---- vLLM OpenAI-compatible ---------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=peer_openapi.vllm_completions_body(), tags=["vLLM"],
              summary="vLLM /v1/completions (token-id or text prompt) with routed experts")
    async def completions(request: Request):
        def parse(body, request):
            if isinstance(body, dict) and isinstance(body.get("prompt"), str):
                body = {**body, "prompt": encode_text("prompt", body["prompt"])}
            req = vllm.parse_completion(body, served_model=served_model, return_routed_experts_default=routes_default,
                                        session_id=request.headers.get(skyrl.SESSION_HEADER), **limits)
            n = vllm.completion_samples(body)
            return req if n == 1 else peer_samples(req, n)

        def render(body, req, out, watches):
            kw = dict(model=served_model, request_id=_request_id(body), created=int(time.time()),
                      num_experts=num_experts, return_token_ids=body.get("return_token_ids") is True)
            if isinstance(out, list):
                obj = vllm.render_completions(out, req[0], **kw)
            else:
                obj = vllm.render_completion(out, req, **kw)
            for choice, o, w in zip(obj["choices"], out if isinstance(out, list) else [out], watches):
                choice["text"] = stopped_text(o, w)
                if w is not None and w.matched is not None:
                    choice["stop_reason"] = w.matched
            return _json_response(obj), sum(len(c["routed_experts"] or "") for c in obj["choices"])

        return await run("vllm", request, parse, render, stream_kind="completion")

    @app.post("/v1/chat/completions", openapi_extra=peer_openapi.vllm_chat_body(), tags=["vLLM"],
              summary="vLLM /v1/chat/completions: messages rendered by the server's chat tokenizer, routed experts")
    async def chat_completions(request: Request):
        def parse(body, request):
            req, n = vllm_chat.parse_chat(body, served_model=served_model, tokenizer=tokenizer,
                                          return_routed_experts_default=routes_default,
                                          session_id=request.headers.get(skyrl.SESSION_HEADER), **limits)
            return req if n == 1 else peer_samples(req, n)

        def render(body, req, out, watches):
            outs, first = (out, req[0]) if isinstance(out, list) else ([out], req)
            obj = vllm_chat.render_chat(outs, first, texts=[stopped_text(o, w) for o, w in zip(outs, watches)],
                                        model=served_model, request_id=_request_id(body), created=int(time.time()),
                                        num_experts=num_experts, return_token_ids=body.get("return_token_ids") is True,
                                        tool_call_parser=tool_call_parser)
            for choice, w in zip(obj["choices"], watches):
                if w is not None and w.matched is not None:
                    choice["stop_reason"] = w.matched
            return _json_response(obj), sum(len(c["routed_experts"] or "") for c in obj["choices"])

        return await run("vllm", request, parse, render, stream_kind="chat")

    @app.get("/v1/models", tags=["vLLM"], summary="vLLM's ModelList: the served model")
    async def models():
        return _json_response(vllm.models_body(served_model, max_model_len=max_seq_len, created=created))

    # ---- SGLang -------------------------------------------------------------------------------------
    @app.post("/generate", openapi_extra=peer_openapi.sglang_body(), tags=["SGLang"],
              summary="SGLang native /generate (input_ids or text) with routed experts")
    async def sglang_generate(request: Request):
        def parse(body, request):
            if isinstance(body, dict) and body.get("text") is not None and body.get("input_ids") is None:
                body = {**body, "input_ids": encode_text("text", body["text"]), "text": None}
            req = sglang.parse_generate(body, **limits)
            n = sglang.generate_samples(body)
            return req if n == 1 else peer_samples(req, n)

        def render(body, req, out):
            rid = body.get("rid") or uuid.uuid4().hex
            if isinstance(out, list):  # n > 1: SGLang's list, one object per sample
                objs = [sglang.render_generate(o, req[0], num_experts=num_experts, rid=f"{rid}-{i}",
                                               text=text_of(o.output_ids)) for i, o in enumerate(out)]
                return _json_response(objs), sum(len(o["meta_info"].get("routed_experts") or "") for o in objs)
            obj = sglang.render_generate(out, req, num_experts=num_experts, rid=rid, text=text_of(out.output_ids))
            return _json_response(obj), len(obj["meta_info"].get("routed_experts") or "")

        return await run("sglang", request, parse, render)

    # ---- tokenizer and session endpoints (vLLM's forms, as SkyRL's client calls them) ---------------
    @app.post("/tokenize", openapi_extra=peer_openapi.tokenize_body(), tags=["SkyRL / vLLM"],
              summary="vLLM /tokenize: text or chat messages -> token ids (needs the server's tokenizer)")
    async def tokenize(request: Request):
        try:
            body = _vllm_body(await request.body(), served_model)
            if body.get("messages") is not None:  # vLLM's chat form: the ids /v1/chat/completions would prompt with
                ids = vllm_chat.chat_prompt(body, tokenizer, vocab_size)
            else:
                ids = encode_text("prompt", body.get("prompt"))
        except FieldError as e:
            return _error("vllm", e)
        return _json_response({"count": len(ids), "max_model_len": max_seq_len, "tokens": ids, "token_strs": None})

    @app.post("/detokenize", openapi_extra=peer_openapi.detokenize_body(), tags=["SkyRL / vLLM"],
              summary="vLLM /detokenize: token ids -> text (needs the server's tokenizer)")
    async def detokenize(request: Request):
        try:
            body = _vllm_body(await request.body(), served_model)
            ids = token_ids("tokens", body.get("tokens"), vocab_size, allow_empty=True)
            if tokenizer is None:
                raise FieldError("tokens", ids[:8], f"text needs a tokenizer ({NO_TOKENIZER})")
        except FieldError as e:
            return _error("vllm", e)
        return _json_response({"prompt": tokenizer.decode(ids)})

    @app.post("/finish_session", tags=["SkyRL / vLLM"], summary="SkyRL's session end (best effort)")
    async def finish_session(session_id: str | None = None):
        found = session_id is not None and ctx.sessions.pop(session_id, None) is not None
        return _json_response({"status": "ok", "session_id": session_id, "known": found})


def _vllm_body(raw: bytes, served_model: str) -> dict:
    """A vLLM tokenizer-endpoint body: a JSON object whose ``model``, if given, is the served one."""
    body = _load(raw)
    if not isinstance(body, dict):
        raise FieldError("body", body, "a JSON object")
    if body.get("model") not in (None, served_model):
        raise FieldError("model", body["model"], f"the served model {served_model!r}")
    return body


def _request_id(body: Any) -> str:
    rid = body.get("request_id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) and rid else uuid.uuid4().hex
