"""Client-side codecs of r3jax's own ``/v1/generate``: a ``GenerateRequest`` as an HTTP body, and a
response (JSON or binary routes) as a checked ``GenerateOutput``. The peers' forms (SkyRL, vLLM,
SGLang) are in :mod:`r3jax.serve.peers`; all share :class:`ProtocolError` and :class:`ServedModel`.

Every decoded output is checked against the request before it is returned: G >= 1 tokens (at most
max_tokens) in ``[0, V)``, G logprobs when asked for, and route rows obeying docs/design.md §3 — exactly
``P - s + G - 1`` rows of ``[L, K]`` ids < E starting at s, from the served MoE layers. A server that
breaks the contract raises :class:`ProtocolError` (naming the field in ``err.field``); nothing is
silently trimmed, padded or defaulted: a response without ``prompt_tokens``, ``cached_tokens`` or
``weight_version`` is refused. Bad request fields raise :class:`r3jax.checks.FieldError`.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

from r3jax import checks
from r3jax import routes as routes_lib
from r3jax.checks import FieldError

BINARY_MEDIA_TYPE = "application/vnd.r3jax.generate+binary"  # the app imports it from here


class ProtocolError(RuntimeError):
    """The server's answer breaks the wire contract (wrong row count, bad fields); not retried.

    ``field``: the response field at fault (e.g. ``"weight_version"``), or None when the whole
    answer is (not JSON, wrong media type)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the client needs to check routes: E, K and the MoE layer ids (L = len(moe_layer_ids))."""

    num_experts: int
    top_k: int
    moe_layer_ids: tuple[int, ...]
    vocab_size: int | None = None
    max_seq_len: int | None = None

    @classmethod
    def from_json(cls, obj: dict) -> "ServedModel":
        try:
            return cls(int(obj["num_experts"]), int(obj["top_k"]), tuple(int(i) for i in obj["moe_layer_ids"]),
                       obj.get("vocab_size"), obj.get("max_seq_len"))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"model info {obj!r}: missing or bad field ({e})") from None


def check_start(request) -> int:
    """``routed_experts_prompt_start`` by :func:`r3jax.checks.check_prompt_start`, or FieldError."""
    return checks.check_prompt_start(request.routed_experts_prompt_start, len(request.prompt_ids))


def _ints(name: str, values) -> list[int]:
    return [checks.check_int(f"{name}[{i}]", v, lo=None) for i, v in enumerate(values)]


def request_body(request) -> dict:
    """The r3jax ``/v1/generate`` body (docs/design.md §5)."""
    sp = {"max_tokens": request.max_tokens, "temperature": float(request.temperature),
          "top_p": float(request.top_p), "top_k": request.top_k, "seed": request.seed,
          "stop_token_ids": _ints("stop_token_ids", request.stop_token_ids),
          "routed_experts_prompt_start": check_start(request)}
    sp.update(logprobs_mode_field(request))
    return {"prompt_ids": _ints("prompt_ids", request.prompt_ids), "sampling_params": sp,
            "return_routed_experts": bool(request.return_routed_experts),
            "return_logprobs": bool(request.return_logprobs), "session_id": request.session_id}


def logprobs_mode_field(request) -> dict:
    """``{"logprobs_mode": mode}`` for a request body, or ``{}`` at the default (raw_logprobs), so a
    default request stays byte-for-byte what a server without the field accepts. The field is an
    r3jax extension in the peers' forms: a real vLLM picks the mode server-wide (``--logprobs-mode``)."""
    mode = checks.check_logprobs_mode(request.logprobs_mode)
    return {} if mode == checks.DEFAULT_LOGPROBS_MODE else {"logprobs_mode": mode}


def _field(obj: dict, key: str, kind, where: str):
    if key not in obj:
        raise ProtocolError(f"{where}: missing field {key!r}", key)
    value = obj[key]
    if kind is int and not checks.is_int(value):
        raise ProtocolError(f"{where}.{key}={value!r}: expected an int", key)
    if kind is list and not isinstance(value, list):
        raise ProtocolError(f"{where}.{key}={value!r}: expected a list", key)
    return value


def _routes(routes, start, layers, request, g: int, info: ServedModel, where: str) -> np.ndarray:
    s, p = int(request.routed_experts_prompt_start), len(request.prompt_ids)
    want = (p - s + g - 1, len(info.moe_layer_ids), info.top_k)
    if routes.shape != want:
        raise ProtocolError(f"{where}: routed_experts shape {list(routes.shape)}: expected {list(want)} "
                            f"= [P - s + G - 1 = {p} - {s} + {g} - 1, L, K]")
    if start is not None and start != s:
        raise ProtocolError(f"{where}: routed_experts start={start}: expected s={s}")
    if layers is not None and tuple(layers) != info.moe_layer_ids:
        raise ProtocolError(f"{where}: routed_experts layers={list(layers)}: expected the served MoE "
                            f"layers {list(info.moe_layer_ids)}")
    return routes


def _output(obj: dict, routes, request, info: ServedModel, where: str):
    from r3jax.engine import GenerateOutput  # deferred: the client itself needs no JAX

    try:
        ids = _ints("output_ids", _field(obj, "output_ids", list, where))
    except FieldError as e:
        raise ProtocolError(f"{where}: {e}", e.field) from None
    g = len(ids)
    if not 1 <= g <= request.max_tokens:
        raise ProtocolError(f"{where}: {g} output_ids: expected 1..max_tokens={request.max_tokens}")
    if info.vocab_size is not None and any(not 0 <= t < info.vocab_size for t in ids):
        raise ProtocolError(f"{where}: output_ids {ids}: expected ids in [0, {info.vocab_size})")
    logprobs = obj.get("logprobs")
    if request.return_logprobs:
        if not isinstance(logprobs, list) or len(logprobs) != g:
            raise ProtocolError(f"{where}: logprobs={logprobs!r}: expected {g} floats (one per output id)")
        logprobs = [float(x) for x in logprobs]
    else:
        logprobs = None
    finish = obj.get("finish_reason")
    if finish not in ("stop", "length", "abort"):
        raise ProtocolError(f"{where}: finish_reason={finish!r}: expected 'stop', 'length' or 'abort'")
    spans = read_spans(obj.get("weight_versions", []), g, where)
    if request.return_routed_experts:
        if routes is None:
            raise ProtocolError(f"{where}: routed_experts missing: the request asked for them")
        routes = _routes(*routes, request, g, info, where)
    else:
        routes = None
    return GenerateOutput(output_ids=ids, logprobs=logprobs, finish_reason=finish, routed_experts=routes,
                          prompt_tokens=_field(obj, "prompt_tokens", int, where),
                          cached_tokens=_field(obj, "cached_tokens", int, where),
                          weight_version=_field(obj, "weight_version", int, where),
                          routed_experts_start=int(request.routed_experts_prompt_start), weight_versions=spans)


def read_spans(value, g: int, where: str) -> tuple:
    """``weight_versions``: ``[[first token index, version], ...]`` starting at 0, indices rising below G
    (absent from an older server: ``()``). Also the extension field of the vLLM and SkyRL forms."""
    ok = isinstance(value, list) and all(
        isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
        for x in value)
    firsts = [x[0] for x in value] if ok else []
    if not ok or (value and (firsts[0] != 0 or firsts != sorted(set(firsts)) or firsts[-1] >= g)):
        raise ProtocolError(f"{where}: weight_versions={str(value)[:80]}: expected [[first token index, "
                            f"version], ...] from index 0, rising, below G={g}", "weight_versions")
    return tuple((int(i), int(v)) for i, v in value)


def parse_response(content: bytes, media_type: str, request, info: ServedModel, where: str):
    """An r3jax ``/v1/generate`` response (JSON or binary framing) → checked ``GenerateOutput``.

    Also reads SkyRL's routes form (``{data, shape, dtype}`` without start/layers)."""
    try:
        if media_type.startswith(BINARY_MEDIA_TYPE):
            (n,) = struct.unpack_from("<I", content)
            obj = json.loads(content[4:4 + n])
            frame = content[4 + n:]
            if len(frame) != obj.get("routed_experts_binary", -1):
                raise ProtocolError(f"{where}: {len(frame)} route bytes after the JSON: expected "
                                    f"routed_experts_binary={obj.get('routed_experts_binary')}")
            routes = routes_lib.decode_binary(frame, info.num_experts) if frame else None
        else:
            obj = json.loads(content)
            wire = obj.get("routed_experts") if isinstance(obj, dict) else None
            routes = None
            if wire is not None:
                arr = routes_lib.decode(wire, info.num_experts)
                routes = (arr, wire.get("start"), wire.get("layers"))
    except ProtocolError:
        raise
    except (ValueError, struct.error) as e:  # bad JSON, bad base64, byte counts, ids >= E
        raise ProtocolError(f"{where}: {e}", getattr(e, "field", None)) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: response is a JSON {type(obj).__name__}: expected an object")
    return _output(obj, routes, request, info, where)
