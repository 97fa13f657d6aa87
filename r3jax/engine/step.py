"""The engine's one device program: a mixed step of decode tokens and prefill chunks over the page pool.

A step feeds ``N`` tokens laid out by a :class:`models.paged.RaggedLayout` (decode rows of one token,
then prefill rows of ``prefill_len`` tokens), writes their keys and values into their pages, attends
over each row's pages, samples one token for every row that asks (each decode row; a prefill row that
holds its prompt's last token) and stores it in ``last[slot]``, where the next step's decode row for
that request reads its input token. So the host never has to hand a sampled token back: it plans
step n + 1 while step n runs and reads step n's outputs (tokens, logprobs, route rows) afterwards.

Device state: the pool (``k``, ``v`` per layer group, :class:`models.paged.PagedCache`; ``v`` empty
for a combined GQA pool) and ``last`` [B] int32, both donated to every step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.paged import PagedCache, PagedMeta, RaggedLayout
from r3jax.engine.sampling import sample_with_logprobs


@struct.dataclass
class StepInputs:
    """One step's host-built inputs (N tokens, R = decode_rows + prefill_rows rows).

    tokens [N] int32 (prompt tokens; ignored where ``from_slot >= 0``); from_slot [N] int32: the request
    slot whose ``last`` token to feed (decode rows), else -1; positions, page, offset [N] int32; table [R,
    pages_per_row], kv_len [R] int32 (:class:`models.paged.PagedMeta`); sample_at [R] int32: index in N of
    the token whose logits give row r's next token; slot [R] int32: where that token goes in ``last`` (B:
    the row samples nothing); sampling parameters per row: key_data [R, 2] uint32, index [R] int32 (which
    generated token this is, 0 for the first), temperature, top_p [R] f32, top_k [R] int32, processed [R]
    bool."""

    tokens: jax.Array
    from_slot: jax.Array
    positions: jax.Array
    page: jax.Array
    offset: jax.Array
    table: jax.Array
    kv_len: jax.Array
    sample_at: jax.Array
    slot: jax.Array
    key_data: jax.Array
    index: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    processed: jax.Array


@functools.lru_cache(maxsize=64)  # asked on every step, for a handful of layouts
def input_spec(layout: RaggedLayout) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
    """(field, shape, dtype) of every :class:`StepInputs` field of a step of ``layout``, in field order."""
    n, r = layout.tokens, layout.rows
    shapes = dict(tokens=(n,), from_slot=(n,), positions=(n,), page=(n,), offset=(n,), table=(r, layout.pages_per_row),
                  kv_len=(r,), sample_at=(r,), slot=(r,), key_data=(r, 2), index=(r,), temperature=(r,), top_k=(r,),
                  top_p=(r,), processed=(r,))
    dtypes = dict(key_data=np.uint32, temperature=np.float32, top_p=np.float32, processed=np.bool_)
    return tuple((f.name, shapes[f.name], np.dtype(dtypes.get(f.name, np.int32))) for f in dataclasses.fields(StepInputs))


def pack(x: dict[str, np.ndarray], layout: RaggedLayout) -> np.ndarray:
    """Host side: a step's inputs as one int32 vector (32-bit fields by their bits, bools as 0/1), so a
    step hands the device one array instead of fifteen (each transfer has a fixed cost)."""
    parts = []
    for name, shape, dtype in input_spec(layout):
        a = np.asarray(x[name], dtype).reshape(-1)
        parts.append(a.astype(np.int32) if dtype == np.bool_ else a.view(np.int32))
    return np.concatenate(parts)


def unpack(packed: jax.Array, layout: RaggedLayout) -> StepInputs:
    """Device side: the inverse of :func:`pack` (static slices and bitcasts)."""
    out, at = {}, 0
    for name, shape, dtype in input_spec(layout):
        size = int(np.prod(shape))
        a = packed[at:at + size].reshape(shape)
        at += size
        out[name] = a != 0 if dtype == np.bool_ else (a if dtype == np.int32 else jax.lax.bitcast_convert_type(a, dtype))
    return StepInputs(**out)


def packed_size(layout: RaggedLayout) -> int:
    return sum(int(np.prod(shape)) for _, shape, _ in input_spec(layout))


def step(graphdef, params, rest, k, v, last, x: StepInputs, *, layout: RaggedLayout, head_only: bool, route_dtype):
    """Run one mixed step (``x``: the inputs, or them packed by :func:`pack`). Returns ``(k, v, last,
    tokens [R] int32, logprobs [R] f32, routes [N, L, K])`` (routes in ``route_dtype``)."""
    model = nnx.merge(graphdef, params, rest)
    if not isinstance(x, StepInputs):  # the packed int32 vector (:func:`pack`)
        x = unpack(x, layout)
    tokens = jnp.where(x.from_slot >= 0, last[jnp.maximum(x.from_slot, 0)], x.tokens)
    cache = PagedCache(k=k, v=v, meta=PagedMeta(x.table, x.page, x.offset, x.kv_len, layout))
    kw = {"return_hidden": True} if head_only else {}
    out = model(tokens[None], x.positions[None], cache=cache, **kw)
    if head_only:
        logits = model.logits(out.hidden[0][x.sample_at])
    else:
        logits = out.logits[0][x.sample_at]
    tok, lp = sample_with_logprobs(logits, x.key_data, x.index, x.temperature, x.top_k, x.top_p, x.processed)
    last = last.at[x.slot].set(tok, mode="drop")
    return out.cache.k, out.cache.v, last, tok, lp, out.routes[0].astype(route_dtype)


def decode_loop(graphdef, params, rest, k, v, last, x, extra, *, layout: RaggedLayout, steps: int, page_size: int,
                head_only: bool, route_dtype, route_shape: tuple[int, int]):
    """``steps`` decode steps of every decode row in one call (``layout.prefill_rows == 0``), so the
    host's per-call cost is paid once for ``steps`` tokens per request.

    ``x``: the first step's inputs as for :func:`step` (each row's position, its page table covering
    every position the call may feed, its first token's sampling index). ``extra`` [R, 1 + S] int32:
    row r's ``budget`` (steps it may run: at most ``steps``, fewer near its max_tokens; 0 for padding)
    then its S stop token ids (-1 padded). Step i feeds ``last[slot]`` at position ``positions + i`` and
    samples token ``index + i``; a row that samples a stop token, or has run its budget, stops there:
    later steps write its keys to the trash page and leave its ``last`` alone. Returns ``(k, v, last,
    tokens [steps, R] int32, logprobs [steps, R] f32, routes [steps, R, L, K])`` (``route_shape`` = (L, K));
    entries of a stopped row are left over from the loop and read by nobody (the host stops at the same
    token). The loop ends as soon as no row is active: a call whose rows all stop or run out of budget
    early costs only the steps they ran."""
    if layout.prefill_rows:
        raise ValueError(f"decode_loop runs decode rows only: {layout}")
    model = nnx.merge(graphdef, params, rest)
    if not isinstance(x, StepInputs):
        x = unpack(x, layout)
    budget, stop = extra[:, 0], extra[:, 1:]
    r = layout.decode_rows
    rows = jnp.arange(r)
    slots = last.shape[0]

    def running(carry):
        i, alive = carry[0], carry[4]
        return (i < steps) & jnp.any(alive & (i < budget))

    def body(carry):
        i, k, v, last, alive, toks, lps, routes = carry
        active = alive & (i < budget)
        pos = x.positions + i
        col = jnp.minimum(pos // page_size, layout.pages_per_row - 1)
        meta = PagedMeta(x.table, jnp.where(active, x.table[rows, col], 0), jnp.where(active, pos % page_size, 0),
                         jnp.where(active, pos + 1, 1), layout)
        tokens = jnp.where(x.from_slot >= 0, last[jnp.maximum(x.from_slot, 0)], x.tokens)
        kw = {"return_hidden": True} if head_only else {}
        out = model(tokens[None], jnp.where(active, pos, x.positions)[None], cache=PagedCache(k=k, v=v, meta=meta),
                    **kw)
        logits = model.logits(out.hidden[0]) if head_only else out.logits[0]
        tok, lp = sample_with_logprobs(logits, x.key_data, x.index + i, x.temperature, x.top_k, x.top_p, x.processed)
        last = last.at[jnp.where(active, x.slot, slots)].set(tok, mode="drop")
        alive = alive & ~(active & (stop == tok[:, None]).any(-1))
        return (i + 1, out.cache.k, out.cache.v, last, alive, toks.at[i].set(tok), lps.at[i].set(lp),
                routes.at[i].set(out.routes[0].astype(route_dtype)))

    init = (jnp.int32(0), k, v, last, budget > 0, jnp.zeros((steps, r), jnp.int32),
            jnp.zeros((steps, r), jnp.float32), jnp.zeros((steps, r, *route_shape), route_dtype))
    _, k, v, last, _, toks, lps, routes = jax.lax.while_loop(running, body, init)
    return k, v, last, toks, lps, routes
