"""SkyRL 0.4.0's raw-token generate protocol (``RemoteGenerateClient.generate``).

Request: ``POST /skyrl/v1/generate`` when routes are wanted, else ``/inference/v1/generate`` (vLLM's
own tokens-in/tokens-out route), body ``{"sampling_params": {vLLM SamplingParams names,
"routed_experts_prompt_start": s}, "model", "token_ids"}`` plus optional ``cache_salt``,
``return_sample_support``, ``features``; header ``X-Session-ID`` for sticky routing.
Response: ``{"choices": [{"token_ids", "finish_reason", "logprobs": {"content": [{"logprob"}]} | null,
"routed_experts": {"data", "shape", "dtype"} | null, "rollout_sample_support": null}]}``.

Routes: SkyRL's decoder (``decode_packed_routed_experts``) accepts only the *value-canonical* dtype
of a chunk: uint8 if its largest id < 2**8, int16 if < 2**15, else int32 (a 0-row chunk is uint8).
So :func:`encode_routes` picks the dtype per chunk, not per model; r3jax's decoder reads any of them.
SkyRL reads the body with a splice scan for ``"routed_experts":{"data":"``, so the body must be
compact JSON with ``data`` first: send :func:`dumps` bytes. Sources: docs/peers.md.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

import numpy as np

from r3jax import routes as routes_lib
from r3jax.checks import FieldError, check_prompt_start, check_route_ids
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.serve.peers import common, vllm
from r3jax.serve.protocol import ProtocolError, logprobs_mode_field

ROUTES_PATH = "/skyrl/v1/generate"
PLAIN_PATH = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"

BODY_READ = ("token_ids", "sampling_params", "model", "cache_salt", "request_id")
BODY_DEFAULTS = {"return_sample_support": (None, False), "features": (None,), "stream": (None, False),
                 "stream_options": (None,), "priority": (0,), "kv_transfer_params": (None,)}


def canonical_dtype(routes: np.ndarray) -> np.dtype:
    """SkyRL's ``compact_routed_expert_indices`` rule: the smallest of uint8/int16/int32 holding the
    chunk's largest id (0 for an empty chunk)."""
    top = int(routes.max(initial=0))
    if top < 2**8:
        return np.dtype(np.uint8)
    if top < 2**15:
        return np.dtype(np.int16)
    if top < 2**31:
        return np.dtype(np.int32)
    raise ValueError(f"routed expert id {top} exceeds int32")


def encode_routes(routes: np.ndarray, num_experts: int) -> dict:
    """``{"data", "shape", "dtype"}`` in the chunk's canonical dtype, ``data`` first."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routes shape={routes.shape}: expected 3 dims [rows, L, K]")
    check_route_ids(routes, num_experts, "routes")
    arr = np.ascontiguousarray(routes, dtype=canonical_dtype(routes).newbyteorder("<"))
    return {"data": base64.b64encode(arr.tobytes()).decode("ascii"), "shape": list(arr.shape),
            "dtype": arr.dtype.name}


def decode_routes(payload: Any, num_experts: int) -> np.ndarray:
    """Any integer dtype whose ids fit (SkyRL's canonical ones included, any E, 0 rows included) →
    ``[rows, L, K]`` in ``route_dtype(E)``, ids < E and distinct per (token, layer)."""
    arr = routes_lib.decode(payload, num_experts)
    check_route_ids(arr, num_experts, "routed_experts")
    return arr


def dumps(body: Mapping) -> bytes:
    """Compact JSON (no spaces, insertion order): the layout SkyRL's ``load_packed_body`` scans."""
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


# --------------------------------------------------------------------------------------------------
# Server direction.


def parse_generate(body: Any, *, return_routed_experts: bool, session_id: str | None = None,
                   vocab_size: int | None = None, max_seq_len: int | None = None) -> GenerateRequest:
    """A SkyRL generate body → ``GenerateRequest``.

    ``return_routed_experts``: True on ``/skyrl/v1/generate`` (SkyRL asks for routes by choosing that
    path), False on ``/inference/v1/generate``. ``session_id``: the ``X-Session-ID`` header.
    ``model`` is read and not checked (SkyRL's server resolves it only for LoRA adapters)."""
    body = common.mapping("body", body)
    common.refuse_unknown(body, (*BODY_READ, *BODY_DEFAULTS))
    if body.get("return_sample_support"):
        raise FieldError("return_sample_support", True, "false (r3jax does not capture sample support)")
    common.only_defaults(body, BODY_DEFAULTS)
    for key in ("model", "cache_salt", "request_id"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise FieldError(key, body[key], "a string or null")
    if "token_ids" not in body:
        raise FieldError("token_ids", None, "a list of int token ids (required)")
    prompt = common.token_ids("token_ids", body["token_ids"], vocab_size)
    sp = common.mapping("sampling_params", body.get("sampling_params"))
    kwargs = vllm.read_sampling(sp, "sampling_params.", prompt, vocab_size=vocab_size, max_seq_len=max_seq_len,
                                null_max_tokens=None, top_logprobs=True)
    if session_id is not None and not isinstance(session_id, str):
        raise FieldError(SESSION_HEADER, session_id, "a string")
    return GenerateRequest(prompt_ids=prompt, return_routed_experts=bool(return_routed_experts),
                           session_id=session_id, **kwargs)


def render_generate(out: GenerateOutput, request: GenerateRequest, *, num_experts: int) -> dict:
    """SkyRL's response body (pass it to :func:`dumps`). Logprobs as SkyRL's
    ``build_logprobs_content``: only the sampled token's, floored at -9999.0."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = {"content": [{"logprob": common.clamp_logprob(x)} for x in out.logprobs]}
    routes = None
    if request.return_routed_experts and out.routed_experts is not None:
        routes = encode_routes(out.routed_experts, num_experts)
    choice = {"token_ids": [int(t) for t in out.output_ids], "finish_reason": out.finish_reason,
              "logprobs": logprobs, "routed_experts": routes, "rollout_sample_support": None}
    return {"choices": [common.with_spans(choice, out)]}


def error_response(err: FieldError) -> tuple[int, dict]:
    """400 with the body of SkyRL's server (a FastAPI ``HTTPException`` rendered by vLLM's handler),
    whose ``error.message`` SkyRL's ``raise_for_status`` shows to the user."""
    return 400, {"error": {"message": err.message, "type": "Bad Request", "param": err.field, "code": 400}}


# --------------------------------------------------------------------------------------------------
# Client direction.


def request_for(request: GenerateRequest, *, model: str = "default") -> tuple[str, dict, dict]:
    """``(path, body, headers)`` as ``RemoteGenerateClient.generate`` builds them."""
    sp: dict[str, Any] = {"max_tokens": int(request.max_tokens), "temperature": float(request.temperature),
                          "top_p": float(request.top_p), "top_k": int(request.top_k),
                          "stop_token_ids": [int(t) for t in request.stop_token_ids],
                          "logprobs": 0 if request.return_logprobs else None, **logprobs_mode_field(request)}
    if request.seed is not None:
        sp["seed"] = int(request.seed)
    path = PLAIN_PATH
    if request.return_routed_experts:
        path = ROUTES_PATH
        sp["routed_experts_prompt_start"] = check_prompt_start(
            request.routed_experts_prompt_start, len(request.prompt_ids))
    body = {"sampling_params": sp, "model": model, "token_ids": [int(t) for t in request.prompt_ids]}
    headers = {"Content-Type": "application/json"}
    if request.session_id:
        headers[SESSION_HEADER] = str(request.session_id)
    return path, body, headers


def parse_generate_response(content: bytes | str | Mapping, request: GenerateRequest, *, num_experts: int,
                            num_layers: int, top_k: int, vocab_size: int | None = None,
                            where: str = "skyrl") -> GenerateOutput:
    """A SkyRL (or vLLM ``/inference/v1/generate``) response → ``GenerateOutput`` (row rule checked)."""
    with common.reading(where, "SkyRL generate response"):
        obj = json.loads(content) if isinstance(content, (bytes, str)) else content
        choice = obj["choices"][0]
        ids = common.output_ids(choice["token_ids"], request, vocab_size, where)
        lps = None
        if request.return_logprobs:
            content_list = (choice.get("logprobs") or {}).get("content")
            if not isinstance(content_list, list):
                raise ProtocolError(f"{where}: logprobs.content missing: the request asked for logprobs")
            lps = common.logprob_list([c.get("logprob") for c in content_list], len(ids), where)
        routes = None
        if request.return_routed_experts:
            if not isinstance(choice.get("routed_experts"), dict):
                raise ProtocolError(f"{where}: {ROUTES_PATH} must return packed routed_experts")
            routes = common.route_rows(decode_routes(choice["routed_experts"], num_experts), request, len(ids),
                                       num_experts=num_experts, num_layers=num_layers, top_k=top_k, where=where)
        spans = common.read_span_list(choice.get("weight_versions"), len(ids), where)
    return GenerateOutput(output_ids=ids, logprobs=lps, finish_reason=common.finish(choice.get("finish_reason"), where),
                          routed_experts=routes, prompt_tokens=len(request.prompt_ids), cached_tokens=None,
                          weight_version=common.UNKNOWN_VERSION,
                          routed_experts_start=int(request.routed_experts_prompt_start), weight_versions=spans)
