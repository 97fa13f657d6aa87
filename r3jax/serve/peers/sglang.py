"""SGLang's native ``POST /generate`` with a token-id prompt (``input_ids``), as SGLang 0.5.23 defines it.

Request: ``{"input_ids", "sampling_params": {"max_new_tokens" (128), "temperature", "top_p", "top_k"
(-1 = off), "stop_token_ids", "sampling_seed", ...}, "return_logprob", "return_routed_experts",
"routed_experts_start_len": s}``. Response: ``{"text", "output_ids", "meta_info": {"id",
"finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": n}, "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs": [[logprob, id,
text | null], ...], "routed_experts": base64 of int32 ids [rows, L, K], "weight_versions": [{"version", "start", "end"},
...]}}`` with rows ``[s, P + G - 1)`` (SGLang sends no shape: L and K come from the served model) and
version spans over output token indices ``[start, end)``, versions as strings like
``weight_version``. An aborted request finishes ``{"type": "abort", "message"}`` with the tokens it
has. Bad input: 400 ``{"error": {"message": ...}}``. Sources: docs/peers.md.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

import numpy as np

from r3jax import routes as routes_lib
from r3jax.checks import MAX_SAMPLES, FieldError, check_int, check_prompt_start, check_route_ids, is_int
from r3jax.engine.request import DEFAULT_LOGPROBS_MODE, GenerateOutput, GenerateRequest, check_logprobs_mode
from r3jax.serve.peers import common
from r3jax.serve.protocol import ProtocolError, logprobs_mode_field

BODY_READ = ("input_ids", "sampling_params", "return_logprob", "return_routed_experts", "routed_experts_start_len",
             "rid", "return_text_in_logprobs", "log_metrics")
BODY_DEFAULTS = {
    "text": (None,), "input_embeds": (None,), "image_data": (None,), "audio_data": (None,), "video_data": (None,),
    "stream": (None, False), "logprob_start_len": (None, -1), "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,), "session_params": (None,), "lora_path": (None,),
    "return_hidden_states": (None, False), "return_indexer_topk": (None, False), "custom_logit_processor": (None,),
    "data_parallel_rank": (None,),
}
SAMPLING_READ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
                 "logprobs_mode")  # logprobs_mode: r3jax extension, vLLM's names (null: raw_logprobs)
SAMPLING_FREE = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
SAMPLING_DEFAULTS = {
    "n": (None, 1), "min_p": (None, 0), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_new_tokens": (None, 0), "stop": (None, [], ""), "stop_regex": (None, []),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None,),
    "custom_params": (None,), "stream_interval": (None,), "beam_width": (None,), "watermark": (None,),
}


def encode_routes(routes: np.ndarray, num_experts: int) -> str:
    """SGLang's form: base64 of the little-endian int32 bytes of ``[rows, L, K]`` (no shape)."""
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routes shape={routes.shape}: expected 3 dims [rows, L, K]")
    check_route_ids(routes, num_experts, "routes")
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode("ascii")


def decode_routes(text: Any, num_experts: int, num_layers: int, top_k: int) -> np.ndarray:
    """Inverse of :func:`encode_routes` (0 rows included): int32 ``[rows, L, K]``, ids < E, distinct."""
    arr = routes_lib.decode_sglang(text, num_layers, top_k)
    check_route_ids(arr, num_experts, "routed_experts")
    return arr


# --------------------------------------------------------------------------------------------------
# Server direction.


MAX_N = MAX_SAMPLES  # samples of one prompt a request may ask for


def generate_samples(body: Any) -> int:
    """A ``/generate`` body's ``sampling_params.n`` (SGLang's parallel sampling): how many samples of its
    prompt to return, 1..``MAX_N`` (null or absent: 1). SGLang answers n > 1 with a list, one object each."""
    sp = body.get("sampling_params") if isinstance(body, Mapping) else None
    n = sp.get("n") if isinstance(sp, Mapping) else None
    return 1 if n is None else check_int("sampling_params.n", n, 1, MAX_N)


def parse_generate(body: Any, *, vocab_size: int | None = None, max_seq_len: int | None = None) -> GenerateRequest:
    """An SGLang ``/generate`` body with ``input_ids`` → ``GenerateRequest`` (SGLang's defaults:
    128 new tokens, no logprobs; ``routed_experts_start_len`` is checked only when routes are asked
    for, as SGLang's scheduler does)."""
    body = common.mapping("body", body)
    if body.get("text") is not None:
        raise FieldError("text", body["text"], "null: send input_ids (r3jax serves no tokenizer)")
    common.refuse_unknown(body, (*BODY_READ, *BODY_DEFAULTS))
    common.only_defaults(body, BODY_DEFAULTS)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise FieldError("input_ids", f"{len(ids)} prompts", "one token-id prompt per request")
        prompt = common.token_ids("input_ids[0]", ids[0], vocab_size)
    else:
        prompt = common.token_ids("input_ids", ids, vocab_size)
    sp = common.mapping("sampling_params", body.get("sampling_params"))
    common.refuse_unknown(sp, (*SAMPLING_READ, *SAMPLING_FREE, *SAMPLING_DEFAULTS), "sampling_params.")
    generate_samples(body)  # n > 1 is served as one request per sample (common.samples)
    common.only_defaults({k: v for k, v in sp.items() if k != "n"}, SAMPLING_DEFAULTS, "sampling_params.")
    for key in SAMPLING_FREE:
        if sp.get(key) is not None:
            common.flag(f"sampling_params.{key}", sp[key])
    flags = {k: False if body.get(k) is None else common.flag(k, body[k])
             for k in ("return_logprob", "return_routed_experts", "return_text_in_logprobs", "log_metrics")}
    start = body.get("routed_experts_start_len", 0)
    if flags["return_routed_experts"]:
        start = check_prompt_start(start, len(prompt), "routed_experts_start_len")
    else:  # SGLang's schema types it (an i64) but reads it only when routes are asked for
        check_int("routed_experts_start_len", start, None)
        start = 0
    if body.get("rid") is not None and not isinstance(body["rid"], str):
        raise FieldError("rid", body["rid"], "a string or null")
    mt = sp.get("max_new_tokens", 128)
    temperature, top_p, top_k = sp.get("temperature"), sp.get("top_p"), sp.get("top_k")
    if top_k is not None and top_k != -1:  # SGLang's "off" is -1; 0 is an error there
        check_int("sampling_params.top_k", top_k, 1)
    top_k = common.top_k("sampling_params.top_k", top_k, vocab_size, off=(None, -1))
    mode = sp.get("logprobs_mode")
    mode = check_logprobs_mode(DEFAULT_LOGPROBS_MODE if mode is None else mode, "sampling_params.logprobs_mode")
    return GenerateRequest(
        prompt_ids=prompt,
        max_tokens=common.max_tokens("sampling_params.max_new_tokens", mt, len(prompt), max_seq_len),
        temperature=1.0 if temperature is None else common.real("sampling_params.temperature", temperature,
                                                                0.0, float("inf")),
        top_p=1.0 if top_p is None else common.real("sampling_params.top_p", top_p, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        seed=common.seed("sampling_params.sampling_seed", sp.get("sampling_seed")),
        stop_token_ids=common.stop_ids("sampling_params.stop_token_ids", sp.get("stop_token_ids"), vocab_size),
        return_logprobs=flags["return_logprob"], return_routed_experts=flags["return_routed_experts"],
        routed_experts_prompt_start=start, logprobs_mode=mode)


def render_generate(out: GenerateOutput, request: GenerateRequest, *, num_experts: int, rid: str,
                    text: str = "") -> dict:
    """SGLang's non-streaming ``/generate`` answer for ``out`` (``text`` is given or '')."""
    ids, g = [int(t) for t in out.output_ids], len(out.output_ids)
    if out.finish_reason == "stop":
        reason = {"type": "stop", "matched": ids[-1]}
    elif out.finish_reason == "abort":  # a weight update (mode "abort") returned what the request had
        reason = {"type": "abort", "message": "aborted by a weight update; resubmit the prompt and output_ids"}
    else:
        reason = {"type": "length", "length": int(request.max_tokens)}
    meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "prompt_tokens": len(request.prompt_ids),
                            "weight_version": str(out.weight_version), "num_retractions": 0,
                            "reasoning_tokens": 0, "completion_tokens": g, "cached_tokens": int(out.cached_tokens)}
    if out.logprobs is not None:
        meta["output_token_logprobs"] = [[common.clamp_logprob(lp), t, None] for lp, t in zip(out.logprobs, ids)]
        meta["output_token_logprobs_length"] = g
    if request.return_routed_experts and out.routed_experts is not None:
        meta["routed_experts"] = encode_routes(out.routed_experts, num_experts)
    common.with_spans(meta, out, lambda spans: version_spans(spans, g))
    return {"text": text, "output_ids": ids, "meta_info": meta}


def version_spans(spans, g: int) -> list[dict]:
    """``((first token index, version), ...)`` as SGLang's ``[{"version": str, "start", "end"}, ...]``."""
    bounds = [int(i) for i, _ in spans] + [g]
    return [{"version": str(int(v)), "start": bounds[k], "end": bounds[k + 1]} for k, (_, v) in enumerate(spans)]


def read_version_spans(value: Any, g: int, where: str) -> tuple:
    """SGLang's ``meta_info.weight_versions`` → ``((first token index, version), ...)``: spans from 0 to
    G, each starting where the last ended, versions integers (or integer strings; "default" is
    ``UNKNOWN_VERSION``). Absent: ``()``."""
    if value is None:
        return ()
    out, end = [], 0
    ok = isinstance(value, list)
    for span in value if ok else ():
        if not (isinstance(span, Mapping) and is_int(span.get("start")) and is_int(span.get("end"))
                and span["start"] == end < span["end"] <= g):
            ok = False
            break
        version = _version_value(span.get("version"))
        if version is None:
            ok = False
            break
        out.append((int(span["start"]), version))
        end = int(span["end"])
    if not ok or (value and end != g):
        raise ProtocolError(f"{where}: meta_info.weight_versions={str(value)[:80]}: expected [{{'version', 'start', "
                            f"'end'}}, ...] covering output tokens [0, {g}) in order", "weight_versions")
    return tuple(out)


def error_response(err: FieldError) -> tuple[int, dict]:
    """SGLang's ``_create_error_response``: 400 ``{"error": {"message": ...}}``."""
    return 400, {"error": {"message": err.message}}


# --------------------------------------------------------------------------------------------------
# Client direction.


def generate_body(request: GenerateRequest) -> dict:
    """The ``/generate`` body for ``request`` (``top_k`` -1 is SGLang's "off")."""
    sp: dict[str, Any] = {"max_new_tokens": int(request.max_tokens), "temperature": float(request.temperature),
                          "top_p": float(request.top_p), "top_k": int(request.top_k) if request.top_k > 0 else -1,
                          "stop_token_ids": [int(t) for t in request.stop_token_ids], **logprobs_mode_field(request)}
    if request.seed is not None:
        sp["sampling_seed"] = int(request.seed)
    return {"input_ids": [int(t) for t in request.prompt_ids], "sampling_params": sp,
            "return_logprob": bool(request.return_logprobs),
            "return_routed_experts": bool(request.return_routed_experts),
            "routed_experts_start_len": check_prompt_start(request.routed_experts_prompt_start,
                                                           len(request.prompt_ids))}


def _version_value(value: Any) -> int | None:
    """An SGLang weight version (a string there, or an int) as an int; "default" (no update yet, or a
    server started without ``--weight-version``) is ``UNKNOWN_VERSION``; anything else None."""
    if is_int(value) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        return int(value)
    return common.UNKNOWN_VERSION if value == "default" else None


def _version(meta: Mapping, where: str) -> int:
    """SGLang's ``meta_info.weight_version`` (a string there) as an int. ``"default"`` (no update yet,
    or a server started without ``--weight-version``) is ``UNKNOWN_VERSION``; a missing or other
    non-integer value is a broken answer."""
    value = meta.get("weight_version", None)
    version = _version_value(value)
    if version is not None:
        return version
    state = "missing" if "weight_version" not in meta else f"{value!r}"
    raise ProtocolError(f"{where}: meta_info.weight_version is {state}: expected an integer version or "
                        "'default' (start SGLang with --weight-version 0 to have versions)", "weight_version")


def _count(meta: Mapping, key: str, where: str) -> int:
    if not is_int(meta.get(key)):
        raise ProtocolError(f"{where}: meta_info.{key}={meta.get(key)!r}: expected an int", key)
    return int(meta[key])


def parse_generate_response(content: bytes | str | Mapping, request: GenerateRequest, *, num_experts: int,
                            num_layers: int, top_k: int, vocab_size: int | None = None,
                            where: str = "sglang") -> GenerateOutput:
    """An SGLang ``/generate`` answer → ``GenerateOutput`` checked against the row rule."""
    with common.reading(where, "SGLang /generate response"):
        obj = json.loads(content) if isinstance(content, (bytes, str)) else content
        meta = obj["meta_info"]
        reason = meta["finish_reason"]
        if isinstance(reason, dict):
            reason = reason.get("type")
        lp_rows = meta.get("output_token_logprobs")
        ids = obj.get("output_ids")
        if ids is None and isinstance(lp_rows, list):
            ids = [row[1] for row in lp_rows]
        ids = common.output_ids(ids, request, vocab_size, where)
        lps = None
        if request.return_logprobs:
            if not isinstance(lp_rows, list):
                raise ProtocolError(f"{where}: meta_info.output_token_logprobs missing: the request asked for them")
            lps = common.logprob_list([row[0] for row in lp_rows], len(ids), where)
        routes = None
        if request.return_routed_experts:
            if meta.get("routed_experts") is None:
                raise ProtocolError(f"{where}: meta_info.routed_experts missing (is the server started with "
                                    "--enable-return-routed-experts?)")
            arr = decode_routes(meta["routed_experts"], num_experts, num_layers, top_k)
            routes = common.route_rows(arr, request, len(ids), num_experts=num_experts, num_layers=num_layers,
                                       top_k=top_k, where=where)
        cached = _count(meta, "cached_tokens", where)
        prompt_tokens = _count(meta, "prompt_tokens", where)
        version = _version(meta, where)
        spans = read_version_spans(meta.get("weight_versions"), len(ids), where)
    return common.one_span(GenerateOutput(output_ids=ids, logprobs=lps, finish_reason=common.finish(reason, where),
                          routed_experts=routes, prompt_tokens=prompt_tokens,
                          cached_tokens=cached, weight_version=version,
                          routed_experts_start=int(request.routed_experts_prompt_start), weight_versions=spans))
