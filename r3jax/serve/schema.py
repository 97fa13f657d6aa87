"""Wire schema of the inference server: request bodies → ``GenerateRequest``, outputs → JSON.

Two stages, so every rejection names its field:

0. :func:`load_json` (shared with the peers' endpoints): JSON whose every string is valid Unicode.
1. :class:`GenerateBody` (pydantic, strict, no extra fields) checks types: ints are ints (not bools,
   not floats), floats are finite numbers, lists are lists. It is also the OpenAPI schema.
2. :func:`to_request` checks values against the served model (:class:`Limits`): token ids in
   ``[0, V)``, ``1 <= max_tokens``, ``P + max_tokens <= max_seq_len``,
   ``0 <= routed_experts_prompt_start <= P`` (docs/design.md §3), sampling ranges.

Failures raise :class:`InputError`, a :class:`r3jax.checks.FieldError` (``err.field`` is the dotted
body field as data) with a status; the app turns it into a 4xx JSON body
``{"error": "invalid_request", "field": ..., "detail": ...}``. The rules themselves (ints, the
prompt start) are :mod:`r3jax.checks`'s.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from r3jax import checks
from r3jax import routes as routes_lib
from r3jax.checks import FieldError

MAX_SEED = checks.SEED_MAX  # the engine turns a seed into a 64-bit PRNG key
MAX_STOP_TOKENS = 64
MAX_SESSION_ID = 256


class InputError(FieldError):
    """Bad client input: a :class:`FieldError` (``field``: dotted path, e.g.
    ``sampling_params.max_tokens``; ``value``; ``expected``) with the message sent back and a status
    code (422 unless the body is not JSON at all: 400, or too large: 413)."""

    def __init__(self, field: str, message: str, status: int = 422, *, value: Any = None,
                 expected: str = ""):
        super().__init__(field, value, expected, message)
        self.status = status

    @classmethod
    def of(cls, err: FieldError, status: int = 422) -> "InputError":
        """``err`` (raised by a :mod:`r3jax.checks` rule) as an InputError with its field and message."""
        return cls(err.field, err.message, status, value=err.value, expected=err.expected)

    def body(self) -> dict:
        return {"error": "invalid_request", "field": self.field, "detail": self.message}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingParams(_Strict):
    """Sampling controls; the defaults are :class:`r3jax.engine.GenerateRequest`'s."""

    max_tokens: int = Field(16, description="new tokens to sample, >= 1; P + max_tokens <= max_seq_len")
    temperature: float = Field(1.0, allow_inf_nan=False, description=">= 0; below 1e-5 (0 included) is greedy")
    top_p: float = Field(1.0, allow_inf_nan=False, description="in (0, 1]")
    top_k: int = Field(0, description="0 (off) or in [1, vocab_size]")
    seed: int | None = Field(None, description=f"in [0, {MAX_SEED}]; same seed, same output")
    stop_token_ids: list[int] = Field(default_factory=list, description="ids in [0, vocab_size)")
    routed_experts_prompt_start: int = Field(
        0, description="s in [0, len(prompt_ids)]: routes come back for positions [s, P + G - 1)")
    n: int = Field(1, description=f"samples of the prompt, in [1, {checks.MAX_SAMPLES}]: they share one "
                   "prefill, sample i is seeded seed + i, and n > 1 answers {\"outputs\": [one response each]}")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "raw_logprobs", description="vLLM's names: raw_logprobs = log_softmax of the model's logits; "
        "processed_logprobs = after temperature and top-k/top-p (the distribution that sampled)")


class GenerateBody(_Strict):
    """``POST /v1/generate`` body (docs/design.md §5)."""

    prompt_ids: list[int] = Field(description="prompt token ids, each in [0, vocab_size); not empty")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    return_logprobs: bool = True
    session_id: str | None = Field(None, description=f"sticky-routing / cache key, <= {MAX_SESSION_ID} chars")


class WeightsBody(_Strict):
    """``POST /v1/weights`` body: a local directory to load, and its format."""

    path: str = Field(description="directory on the server's file system")
    format: Literal["orbax", "safetensors"]
    weight_version: int | None = Field(default=None, description="the new weights' version (above the current "
                                       "one; default: the current one + 1), e.g. the trainer's step")


class RoutesWire(BaseModel):
    """Route payload (docs/design.md §3): base64 of the C-order bytes, shape [rows, L, K], dtype, start, layers."""

    data: str
    shape: list[int]
    dtype: str
    start: int
    layers: list[int]


class GenerateResponse(BaseModel):
    """``POST /v1/generate`` response (documented in OpenAPI; built by :func:`output_json`)."""

    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: Literal["stop", "length", "abort"]
    routed_experts: RoutesWire | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: int
    weight_versions: list[list[int]] = Field(
        description="[[first token index, weight version], ...]: the versions that sampled the tokens "
                    "(several when a weight update with mode=keep came mid-request)")


class GenerateSamplesResponse(BaseModel):
    """``POST /v1/generate`` response when ``sampling_params.n`` > 1: one response per sample, in
    seed order (binary framing: each carries ``routed_experts_binary``, the frames follow in order)."""

    outputs: list[GenerateResponse]


class ModelInfo(BaseModel):
    """``GET /v1/model`` response."""

    num_experts: int
    top_k: int
    num_moe_layers: int
    moe_layer_ids: list[int]
    vocab_size: int
    max_seq_len: int
    weight_version: int


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model accepts: vocabulary size and the engine's maximum sequence length."""

    vocab_size: int
    max_seq_len: int


def _field(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _get(obj: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            obj = obj[part]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _short(value: Any) -> str:
    if checks.nests_deeper(value, 8):  # json.dumps recurses per level: a deep list would overflow the stack
        return checks.short(value)
    try:
        text = json.dumps(value)  # show the value as the client wrote it (true, null)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_json(raw: bytes, status: int = 400) -> Any:
    """Request bytes as a JSON value whose every string is valid Unicode (a lone surrogate such as
    ``"\\ud800"`` is legal JSON but no tokenizer or UTF-8 codec takes it). Raises
    :class:`r3jax.checks.FieldError` (field ``body``) when it is not JSON, or naming the string's field."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        msg = getattr(e, "msg", None) or type(e).__name__
        raise FieldError("body", None, "a JSON body", f"body is not valid JSON ({msg})") from None
    if checks.json_may_hold_surrogates(raw):
        checks.check_json_text(obj)
    return obj


def parse_json(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes → validated ``model``; raises :class:`InputError` naming the first offending field."""
    try:
        obj = load_json(raw)
    except FieldError as e:
        raise InputError.of(e, 400 if e.field == "body" else 422) from None
    if not isinstance(obj, dict):
        raise InputError("body", f"body is a JSON {type(obj).__name__}: expected an object", 422)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = tuple(err["loc"])
        field = _field(loc)
        if err["type"] == "missing":
            raise InputError(field, f"{field}: required field is missing") from None
        if err["type"] == "extra_forbidden":
            raise InputError(field, f"{field}: unknown field (expected one of "
                             f"{sorted(_fields_at(model, loc[:-1]))})") from None
        raise InputError(field, f"{field}={_short(_get(obj, loc))}: {err['msg']}") from None
    except RecursionError:
        raise InputError("body", "body is nested too deeply", 422) from None


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        if isinstance(part, int):
            continue
        ann = model.model_fields[part].annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _in_range(field: str, value: int, lo: int, hi: int, why: str = "") -> None:
    """A range on an int pydantic has already checked; ``why`` says where a bound comes from."""
    if not lo <= value <= hi:
        raise InputError(field, f"{field}={value}: expected an int in [{lo}, {hi}]{why}", value=value,
                         expected=f"an int in [{lo}, {hi}]")


def to_request(body: GenerateBody, limits: Limits):
    """Value checks against the served model, then the engine's ``GenerateRequest``."""
    from r3jax.engine import GenerateRequest  # deferred: schema stays importable without JAX

    prompt, sp = body.prompt_ids, body.sampling_params
    vocab, max_len = limits.vocab_size, limits.max_seq_len
    if not prompt:
        raise InputError("prompt_ids", "prompt_ids=[]: expected at least one token id")
    if len(prompt) >= max_len:
        raise InputError("prompt_ids", f"prompt_ids has {len(prompt)} tokens: expected at most "
                         f"max_seq_len - 1 = {max_len - 1}")
    for i, tok in enumerate(prompt):
        if not 0 <= tok < vocab:
            raise InputError(f"prompt_ids[{i}]", f"prompt_ids[{i}]={tok}: expected a token id in "
                             f"[0, vocab_size={vocab})")
    _in_range("sampling_params.n", sp.n, 1, checks.MAX_SAMPLES)
    _in_range("sampling_params.max_tokens", sp.max_tokens, 1, max_len - len(prompt),
              f" (max_seq_len {max_len} - prompt length {len(prompt)})")
    try:  # the rules every protocol shares: the engine's int32 / float32 limits
        checks.check_real("sampling_params.temperature", sp.temperature, 0.0, float("inf"))
        checks.check_real("sampling_params.top_p", sp.top_p, 0.0, 1.0, lo_open=True)
        checks.check_top_k("sampling_params.top_k", sp.top_k, vocab)
        if sp.seed is not None:
            checks.check_seed("sampling_params.seed", sp.seed)
    except FieldError as e:
        raise InputError.of(e) from None
    if len(sp.stop_token_ids) > MAX_STOP_TOKENS:
        raise InputError("sampling_params.stop_token_ids", f"sampling_params.stop_token_ids has "
                         f"{len(sp.stop_token_ids)} ids: expected at most {MAX_STOP_TOKENS}")
    for i, tok in enumerate(sp.stop_token_ids):
        _in_range(f"sampling_params.stop_token_ids[{i}]", tok, 0, vocab - 1)
    try:
        checks.check_prompt_start(sp.routed_experts_prompt_start, len(prompt),
                                  field="sampling_params.routed_experts_prompt_start")
    except FieldError as e:
        raise InputError.of(e) from None
    if body.session_id is not None and len(body.session_id) > MAX_SESSION_ID:
        raise InputError("session_id", f"session_id has {len(body.session_id)} chars: expected at "
                         f"most {MAX_SESSION_ID}")
    request = GenerateRequest(
        prompt_ids=list(prompt), max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=sp.top_k, seed=sp.seed, stop_token_ids=tuple(sp.stop_token_ids),
        return_logprobs=body.return_logprobs, return_routed_experts=body.return_routed_experts,
        routed_experts_prompt_start=sp.routed_experts_prompt_start, session_id=body.session_id,
        logprobs_mode=sp.logprobs_mode)
    try:  # the engine's own checks, as a backstop: same rules, so this should never fire
        request.validate(vocab_size=vocab, max_seq_len=max_len)
    except ValueError as e:
        raise engine_error(e) from None
    return request


_SAMPLING = set(SamplingParams.model_fields)


def engine_error(err: ValueError) -> InputError:
    """An engine refusal as an InputError naming the body field.

    A :class:`FieldError` carries its field as data (``max_tokens``, ``requests[0].prompt_ids[3]``):
    the request index is dropped and sampling fields are put under ``sampling_params``. Any other
    ValueError names no field, so it is reported against the whole body.
    """
    if not isinstance(err, FieldError):
        return InputError("body", str(err))
    field, message = err.field, err.message
    if field.startswith("requests["):  # Engine.generate nests each request's errors under its index
        prefix = field.split(".", 1)[0] + "."
        field = field[len(prefix):]
        message = message[len(prefix):] if message.startswith(prefix) else message
    name = field.split(".", 1)[0].split("[", 1)[0]
    if name in _SAMPLING:
        field, message = f"sampling_params.{field}", f"sampling_params.{message}"
    return InputError(field, message, value=err.value, expected=err.expected)


def output_json(out, layers: list[int], *, binary_routes: bool = False) -> tuple[dict, bytes]:
    """A ``GenerateOutput`` as the response dict, plus the binary route frame when asked for.

    JSON mode: ``routed_experts`` is the wire form (or None), the trailing bytes are empty.
    Binary mode: ``routed_experts`` is None and ``routed_experts_binary`` holds the byte length of
    the :func:`r3jax.routes.encode_binary` frame returned second (0 when no routes were asked for).
    """
    from r3jax.serve.peers.common import clamp_logprob  # deferred: schema stays importable without JAX

    routes = out.routed_experts
    # No default: a start that is not the request's s would misplace every row by the difference.
    start = None if routes is None else out.routed_experts_start
    obj = {"output_ids": [int(t) for t in out.output_ids],
           # a non-finite logprob goes out as vLLM's floor, -9999.0: no NaN or infinity leaves the server
           "logprobs": None if out.logprobs is None else [clamp_logprob(x) for x in out.logprobs],
           "finish_reason": out.finish_reason, "routed_experts": None,
           "prompt_tokens": int(out.prompt_tokens), "cached_tokens": int(out.cached_tokens),
           "weight_version": int(out.weight_version),
           "weight_versions": [[int(i), int(v)] for i, v in getattr(out, "weight_versions", ())]}
    frame = b""
    if routes is not None and binary_routes:
        frame = routes_lib.encode_binary(routes, start, layers)
    elif routes is not None:
        obj["routed_experts"] = routes_lib.encode(routes, start, layers)
    if binary_routes:
        obj["routed_experts_binary"] = len(frame)
    return obj, frame
