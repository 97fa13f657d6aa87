"""One home for each input rule: host-side checks whose errors carry their field as data.

Every path where a value enters r3jax (engine requests, HTTP bodies, peer protocols, route decoders,
the trace, ``collate``) calls these, so each rule is written once:

- :func:`check_int`: an int (never a bool) in a range.
- :func:`check_prompt_start`: ``0 <= s <= P`` (DESIGN.md §3).
- :func:`check_route_ids`: an integer (non-bool) array of expert ids in ``[0, E)``, distinct within
  each (token, layer), naming the token, layer and value it found.

A failed check raises :class:`FieldError`, a ``ValueError`` whose ``field`` / ``value`` / ``expected``
attributes let a server build its 4xx body without parsing the message. ``FieldError``, ``is_int`` and
``check_route_ids`` are defined in :mod:`models.fields` (``models/`` needs them and never imports
``r3jax``) and re-exported here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.fields import FieldError, check_route_ids, is_int  # noqa: F401 (re-exported)


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
