"""One home for each input rule: host-side checks whose errors carry their field as data.

Every path where a value enters r3jax (engine requests, HTTP bodies, peer protocols, route decoders,
the trace, ``collate``) calls these, so each rule is written once:

- :func:`check_int`: an int (never a bool) in a range.
- :func:`check_prompt_start`: ``0 <= s <= P`` (docs/design.md §3).
- :func:`check_route_ids`: an integer (non-bool) array of expert ids in ``[0, E)``, distinct within
  each (token, layer), naming the token, layer and value it found.
- :func:`check_logprobs_mode`: one of vLLM's logprobs-mode names r3jax offers (:data:`LOGPROBS_MODES`).
- The engine's real limits, so nothing out of range reaches its int32 / float32 device arrays (where
  it would fail the whole decode batch, not just the one request): :func:`check_token_ids`
  (``[0, V)``), :func:`check_top_k` (0 or ``[1, V]``), :func:`check_seed` (``[0, 2**64)``),
  :func:`check_real` (finite, within float32), :data:`INT32_MAX` for any other count.
- Text: :func:`check_text` (a str that is valid Unicode) and :func:`check_json_text` (every string
  of a decoded JSON body, keys included: JSON may spell a lone surrogate ``"\\ud800"``, which no
  UTF-8 codec or tokenizer accepts).

A failed check raises :class:`FieldError`, a ``ValueError`` whose ``field`` / ``value`` / ``expected``
attributes let a server build its 4xx body without parsing the message. ``FieldError``, ``is_int`` and
``check_route_ids`` are defined in :mod:`models.fields` (``models/`` needs them and never imports
``r3jax``) and re-exported here.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from models.fields import FieldError, _short, check_route_ids, is_int, nests_deeper, short  # noqa: F401 (re-exported)

INT32_MAX = 2**31 - 1  # lengths, token ids and top_k travel to the device as int32
SEED_MAX = 2**64 - 1  # a seed becomes a 64-bit PRNG key (two uint32 words)
MAX_SAMPLES = 256  # samples of one prompt that one request may ask for (n), in every protocol
FLOAT32_MAX = float(np.finfo(np.float32).max)  # temperature / top_p travel as float32


def check_int(field: str, value: Any, lo: int | None = 0, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (either bound may be None); bools and non-integers refused."""
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is None and hi is None:
            want = "an int (not a bool)"
        elif hi is None:
            want = f"an int >= {lo}"
        elif lo is None:
            want = f"an int <= {hi}"
        else:
            want = f"an int in [{lo}, {hi}]"
        if isinstance(value, (bool, np.bool_)) and "not a bool" not in want:
            want += " (not a bool)"
        raise FieldError(field, value, want)
    return int(value)


def check_prompt_start(start: Any, prompt_len: int, field: str = "routed_experts_prompt_start") -> int:
    """The routed-experts prompt start s as an int with ``0 <= s <= P`` (P = prompt tokens)."""
    if not is_int(start) or not 0 <= start <= prompt_len:
        raise FieldError(field, start, f"an int in [0, P={prompt_len}] (P = number of prompt tokens)")
    return int(start)


def check_token_ids(field: str, value: Any, vocab_size: int | None, allow_empty: bool = False) -> list[int]:
    """A list / tuple of int token ids, each in ``[0, V)`` (``[0, INT32_MAX]`` when V is not known)."""
    if not isinstance(value, (list, tuple)):
        raise FieldError(field, value, "a list of int token ids")
    hi = INT32_MAX if vocab_size is None else min(int(vocab_size) - 1, INT32_MAX)
    out = [check_int(f"{field}[{i}]", t, 0, hi) for i, t in enumerate(value)]
    if not out and not allow_empty:
        raise FieldError(field, value, "at least one token id")
    return out


def check_top_k(field: str, value: Any, vocab_size: int | None) -> int:
    """``top_k``: 0 (off) or an int in ``[1, V]`` (a larger k keeps every token; beyond int32 it
    cannot even be sent to the device)."""
    hi = INT32_MAX if vocab_size is None else min(int(vocab_size), INT32_MAX)
    if not is_int(value) or not 0 <= value <= hi:
        bound = "INT32_MAX" if vocab_size is None else f"vocab_size={vocab_size}"
        raise FieldError(field, value, f"0 (off) or an int in [1, {bound}]")
    return int(value)


def check_seed(field: str, value: Any) -> int:
    """A sampling seed: an int in ``[0, 2**64 - 1]``."""
    return check_int(field, value, 0, SEED_MAX)


def check_real(field: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    """A finite number (not a bool) in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``) that float32,
    the device's type for it, can hold (``hi`` is capped at the float32 maximum)."""
    hi = min(hi, FLOAT32_MAX)
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    try:
        ok = ok and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    except OverflowError:  # an int beyond float range, e.g. 10**400
        ok = False
    if not ok:
        top = "3.4e38 (float32's largest)" if hi == FLOAT32_MAX else hi
        raise FieldError(field, value, f"a finite number in {'(' if lo_open else '['}{lo}, {top}]")
    return float(value)


_SURROGATES = (0xD800, 0xDFFF)


def _bad_char(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (a valid pair reads as one code point), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def check_text(field: str, value: Any) -> str:
    """A str of valid Unicode: no unpaired surrogate (``"\\ud800"`` in JSON), which UTF-8 cannot encode."""
    if not isinstance(value, str):
        raise FieldError(field, value, "a string")
    at = _bad_char(value)
    if at is not None:
        raise FieldError(field, value, f"valid Unicode text (unpaired surrogate U+{ord(value[at]):04X} at "
                                       f"character {at})")
    return value


def check_json_text(obj: Any, field: str = "") -> None:
    """Every string of a decoded JSON value (object keys too) is valid Unicode, else a FieldError
    naming the first bad one's path (``messages[0].content``). Iterative: any nesting depth."""
    stack: list[tuple[Any, str]] = [(obj, field)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            check_text(where or "body", item)
        elif isinstance(item, dict):
            for key, v in reversed(list(item.items())):
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                path = f"{where}.{name}" if where else name
                if _bad_char(key) is not None:
                    check_text(f"{path} (a key)", key)
                stack.append((v, path))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))


def json_may_hold_surrogates(raw: bytes) -> bool:
    """Cheap pre-test for :func:`check_json_text`: a lone surrogate can only come from a ``\\u``
    escape or non-ASCII bytes (the JSON decoder reads bytes with ``surrogatepass``)."""
    return b"\\u" in raw or not raw.isascii()


# vLLM's --logprobs-mode names for the two logprob forms (vLLM's *_logits forms are not offered)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
DEFAULT_LOGPROBS_MODE = "raw_logprobs"  # vLLM's default


def check_logprobs_mode(value: Any, field: str = "logprobs_mode") -> str:
    """``value`` if it is one of :data:`LOGPROBS_MODES` (a str, exactly), else FieldError naming ``field``."""
    if not isinstance(value, str) or value not in LOGPROBS_MODES:
        raise FieldError(field, value, " or ".join(repr(m) for m in LOGPROBS_MODES))
    return value
