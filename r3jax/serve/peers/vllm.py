"""vLLM's OpenAI-compatible forms: ``POST /v1/completions`` with a token-id prompt, ``GET /v1/models``,
the ``{"error": {...}}`` body, and vLLM's ``SamplingParams`` names (also what SkyRL sends).

Routes travel as vLLM writes them: ``choices[i].routed_experts`` is base64 of the ``.npy`` bytes of
``[rows, L, K]`` (read with ``np.load(io.BytesIO(base64.b64decode(s)))``), rows ``[s, P + G - 1)``
where s is the top-level ``routed_experts_prompt_start``. vLLM returns routes when the server runs
with ``--enable-return-routed-experts``; here that is ``return_routed_experts_default``, and a body
may also say ``"return_routed_experts": true`` (an r3jax extension, e.g. openai's ``extra_body``).
Sources: docs/peers.md.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any, Mapping

import numpy as np

from r3jax.checks import MAX_SAMPLES, FieldError, check_int, check_prompt_start, check_route_ids, is_int
from r3jax.engine.request import DEFAULT_LOGPROBS_MODE, GenerateOutput, GenerateRequest, check_logprobs_mode
from r3jax.serve.peers import common
from r3jax.serve.peers.common import samples  # noqa: F401  (n samples: every peer's form)
from r3jax.serve.protocol import ProtocolError, logprobs_mode_field

# vLLM SamplingParams fields that only shape text or streaming (r3jax returns token ids, no EOS).
SAMPLING_FREE = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                 "detokenize", "ignore_eos", "flat_logprobs", "skip_reading_prefix_cache")
# vLLM SamplingParams fields r3jax accepts only at values that change nothing.
SAMPLING_DEFAULTS = {
    "n": (1,), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "stop": (None, []), "bad_words": (None, []), "prompt_logprobs": (None,),
    "logprob_token_ids": (None,), "allowed_token_ids": (None,), "logit_bias": (None,),
    "structured_outputs": (None,), "extra_args": (None,), "thinking_token_budget": (None,),
    "repetition_detection": (None,), "trace_decode_token_ids": (None,), "stream_interval": (None,),
    # min_tokens=1 (SkyRL's default) is accepted: r3jax has no implicit EOS to hold back.
    "min_tokens": (0, 1), "output_kind": (0, 1, 2), "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
}
SAMPLING_READ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "logprobs",
                 "routed_experts_prompt_start", "logprobs_mode")


def read_sampling(sp: Mapping[str, Any], prefix: str, prompt: list[int], *, vocab_size: int | None,
                  max_seq_len: int | None, null_max_tokens: int | None, top_logprobs: bool) -> dict:
    """vLLM ``SamplingParams`` names → ``GenerateRequest`` keyword arguments (no prompt/session).

    Defaults are vLLM's (max_tokens 16, temperature 1, top_p 1, top_k 0 or -1 = off, seed -1 = none).
    ``null_max_tokens``: what ``max_tokens: null`` means (16 for completions; None: up to the context).
    ``top_logprobs``: whether ``logprobs > 0`` is allowed (it is where only the sampled token's
    logprob is ever sent back, as SkyRL's endpoint does). ``logprobs_mode`` (r3jax extension; vLLM
    sets it server-wide with ``--logprobs-mode``, same names): null or absent is raw_logprobs."""
    common.refuse_unknown(sp, (*SAMPLING_READ, *SAMPLING_FREE, *SAMPLING_DEFAULTS), prefix)
    common.only_defaults(sp, SAMPLING_DEFAULTS, prefix)
    for key in SAMPLING_FREE:
        if key in sp and sp[key] is not None:
            common.flag(prefix + key, sp[key])
    p = len(prompt)
    mt = sp.get("max_tokens", 16)
    mt = common.max_tokens(prefix + "max_tokens", null_max_tokens if mt is None else mt, p, max_seq_len)
    temperature = sp.get("temperature")
    top_p, top_k = sp.get("top_p"), sp.get("top_k")
    out = dict(
        max_tokens=mt,
        temperature=1.0 if temperature is None else common.real(prefix + "temperature", temperature, 0.0, 2.0),
        top_p=1.0 if top_p is None else common.real(prefix + "top_p", top_p, 0.0, 1.0, lo_open=True),
        top_k=common.top_k(prefix + "top_k", top_k, vocab_size, off=(None, -1)),
        seed=common.seed(prefix + "seed", sp.get("seed"), minus_one_unset=True),
        stop_token_ids=common.stop_ids(prefix + "stop_token_ids", sp.get("stop_token_ids"), vocab_size),
        return_logprobs=_logprobs(prefix + "logprobs", sp.get("logprobs"), top_logprobs),
        routed_experts_prompt_start=check_prompt_start(sp.get("routed_experts_prompt_start", 0), p,
                                                       prefix + "routed_experts_prompt_start"),
        logprobs_mode=check_logprobs_mode(
            DEFAULT_LOGPROBS_MODE if sp.get("logprobs_mode") is None else sp["logprobs_mode"],
            prefix + "logprobs_mode"),
    )
    return out


def _logprobs(field: str, value: Any, top_logprobs: bool) -> bool:
    if value is None:
        return False
    if isinstance(value, bool):  # vLLM turns True into 1
        value = int(value)
    if top_logprobs:
        check_int(field, value, -1)
    elif not (isinstance(value, int) and value == 0):
        raise FieldError(field, value, "0 or null (r3jax returns the sampled token's logprob only)")
    return True


# --------------------------------------------------------------------------------------------------
# Routes: base64 of .npy bytes.


def route_wire_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM's response documents for routes: uint8, uint16 or int32, by E."""
    check_int("num_experts", num_experts, 1)
    if num_experts <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if num_experts <= 65536 else np.dtype(np.int32)


def encode_routes(routes: np.ndarray, num_experts: int) -> str:
    """``[rows, L, K]`` ids < E as vLLM sends them: base64 of ``np.save`` bytes (no pickle)."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routes shape={routes.shape}: expected 3 dims [rows, L, K]")
    check_route_ids(routes, num_experts, "routes")
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(routes, dtype=route_wire_dtype(num_experts)), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routes(text: Any, num_experts: int) -> np.ndarray:
    """Inverse of :func:`encode_routes` for any integer dtype a sender used (0 rows included).

    Returns ``[rows, L, K]`` as stored (validated ids < E, distinct per (token, layer))."""
    if not isinstance(text, str):
        raise ValueError(f"routed_experts: got {type(text).__name__}, expected a base64 string of .npy bytes")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("routed_experts: not valid base64") from None
    if not raw.startswith(b"\x93NUMPY"):
        raise ValueError("routed_experts: not .npy bytes (no \\x93NUMPY magic)")
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise ValueError(f"routed_experts: unreadable .npy ({e})") from None
    if arr.ndim != 3:
        raise ValueError(f"routed_experts shape={list(arr.shape)}: expected 3 dims [rows, L, K]")
    check_route_ids(arr, num_experts, "routed_experts")
    return arr


# --------------------------------------------------------------------------------------------------
# Server direction: POST /v1/completions, GET /v1/models, errors.

COMPLETION_READ = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
                   "logprobs", "routed_experts_prompt_start", "logprobs_mode", "return_routed_experts", "session_id",
                   "request_id", "return_token_ids", "return_tokens_as_token_ids", "user", "cache_salt",
                   "add_special_tokens")
COMPLETION_DEFAULTS = {
    "echo": (None, False), "stream": (None, False), "stream_options": (None,), "suffix": (None,),
    "use_beam_search": (False,), "truncate_prompt_tokens": (None,), "prompt_embeds": (None,),
    "response_format": (None,), "priority": (0,), "kv_transfer_params": (None,), "ec_transfer_params": (None,),
    "vllm_xargs": (None,), "return_token_offsets": (None, False), "return_mm_kwargs": (True,),
    "length_penalty": (1,), "watermarking": (None, False), "truncation_side": (None,),
}


MAX_N = MAX_SAMPLES  # samples of one prompt a request may ask for


def completion_samples(body: Any) -> int:
    """A ``/v1/completions`` body's ``n`` (vLLM's SamplingParams.n): how many samples of its prompt to
    return, 1..``MAX_N`` (null or absent: 1)."""
    n = body.get("n") if isinstance(body, Mapping) else None
    return 1 if n is None else check_int("n", n, 1, MAX_N)


def parse_completion(body: Any, *, served_model: str, return_routed_experts_default: bool = False,
                     session_id: str | None = None, vocab_size: int | None = None,
                     max_seq_len: int | None = None) -> GenerateRequest:
    """A ``/v1/completions`` body with a token-id prompt → ``GenerateRequest``.

    ``model`` (when given) must name ``served_model`` (else a FieldError on ``model``, which
    :func:`error_response` turns into vLLM's 404). ``session_id``: the body's, else the header's."""
    body = common.mapping("body", body)
    sp_names = set(SAMPLING_READ) | set(SAMPLING_FREE) | set(SAMPLING_DEFAULTS)
    common.refuse_unknown(body, (*COMPLETION_READ, *COMPLETION_DEFAULTS, *sp_names))
    common.only_defaults(body, COMPLETION_DEFAULTS)
    model = body.get("model")
    if model is not None and model != served_model:
        raise FieldError("model", model, f"the served model {served_model!r}")
    prompt = _prompt(body.get("prompt"), vocab_size)
    completion_samples(body)  # n > 1 is served by samples(request, n): one request per sample
    sampling = {k: v for k, v in body.items() if k in sp_names and k != "n"}
    kwargs = read_sampling(sampling, "", prompt, vocab_size=vocab_size, max_seq_len=max_seq_len,
                           null_max_tokens=16, top_logprobs=False)
    routes = body.get("return_routed_experts")
    routes = return_routed_experts_default if routes is None else common.flag("return_routed_experts", routes)
    for key in ("return_token_ids", "return_tokens_as_token_ids", "add_special_tokens"):
        if body.get(key) is not None:
            common.flag(key, body[key])
    sid = body.get("session_id", session_id)
    if sid is not None and not isinstance(sid, str):
        raise FieldError("session_id", sid, "a string or null")
    return GenerateRequest(prompt_ids=prompt, return_routed_experts=routes, session_id=sid, **kwargs)


def _prompt(value: Any, vocab_size: int | None) -> list[int]:
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], str)):
        raise FieldError("prompt", value, "token ids (r3jax serves no tokenizer: send a list of ints)")
    if isinstance(value, list) and value and isinstance(value[0], list):
        if len(value) != 1:
            raise FieldError("prompt", f"{len(value)} prompts", "one token-id prompt per request")
        return common.token_ids("prompt[0]", value[0], vocab_size)
    return common.token_ids("prompt", value, vocab_size)


def render_completion(out: GenerateOutput, request: GenerateRequest, *, model: str, request_id: str,
                      created: int, return_token_ids: bool = True, num_experts: int, text: str = "") -> dict:
    """``CompletionResponse`` JSON for one choice. Logprobs name tokens ``"token_id:N"`` (vLLM's
    form for ``return_tokens_as_token_ids``: r3jax serves no tokenizer); ``text`` is given or ''."""
    ids, g, p = list(out.output_ids), len(out.output_ids), len(request.prompt_ids)
    logprobs = None
    if out.logprobs is not None:
        tokens = [f"token_id:{t}" for t in ids]
        lps = [common.clamp_logprob(x) for x in out.logprobs]
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])[:-1]]).astype(int).tolist()
        logprobs = {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens,
                    "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)]}
    stop_reason = ids[-1] if out.finish_reason == "stop" else None
    routes = None if out.routed_experts is None else encode_routes(out.routed_experts, num_experts)
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
              "stop_reason": stop_reason, "token_ids": ids if return_token_ids else None,
              "prompt_logprobs": None, "prompt_token_ids": list(request.prompt_ids) if return_token_ids else None,
              "routed_experts": routes}
    common.with_spans(choice, out)
    usage = {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g,
             "prompt_tokens_details": {"cached_tokens": int(out.cached_tokens)}}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(created), "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def render_completions(outs: list[GenerateOutput], request: GenerateRequest, **kw) -> dict:
    """``CompletionResponse`` JSON for ``n`` samples of one prompt (:func:`render_completion`'s
    arguments): ``choices[i]`` is sample i; usage counts the prompt once and every sample's tokens."""
    bodies = [render_completion(out, request, **kw) for out in outs]
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    g = sum(b["usage"]["completion_tokens"] for b in bodies)
    body["usage"].update(completion_tokens=g, total_tokens=body["usage"]["prompt_tokens"] + g)
    return body


def render_generate(out: GenerateOutput, request: GenerateRequest, *, request_id: str) -> dict:
    """vLLM's ``POST /inference/v1/generate`` answer (``GenerateResponse``): token ids, the sampled
    token's logprob as chat-style ``logprobs.content`` (floored at -9999.0), no routes."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = {"content": [{"token": f"token_id:{int(t)}", "logprob": common.clamp_logprob(x), "bytes": None,
                                 "top_logprobs": []} for t, x in zip(out.output_ids, out.logprobs)]}
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": out.finish_reason,
              "token_ids": [int(t) for t in out.output_ids]}
    common.with_spans(choice, out)
    return {"request_id": request_id, "choices": [choice], "prompt_logprobs": None, "kv_transfer_params": None}


def models_body(model: str, *, max_model_len: int, created: int) -> dict:
    """``GET /v1/models``: vLLM's ``ModelList`` with one ``ModelCard``."""
    card = {"id": model, "object": "model", "created": int(created), "owned_by": "vllm", "root": model,
            "parent": None, "max_model_len": int(max_model_len), "permission": []}
    return {"object": "list", "data": [card]}


def error_response(err: FieldError) -> tuple[int, dict]:
    """vLLM's ``ErrorResponse``: 400 ``BadRequestError`` naming the field in ``param``; an unknown
    ``model`` is vLLM's 404 ``NotFoundError`` "The model `x` does not exist."."""
    if err.field == "model":
        info = {"message": f"The model `{err.value}` does not exist.", "type": "NotFoundError", "param": "model",
                "code": 404}
        return 404, {"error": info}
    return 400, {"error": {"message": err.message, "type": "BadRequestError", "param": err.field, "code": 400}}


# --------------------------------------------------------------------------------------------------
# Client direction.


def completion_body(request: GenerateRequest, *, model: str) -> dict:
    """The ``/v1/completions`` body for ``request`` (token ids back via ``return_token_ids``)."""
    body = {"model": model, "prompt": [int(t) for t in request.prompt_ids], "max_tokens": int(request.max_tokens),
            "temperature": float(request.temperature), "top_p": float(request.top_p), "top_k": int(request.top_k),
            "stop_token_ids": [int(t) for t in request.stop_token_ids],
            "logprobs": 0 if request.return_logprobs else None, "return_token_ids": True,
            "routed_experts_prompt_start": check_prompt_start(request.routed_experts_prompt_start,
                                                              len(request.prompt_ids)),
            "return_routed_experts": bool(request.return_routed_experts), **logprobs_mode_field(request)}
    if request.seed is not None:
        body["seed"] = int(request.seed)
    if request.session_id is not None:
        body["session_id"] = request.session_id
    return body


def parse_completion_response(content: bytes | str | Mapping, request: GenerateRequest, *, num_experts: int,
                              num_layers: int, top_k: int, vocab_size: int | None = None,
                              where: str = "vllm") -> GenerateOutput:
    """A ``/v1/completions`` response → ``GenerateOutput`` checked against the row rule."""
    with common.reading(where, "/v1/completions response"):
        obj = json.loads(content) if isinstance(content, (bytes, str)) else content
        choice = obj["choices"][0]
        ids = common.output_ids(choice["token_ids"], request, vocab_size, where)
        lps = None
        if request.return_logprobs:
            lps = common.logprob_list((choice.get("logprobs") or {}).get("token_logprobs"), len(ids), where)
        routes = None
        if request.return_routed_experts:
            if choice.get("routed_experts") is None:
                raise ProtocolError(f"{where}: routed_experts missing (is the server started with "
                                    "--enable-return-routed-experts?)")
            routes = common.route_rows(decode_routes(choice["routed_experts"], num_experts), request, len(ids),
                                       num_experts=num_experts, num_layers=num_layers, top_k=top_k, where=where)
        cached = cached_tokens(obj.get("usage"), where)
        spans = common.read_span_list(choice.get("weight_versions"), len(ids), where)
    return GenerateOutput(output_ids=ids, logprobs=lps, finish_reason=common.finish(choice.get("finish_reason"), where),
                          routed_experts=routes, prompt_tokens=len(request.prompt_ids), cached_tokens=cached,
                          weight_version=common.UNKNOWN_VERSION,
                          routed_experts_start=int(request.routed_experts_prompt_start), weight_versions=spans)


def cached_tokens(usage: Any, where: str) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``. vLLM sends ``prompt_tokens_details: null`` unless
    started with ``--enable-prompt-tokens-details``: then the count is unknown (None,
    not 0: nothing says no prompt token was cached). A details object must hold an int >= 0."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    if details is None:
        return None
    value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if not is_int(value) or value < 0:
        raise ProtocolError(f"{where}: usage.prompt_tokens_details.cached_tokens={value!r}: expected an int >= 0",
                            "cached_tokens")
    return int(value)
