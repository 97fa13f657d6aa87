"""One home for each input rule: host-side checks whose errors carry their field as data.

Every path where a value enters r3jax (engine requests, HTTP bodies, peer protocols, route decoders,
the trace, ``collate``) calls these, so each rule is written once:

- :func:`check_int`: an int (never a bool) in a range.
- :func:`check_prompt_start`: ``0 <= s <= P`` (DESIGN.md §3).
- :func:`check_route_ids`: an integer (non-bool) array of expert ids in ``[0, E)``, distinct within
  each (token, layer), naming the token, layer and value it found.
- :func:`check_logprobs_mode`: one of vLLM's logprobs-mode names r3jax offers (:data:`LOGPROBS_MODES`).

A failed check raises :class:`FieldError`, a ``ValueError`` whose ``field`` / ``value`` / ``expected``
attributes let a server build its 4xx body without parsing the message.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


class FieldError(ValueError):
    """Bad input: ``field`` (e.g. ``"sampling_params.max_tokens"``), the ``value`` found and what was
    ``expected``. ``str(err)`` is ``"{field}={value!r}: expected {expected}"`` unless a message is given.
    """

    def __init__(self, field: str, value: Any, expected: str, message: str | None = None):
        self.field, self.value, self.expected = field, value, expected
        self._message = message
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if self._message is not None:
            return self._message
        return f"{self.field}={_short(self.value)}: expected {self.expected}"

    def within(self, prefix: str) -> "FieldError":
        """The same error for a field nested under ``prefix`` (``"requests[3]"``, ``"sampling_params"``)."""
        joined = f"{prefix}.{self.field}" if self.field else prefix
        message = None if self._message is None else f"{prefix}.{self._message}"
        return FieldError(joined, self.value, self.expected, message)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, False for bools (True/False are not counts or ids)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


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


def check_route_ids(routes: np.ndarray, num_experts: int | None, field: str = "routes") -> None:
    """Raise :class:`FieldError` unless ``routes [..., L, K]`` holds valid expert ids.

    Valid: an integer (non-bool) dtype, ids in ``[0, E)`` (``[0, inf)`` when num_experts is None) and
    no id repeated within one (token, layer) — a repeated id would silently become top-(K-1) with a
    doubled gate. ``err.field`` is ``field``; the message names the first bad row (leading dims:
    trajectory/token), its layer and the value.
    """
    routes = np.asarray(routes)
    if routes.dtype == np.bool_ or not np.issubdtype(routes.dtype, np.integer):
        raise FieldError(f"{field}.dtype", str(routes.dtype), "an integer dtype (not bool or float)")
    if routes.size == 0:
        return
    bad = routes < 0
    hi = "" if num_experts is None else f" and < num_experts={num_experts}"
    if num_experts is not None:
        bad |= routes >= num_experts
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise FieldError(field, int(routes[where]), f"expert ids >= 0{hi}",
                         f"{_at(field, where[:-1])}: expert id {int(routes[where])} at slot {where[-1]}: "
                         f"expected ids >= 0{hi}")
    k = routes.shape[-1] if routes.ndim >= 2 else 1
    if k > 1:
        if k <= 16:  # K(K-1)/2 vector compares beat a sort along a short axis several times over
            dup = np.zeros(routes.shape[:-1], bool)
            for i in range(k - 1):
                for j in range(i + 1, k):
                    dup |= routes[..., i] == routes[..., j]
        else:
            ordered = np.sort(routes, axis=-1)
            dup = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
        if dup.any():
            ordered = np.sort(routes, axis=-1)
            where = tuple(int(i) for i in np.argwhere(dup)[0])
            row = routes[where].tolist()
            value = int(ordered[where][np.flatnonzero(ordered[where][1:] == ordered[where][:-1])[0]])
            raise FieldError(field, row, "K distinct expert ids per (token, layer)",
                             f"{_at(field, where)}={row}: expert id {value} repeated; expected K distinct "
                             f"expert ids per (token, layer)")


def _at(field: str, index: tuple[int, ...]) -> str:
    """``routes[b][t] layer l`` style location: leading dims are rows, the last one the layer."""
    if not index:
        return field
    *rows, layer = index
    names = {1: ("token",), 2: ("trajectory", "token")}.get(len(rows), ())
    if len(names) == len(rows):
        where = ", ".join(f"{n} {i}" for n, i in zip(names, rows))
    else:
        where = "index " + ", ".join(str(i) for i in rows)
    return f"{field} ({where}, layer {layer})" if rows else f"{field} (layer {layer})"


# vLLM's --logprobs-mode names for the two logprob forms (vLLM's *_logits forms are not offered)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
DEFAULT_LOGPROBS_MODE = "raw_logprobs"  # vLLM's default


def check_logprobs_mode(value: Any, field: str = "logprobs_mode") -> str:
    """``value`` if it is one of :data:`LOGPROBS_MODES` (a str, exactly), else FieldError naming ``field``."""
    if not isinstance(value, str) or value not in LOGPROBS_MODES:
        raise FieldError(field, value, " or ".join(repr(m) for m in LOGPROBS_MODES))
    return value
