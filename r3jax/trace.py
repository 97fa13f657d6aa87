"""Functional, token-aligned trace accumulators: per-turn route chunks in, one per-token array out.

Both classes are immutable JAX pytrees (their chunks are the leaves), so ``jax.tree_util`` works on
them and a trace passes through ``jax.jit``. Appending keeps the chunks in a tuple: a turn copies
its own rows (plus one pointer per earlier turn), and :meth:`finalize` concatenates once; a naive
re-concatenation per turn copies the whole prefix every turn, O(N^2) bytes.
Validation is on shapes and dtypes only, so ``append``/``record`` also run on tracers; the §4 check
of :meth:`RoutedExpertTrace.finalize` reads values and runs on the host.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from r3jax.checks import FieldError, check_int, check_prompt_start
from r3jax.routes import uncaptured_rows

_MISSING = "missing routed-expert row for loss-active target at token"


def _layer_ids(name: str, ids: Any) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ValueError(f"{name}={ids!r}: expected a sequence of ints")
    return tuple(check_int(f"{name}[{i}]", v) for i, v in enumerate(ids))


def _kind(dtype: np.dtype) -> str:
    """'bool' or 'integer'; anything else cannot be widened safely and is refused by the caller."""
    return "bool" if dtype == np.bool_ else "integer"


@struct.dataclass
class TokenMetadataTrace:
    """Immutable accumulator of chunks ``[rows, *trailing]`` whose first axis is tokens.

    The first chunk fixes the schema (trailing shape and dtype kind: integer or bool). Integer
    chunks may differ in dtype: the trace widens (uint8 -> int16 -> int32, by
    ``np.promote_types``) instead of failing. int8 (cannot hold ids >= 128 of a uint8 sender),
    uint64 (promotes to float with signed ids) and floats are refused.
    """

    chunks: tuple = ()

    @property
    def num_rows(self) -> int:
        # Cached outside the dataclass fields (not a leaf, not in eq/repr): summing the chunk
        # shapes on every record would make a turn O(turns). Unflattened copies recount once.
        cached = self.__dict__.get("_num_rows")
        if cached is None:
            cached = sum(int(c.shape[0]) for c in self.chunks)
            object.__setattr__(self, "_num_rows", cached)
        return cached

    @property
    def trailing_shape(self) -> tuple[int, ...] | None:
        return tuple(self.chunks[0].shape[1:]) if self.chunks else None

    @property
    def dtype(self) -> np.dtype | None:
        """The widened dtype of all chunks (None while empty)."""
        if not self.chunks:
            return None
        return functools.reduce(np.promote_types, (np.dtype(c.dtype) for c in self.chunks))

    def append(self, rows: Any, expected_rows: int, *, name: str = "rows") -> "TokenMetadataTrace":
        """A new trace with ``rows [expected_rows, *trailing]`` appended; ``self`` is unchanged.

        NumPy input is copied and frozen (read-only), so later edits by the caller cannot reach
        the trace; jax arrays are immutable already. ``name`` labels the errors.
        """
        expected_rows = check_int("expected_rows", expected_rows)
        if not isinstance(rows, (np.ndarray, jax.Array)):
            raise ValueError(f"{name}: got {type(rows).__name__}, expected a numpy or jax array "
                             f"[rows, ...]")
        if rows.ndim == 0:
            raise ValueError(f"{name} is 0-d (shape ()): expected an array whose first axis is tokens")
        dtype = np.dtype(rows.dtype)
        if dtype != np.bool_ and not np.issubdtype(dtype, np.integer):
            raise ValueError(f"{name} dtype={dtype}: expected an integer or bool dtype (floats "
                             f"are not token metadata ids)")
        if dtype in (np.int8, np.uint64):
            raise ValueError(f"{name} dtype={dtype}: expected uint8/int16/int32 (int8 cannot hold "
                             f"ids >= 128 and uint64 does not widen with signed ids)")
        if rows.shape[0] != expected_rows:
            raise ValueError(f"{name} has {rows.shape[0]} rows: expected {expected_rows}")
        if self.chunks:
            want = self.trailing_shape
            if tuple(rows.shape[1:]) != want:
                raise ValueError(f"{name} trailing shape={tuple(rows.shape[1:])}: expected {want} "
                                 f"(fixed by the first chunk of this trace)")
            have = _kind(np.dtype(self.chunks[0].dtype))
            if _kind(dtype) != have:
                article = "a bool" if have == "bool" else "an integer"
                raise ValueError(f"{name} dtype={dtype}: expected {article} dtype (fixed by the "
                                 f"first chunk of this trace)")
        if isinstance(rows, np.ndarray):
            rows = np.array(rows, copy=True)
            rows.flags.writeable = False
        # The tuple copy moves pointers only (8 bytes per earlier turn), never route data.
        out = self.replace(chunks=self.chunks + (rows,))
        object.__setattr__(out, "_num_rows", self.num_rows + expected_rows)
        return out

    def truncate(self, rows: int) -> "TokenMetadataTrace":
        """A new trace of the first ``rows`` rows (0 <= rows <= num_rows); whole chunks are kept by
        pointer, the chunk the cut falls in is sliced."""
        rows = check_int("rows", rows)
        if rows > self.num_rows:
            raise ValueError(f"rows={rows}: expected <= num_rows={self.num_rows}")
        kept, n = [], 0
        for c in self.chunks:
            if n >= rows:
                break
            take = min(int(c.shape[0]), rows - n)
            kept.append(c if take == c.shape[0] else c[:take])
            n += take
        if not kept and self.chunks:  # keep the schema (trailing shape, dtype) with a 0-row chunk
            kept = [self.chunks[0][:0]]
        out = self.replace(chunks=tuple(kept))
        object.__setattr__(out, "_num_rows", rows)
        return out

    def finalize(self) -> np.ndarray | jax.Array:
        """All rows ``[num_rows, *trailing]`` in the widened dtype, concatenated once.

        NumPy if every chunk is NumPy, else a jax array (also under ``jax.jit``).
        """
        if not self.chunks:
            raise ValueError("finalize: the trace has no chunks, so its trailing shape and dtype "
                             "are unknown; append at least one (possibly 0-row) chunk")
        if all(isinstance(c, np.ndarray) for c in self.chunks):
            return np.concatenate(self.chunks, axis=0, dtype=self.dtype)
        return jnp.concatenate(self.chunks, axis=0, dtype=self.dtype)


def token_versions(spans: Sequence, generated_len: int) -> np.ndarray:
    """``[G]`` int32: the version of each of a call's G generated tokens from its spans ``((first token
    index, version), ...)`` (from index 0, rising, below G)."""
    g = generated_len
    firsts = [check_int(f"versions[{j}][0]", span[0]) for j, span in enumerate(spans)]
    if not firsts or firsts[0] != 0 or firsts != sorted(set(firsts)) or firsts[-1] >= g:
        raise ValueError(f"versions={list(spans)}: expected spans ((first token index, version), ...) "
                         f"from index 0, rising, below generated_len={g}")
    out = np.empty(g, np.int32)
    for j, (first, version) in enumerate(spans):
        out[first:firsts[j + 1] if j + 1 < len(firsts) else g] = check_int(f"versions[{j}][1]", version, -1)
    return out


def row_versions(prompt_len: int, prompt_start: int, generated_len: int, versions: Any) -> np.ndarray:
    """``[P - s + G - 1]`` int32: the weight version whose forward pass produced each route row of one
    call (positions ``[s, P + G - 1)``). Generated token i is sampled from the forward at position
    ``P + i - 1``, so the row of position ``P + i - 1`` (i >= 1) comes from token i's version, and the
    prompt's rows ``[s, P)`` from the first token's (the prefill step that sampled it). ``versions``:
    an int, spans ``((first token index, version), ...)`` from index 0, or None (every row -1)."""
    p, s, g = prompt_len, prompt_start, generated_len
    if isinstance(versions, (tuple, list)) and versions:
        per_token = token_versions(versions, g)
    else:
        per_token = np.full(g, -1 if versions is None or isinstance(versions, (tuple, list))
                            else check_int("versions", versions, -1), np.int32)
    return np.concatenate([np.full(p - s, per_token[0], np.int32), per_token[1:]])


@struct.dataclass
class RoutedExpertTrace:
    """Routes of one trajectory, recorded call by call (docs/design.md §3–§5).

    ``moe_layer_ids``: global ids of the L MoE layers, or None until the first ``record`` that
    names them. Row i of the trace is the route row of absolute token i. ``version_runs``: the weight
    version whose forward pass produced each row, as runs ``((first row, version), ...)`` (-1 where a
    call did not say), so rows recorded before a weight update keep their version after it (never
    re-stamped by a later call). Host metadata, not a leaf: ``jax.tree.map`` over a trace maps routes only.
    """

    moe_layer_ids: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    rows: TokenMetadataTrace = TokenMetadataTrace()
    version_runs: tuple[tuple[int, int], ...] = struct.field(pytree_node=False, default=())

    def __post_init__(self):
        # Static metadata must be a hashable tuple for jit; this also runs on unflatten, so it
        # touches no leaves.
        ids = self.moe_layer_ids
        if ids is not None and not (type(ids) is tuple and all(type(v) is int for v in ids)):
            object.__setattr__(self, "moe_layer_ids", _layer_ids("moe_layer_ids", self.moe_layer_ids))

    @property
    def prompt_start(self) -> int:
        """Rows captured so far: the ``routed_experts_prompt_start`` of the next engine call."""
        return self.rows.num_rows

    def record(self, *, prompt_len: int, generated_len: int, routes: Any,
               layers: Sequence[int] | None = None, versions: Any = None) -> "RoutedExpertTrace":
        """A new trace with one engine call's rows appended; ``self`` is unchanged.

        prompt_len P >= prompt_start s, generated_len G >= 1, routes ``[P - s + G - 1, L, K]``
        with K >= 1 (any integer dtype but bool, int8 and uint64; the trace widens). ``layers``: the
        payload's MoE layer ids; they must equal this trace's ``moe_layer_ids`` when both are known.
        ``versions``: the call's weight version (an int) or its ``weight_versions`` spans
        ``((first token index, version), ...)`` over the G generated tokens (:func:`row_versions` says
        which rows each version produced); None records -1 (unknown).
        Shapes and dtypes only are checked here (so this runs under ``jax.jit``); id values are
        checked where they enter: the route decoders, the engine and ``collate``.
        """
        s = self.prompt_start
        p = check_int("prompt_len", prompt_len)
        g = check_int("generated_len", generated_len, 1)
        check_prompt_start(s, p, field="prompt_start")  # rows captured so far must fit the prompt
        if not isinstance(routes, (np.ndarray, jax.Array)):
            raise FieldError("routes", type(routes).__name__, "a numpy or jax array [rows, L, K]",
                             f"routes: got {type(routes).__name__}, expected a numpy or jax array "
                             f"[rows, L, K]")
        if routes.ndim != 3 or routes.shape[2] == 0:
            raise FieldError("routes", tuple(routes.shape), "[rows, L, K] with K >= 1",
                             f"routes shape={tuple(routes.shape)}: expected an array [rows, L, K] "
                             f"with K >= 1 (K = experts per token)")
        if routes.dtype == np.bool_:
            raise FieldError("routes.dtype", "bool", "an integer dtype (expert ids, not flags)",
                             "routes dtype=bool: expected an integer dtype (expert ids, not flags)")
        ids = self.moe_layer_ids
        if layers is not None:
            new = _layer_ids("layers", layers)
            if ids is not None and new != ids:
                raise ValueError(f"layers={list(new)}: expected moe_layer_ids={list(ids)} of this "
                                 f"trace (a chunk from different MoE layers)")
            ids = new
        if ids is not None and routes.shape[1] != len(ids):
            raise ValueError(f"routes shape={tuple(routes.shape)}: expected L = {len(ids)} "
                             f"(moe_layer_ids={list(ids)})")
        want = p - s + g - 1
        if routes.shape[0] != want:
            raise ValueError(f"routes has {routes.shape[0]} rows: expected prompt_len - prompt_start "
                             f"+ generated_len - 1 = {p} - {s} + {g} - 1 = {want}")
        runs = list(self.version_runs) or ([(0, -1)] if s else [])
        stamps = row_versions(p, s, g, versions)
        for j in np.flatnonzero(np.diff(stamps, prepend=np.int32(-2) if not runs else runs[-1][1])):
            runs.append((s + int(j), int(stamps[j])))
        return self.replace(moe_layer_ids=ids, rows=self.rows.append(routes, want, name="routes"),
                            version_runs=tuple(runs))

    def row_versions(self, token_count: int | None = None) -> np.ndarray:
        """``[prompt_start]`` int32 (or ``[token_count]``, -1 past the recorded rows): the weight version
        that produced each recorded row (-1: unknown)."""
        n = self.prompt_start if token_count is None else check_int("token_count", token_count, self.prompt_start)
        out = np.full(n, -1, np.int32)
        runs = self.version_runs
        for j, (first, version) in enumerate(runs):
            out[first:runs[j + 1][0] if j + 1 < len(runs) else self.prompt_start] = version
        return out

    def truncate(self, rows: int) -> "RoutedExpertTrace":
        """A new trace keeping the rows of tokens ``[0, rows)``: the conversation was re-rendered and
        differs from token ``rows`` on, so the next call asks for rows from there
        (``routed_experts_prompt_start = rows``)."""
        cut = self.rows.truncate(rows)
        return self.replace(rows=cut, version_runs=tuple(r for r in self.version_runs if r[0] < rows))

    def finalize(self, *, token_count: int, loss_mask: Any) -> tuple[np.ndarray, np.ndarray]:
        """Host-side: ``(routes [N, L, K], captured [N] bool)`` for a trajectory of N tokens.

        Rows ``[0, prompt_start)`` are the recorded ones (captured True); later rows are filled
        with ``0..K-1`` and captured False. Raises if a loss-active target lies after the first
        uncaptured position (``loss_mask[i] != 0`` for some ``i > prompt_start``, docs/design.md §4).
        """
        s = self.prompt_start
        n = check_int("token_count", token_count)
        if n < s:
            raise ValueError(f"token_count={n}: expected >= prompt_start={s} (rows recorded)")
        mask = np.asarray(loss_mask)
        if mask.shape != (n,):
            raise ValueError(f"loss_mask shape={mask.shape}: expected [N] = ({n},)")
        if mask.dtype != np.bool_ and not jnp.issubdtype(mask.dtype, jnp.number):  # np.: bf16 is no number
            raise ValueError(f"loss_mask dtype={mask.dtype}: expected bool or numeric")
        late = np.flatnonzero(mask[s + 1:])
        if late.size:
            i = s + 1 + int(late[0])
            raise ValueError(f"{_MISSING} {i}: rows exist for tokens [0, {s}) (prompt_start={s}); "
                             f"a loss-active target must be at index <= prompt_start")
        if not self.rows.chunks:
            raise ValueError("finalize: no routes recorded, so L and K are unknown; record at "
                             "least one engine call")
        dtype = self.rows.dtype
        _, num_layers, top_k = self.rows.chunks[0].shape
        fill = uncaptured_rows(n - s, num_layers, top_k, dtype)
        chunks = [np.asarray(c) for c in self.rows.chunks] + [fill]
        routes = np.concatenate(chunks, axis=0, dtype=dtype)
        return routes, np.arange(n) < s
