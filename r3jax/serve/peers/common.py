"""What the peer adapters share: readers for JSON body fields (over :mod:`r3jax.checks`, so every
rule keeps one home) and the client-side checks of a peer's answer (the row rule of docs/design.md §3).

Server direction: every reader raises :class:`r3jax.checks.FieldError` naming the peer's own field
(``sampling_params.max_new_tokens``, ``prompt``...). Client direction: a peer answer that breaks
the contract raises :class:`r3jax.serve.protocol.ProtocolError`; nothing is trimmed or padded
except the one documented case in :func:`route_rows` (a peer that ignored the prompt start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from typing import Any, Iterable, Mapping

import numpy as np

from r3jax import checks
from r3jax.checks import FieldError, check_int, check_route_ids, is_int
from r3jax.routes import route_dtype
from r3jax.serve.protocol import ProtocolError, read_spans

CLAMPED_LOGPROB = -9999.0  # the floor vLLM and SkyRL put on a missing or non-finite sampled logprob
UNKNOWN_VERSION = -1  # weight_version of an output whose peer protocol does not report one


def mapping(field: str, value: Any) -> Mapping[str, Any]:
    """``value`` as a JSON object (``None`` counts as ``{}``: peers treat a null group as absent)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise FieldError(field, value, "a JSON object")
    return value


def refuse_unknown(body: Mapping[str, Any], known: Iterable[str], prefix: str = "") -> None:
    """FieldError for the first key of ``body`` that r3jax does not read (sorted, so it is stable)."""
    known = set(known)
    for key in sorted(body):
        if key not in known:
            raise FieldError(f"{prefix}{key}", body[key],
                             f"a field r3jax supports here (one of {sorted(known)})")


def only_defaults(body: Mapping[str, Any], defaults: Mapping[str, tuple], prefix: str = "") -> None:
    """Fields r3jax accepts only at values that change nothing: ``defaults[key]`` lists them."""
    for key, allowed in defaults.items():
        if key in body and not any(_same(body[key], a) for a in allowed):
            shown = ", ".join(repr(a) for a in allowed)
            raise FieldError(f"{prefix}{key}", body[key], f"{shown} (r3jax does not support other values)")


def _same(value: Any, allowed: Any) -> bool:
    if isinstance(allowed, bool) or allowed is None or isinstance(allowed, (str, list)):
        return type(value) is type(allowed) and value == allowed
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    return ok and value == allowed


def token_ids(field: str, value: Any, vocab_size: int | None, allow_empty: bool = False) -> list[int]:
    """A JSON list of int token ids, each in ``[0, vocab_size)`` (int32 when V is not known)."""
    return checks.check_token_ids(field, value, vocab_size, allow_empty)


def stop_ids(field: str, value: Any, vocab_size: int | None) -> tuple[int, ...]:
    """Optional stop token ids: null or a (possibly empty) list of ids in ``[0, V)``."""
    return () if value is None else tuple(token_ids(field, value, vocab_size, allow_empty=True))


def real(field: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    """A finite number (not a bool) in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``) within float32."""
    return checks.check_real(field, value, lo, hi, lo_open)


def flag(field: str, value: Any) -> bool:
    """A JSON boolean (1/0 are not booleans)."""
    if not isinstance(value, (bool, np.bool_)):
        raise FieldError(field, value, "true or false")
    return bool(value)


def max_tokens(field: str, value: Any, prompt_len: int, max_seq_len: int | None) -> int:
    """New-token budget: an int >= 1 with ``P + max_tokens <= max_seq_len`` when that is known.

    ``None`` means "up to the context limit" (vLLM's meaning), so it needs ``max_seq_len``."""
    if value is None:
        if max_seq_len is None or max_seq_len - prompt_len < 1:
            raise FieldError(field, value, "an int >= 1 (null needs room left in max_seq_len)")
        return max_seq_len - prompt_len
    hi = checks.INT32_MAX if max_seq_len is None else max(max_seq_len - prompt_len, 0)
    if hi == 0:
        raise FieldError(field, value, f"room for one new token: the prompt has {prompt_len} tokens and "
                                       f"max_seq_len={max_seq_len}")
    return check_int(field, value, 1, hi)


def seed(field: str, value: Any, minus_one_unset: bool = False) -> int | None:
    """A sampling seed in ``[0, 2**64)`` or None; with ``minus_one_unset`` -1 also means no seed (vLLM)."""
    if value is None or (minus_one_unset and is_int(value) and value == -1):
        return None
    return checks.check_seed(field, value)


def top_k(field: str, value: Any, vocab_size: int | None, off: tuple = (None,)) -> int:
    """``top_k`` as the engine takes it (0: off): the peer's "off" values (``off``) or 0 / ``[1, V]``."""
    if any(value is o or (is_int(value) and is_int(o) and value == o) for o in off):
        return 0
    return checks.check_top_k(field, value, vocab_size)


def clamp_logprob(x: float) -> float:
    """The sampled logprob as the peers send it: non-finite or below -9999 becomes -9999.0."""
    x = float(x)
    return x if math.isfinite(x) and x >= CLAMPED_LOGPROB else CLAMPED_LOGPROB


# --------------------------------------------------------------------------------------------------
# Client direction: a peer's answer checked against the request.


@contextlib.contextmanager
def reading(where: str, what: str):
    """Reading a peer's answer: any malformed part becomes one :class:`ProtocolError` (a bad id keeps
    its field, e.g. ``routed_experts``), never a bare KeyError or TypeError."""
    try:
        yield
    except ProtocolError:
        raise
    except FieldError as e:
        raise ProtocolError(f"{where}: {e}", e.field.split(" ")[0] or None) from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ProtocolError(f"{where}: bad {what} ({type(e).__name__}: {e})") from None


def output_ids(ids: Any, request, vocab_size: int | None, where: str) -> list[int]:
    """G >= 1 sampled ids (at most max_tokens), ints in ``[0, V)`` when V is known."""
    if not isinstance(ids, list) or any(not is_int(t) for t in ids):
        raise ProtocolError(f"{where}: token ids {ids!r}: expected a list of ints")
    if not 1 <= len(ids) <= request.max_tokens:
        raise ProtocolError(f"{where}: {len(ids)} token ids: expected 1..max_tokens={request.max_tokens}")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise ProtocolError(f"{where}: token ids {ids}: expected ids in [0, {vocab_size})")
    return [int(t) for t in ids]


def logprob_list(values: Any, g: int, where: str) -> list[float]:
    """G finite floats, one per sampled token."""
    if not isinstance(values, list) or len(values) != g:
        raise ProtocolError(f"{where}: logprobs {values!r}: expected {g} floats (one per token)")
    out = []
    for v in values:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            raise ProtocolError(f"{where}: logprob {v!r}: expected a finite float")
        out.append(float(v))
    return out


def finish(value: Any, where: str, *, abort: bool = True) -> str:
    """A finish reason: "stop", "length", or (``abort``) "abort": a weight update in mode "abort"
    returned what the request had, a partial output to resume (prompt + output, routes from the
    trace's cursor). Anything else is a broken answer."""
    allowed = ("stop", "length", "abort") if abort else ("stop", "length")
    if value not in allowed:
        raise ProtocolError(f"{where}: finish_reason={value!r}: expected {' or '.join(map(repr, allowed))}")
    return value


def with_spans(target: dict, out, render=None, key: str = "weight_versions") -> dict:
    """``target`` with ``key``: ``out.weight_versions`` rendered (default: r3jax's ``[[first token index,
    version], ...]``, the vLLM and SkyRL forms' extension field, as neither protocol has one), only for
    an output that spans more than one version: one version is already said (``X-Weight-Version``,
    SGLang's ``weight_version``), and a one-version answer stays byte for byte the peer's own."""
    spans = tuple(getattr(out, "weight_versions", ()))
    if len(spans) > 1:
        target[key] = (render or (lambda s: [[int(i), int(v)] for i, v in s]))(spans)
    return target


def read_span_list(value: Any, g: int, where: str) -> tuple:
    """The extension field back (absent or null: ``()``; the client then takes the answer's one
    version, :func:`one_span`)."""
    return () if value is None else read_spans(value, g, where)


def one_span(out):
    """``out`` with ``weight_versions`` ``((0, weight_version),)`` when its answer sent no spans (one
    version) and the version is known."""
    if out.weight_versions or out.weight_version == UNKNOWN_VERSION:
        return out
    return dataclasses.replace(out, weight_versions=((0, int(out.weight_version)),))


def route_rows(routes: np.ndarray, request, g: int, *, num_experts: int, num_layers: int, top_k: int,
               where: str) -> np.ndarray:
    """Routes ``[rows, L, K]`` checked against the row rule, as ``route_dtype(E)``.

    Rows must be those of positions ``[s, P + G - 1)``: exactly ``P - s + G - 1``. A peer that does
    not know the prompt start (vLLM before it, SGLang before ``routed_experts_start_len``) sends the
    whole ``[0, P + G - 1)``; when s > 0 and the count is exactly ``P + G - 1`` the first s rows are
    dropped, which is the only rows that answer can mean. Any other count is refused.
    """
    s, p = int(request.routed_experts_prompt_start), len(request.prompt_ids)
    want = p - s + g - 1
    if routes.ndim != 3 or routes.shape[1:] != (num_layers, top_k):
        raise ProtocolError(f"{where}: routed_experts shape {list(routes.shape)}: expected "
                            f"[rows, L={num_layers}, K={top_k}]")
    if routes.shape[0] != want:
        if s > 0 and routes.shape[0] == p + g - 1:
            routes = routes[s:]
        else:
            raise ProtocolError(f"{where}: routed_experts has {routes.shape[0]} rows: expected "
                                f"P - s + G - 1 = {p} - {s} + {g} - 1 = {want}")
    with reading(where, "routed_experts"):
        check_route_ids(routes, num_experts, "routed_experts")
    return routes.astype(route_dtype(num_experts))


def samples(request, n: int) -> list:
    """``n`` requests (:class:`r3jax.engine.GenerateRequest`) for one prompt, submitted together so the
    engine prefills it once. With a seed s, sample i is seeded s + i (mod 2**64): reproducible and
    distinct; without one, each draws its own."""
    if request.seed is None:
        return [request] * n
    return [dataclasses.replace(request, seed=(request.seed + i) % (1 << 64)) for i in range(n)]
