"""Input errors that carry their field as data, and the checks ``models/`` needs itself (replay routes,
sizes in checkpoint files); :mod:`r3jax.checks` re-exports them with the rest of the input rules.

- :class:`FieldError`: a ``ValueError`` whose ``field`` / ``value`` / ``expected`` attributes let a
  server build its 4xx body without parsing the message.
- :func:`is_int`: an int that is not a bool.
- :func:`check_route_ids`: an integer (non-bool) array of expert ids in ``[0, E)``, distinct within
  each (token, layer), naming the token, layer and value it found.
"""

from __future__ import annotations

import numbers
import reprlib
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


def short(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for error messages; any nesting depth is safe."""
    # repr recurses once per nesting level: a body nested ~1000 deep (still valid JSON) would raise
    # RecursionError while its error message is built; past a few levels show an elided repr instead
    text = _ELIDED.repr(value) if nests_deeper(value, 8) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_short = short
_ELIDED = reprlib.Repr()
_ELIDED.maxlevel, _ELIDED.maxlist, _ELIDED.maxdict, _ELIDED.maxstring = 3, 8, 4, 60


def nests_deeper(value: Any, limit: int) -> bool:
    """True when lists / tuples / dicts nest more than ``limit`` levels (no recursion: any depth)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, False for bools (True/False are not counts or ids)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


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
