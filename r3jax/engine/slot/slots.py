"""The engine's device programs over a fixed set of decode slots.

Every function here is pure, jitted with the model's graphdef bound, and donates the buffers it
updates. Layout (B slots, S = cache length, L MoE layers, K experts per token):

- ``SlotState.cache``: ``KVCache`` [n, B, S, Hc, Dc] per run of n layers (models/cache.py); ``routes``
  [B, S, L, K] compact dtype.
  Position j of the request in slot b lives at ``[b, j]``: a query at position p reads ``<= p``, so
  whatever a previous request left past a slot's length is never read.
- ``tokens`` / ``logprobs`` [B, S]: token g of the slot's request at column g.
- Per-slot sampling state: ``last`` (the token to feed next, at position ``prompt_len + n_gen - 1``),
  ``n_gen``, ``done``, ``stopped`` and the request's parameters (:class:`SlotParams`).

Prefill runs on a scratch cache [N, Sp] (Sp a bucket of the prompt length; prefix-cache blocks are
loaded into it first), then :func:`sample_first` samples each row's first token and :func:`insert`
copies the scratch rows into their slots. :func:`decode` advances every live slot by up to ``steps``
tokens on a compact copy of the live slots (a bucket of their count), attending over only the first
``window`` positions (a bucket of the longest live slot). Position ``window - 1`` (``Sp - 1``
in prefill) is the trash position: padding and idle slots are fed there, and the host picks buckets so
that no real token is ever fed at it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models import KVCache, MoeConfig
from r3jax.engine.sampling import sample_with_logprobs


@struct.dataclass
class SlotParams:
    """Sampling parameters of each slot's request. prompt_len, max_new, top_k [B] int32; temperature,
    top_p [B] f32; key_data [B, 2] uint32; stop_ids [B, NS] int32 (-1 pads); processed [B] bool
    (``logprobs_mode="processed_logprobs"``: logprobs under the sampled distribution, else raw)."""

    prompt_len: jax.Array
    max_new: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key_data: jax.Array
    stop_ids: jax.Array
    processed: jax.Array


@struct.dataclass
class SlotState:
    """Everything the decode slots hold on device (see the module docstring). last, n_gen [B] int32;
    done, stopped [B] bool (a free slot is done)."""

    cache: KVCache
    routes: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    last: jax.Array
    n_gen: jax.Array
    done: jax.Array
    stopped: jax.Array
    params: SlotParams


def init_state(cfg: MoeConfig, route_dtype, *, slots: int, seq_len: int, stop_width: int) -> SlotState:
    """All slots free; zeroed buffers."""
    b, s = slots, seq_len
    i32 = lambda fill=0: jnp.full((b,), fill, jnp.int32)
    params = SlotParams(prompt_len=i32(1), max_new=i32(1), temperature=jnp.zeros((b,), jnp.float32),
                        top_k=i32(), top_p=jnp.ones((b,), jnp.float32), key_data=jnp.zeros((b, 2), jnp.uint32),
                        stop_ids=jnp.full((b, stop_width), -1, jnp.int32), processed=jnp.zeros((b,), bool))
    return SlotState(cache=KVCache.init(cfg, b, s),
                     routes=jnp.zeros((b, s, cfg.num_moe_layers, cfg.top_k), route_dtype),
                     tokens=jnp.zeros((b, s), jnp.int32), logprobs=jnp.zeros((b, s), jnp.float32),
                     last=i32(), n_gen=i32(), done=jnp.ones((b,), bool), stopped=jnp.zeros((b,), bool),
                     params=params)


# ---- prefill ---------------------------------------------------------------------------------
def begin_prefill(cfg: MoeConfig, route_dtype, pool, row, blk, slot, *, rows: int, seq_len: int):
    """A scratch ``(cache [N, Sp], routes [N, Sp, L, K])`` with prefix-cache blocks loaded:
    block ``blk[n]`` of row ``row[n]`` <- ``pool[slot[n]]`` (row == N: padding, dropped). pool may be
    None (prefix cache off)."""
    from r3jax.engine.slot.prefix_cache import load_blocks

    cache = KVCache.init(cfg, rows, seq_len)
    routes = jnp.zeros((rows, seq_len, cfg.num_moe_layers, cfg.top_k), route_dtype)
    if pool is None:
        return cache, routes
    return load_blocks(pool, cache, routes, row, blk, slot)


def prefill_chunk(graphdef, params, rest, cache, routes, tokens, positions, last_index, logits, *,
                  head_only: bool = False):
    """Feed one chunk of prompt tokens into the scratch; keep the logits of each row's last prompt token.

    tokens, positions [N, T] int32 (padding: any token at position Sp - 1); last_index [N] int32: index
    in this chunk of the row's last prompt token, or -1; logits [N, V] f32 carried from earlier chunks.
    ``head_only`` (static; a model with ``logits(hidden)``, r3jax/train/model_protocol.py): the model
    returns hidden states and the LM head runs on the one picked position per row ([N, V], not
    [N, T, V]). Returns ``(cache, routes, logits)``.
    """
    model = nnx.merge(graphdef, params, rest)
    kw = {"return_hidden": True} if head_only else {}
    out = model(tokens, positions, cache=cache, **kw)
    rows = jnp.arange(tokens.shape[0])[:, None]
    routes = routes.at[rows, positions].set(out.routes.astype(routes.dtype))
    at = jnp.maximum(last_index, 0)[:, None, None]
    if head_only:
        picked = model.logits(jnp.take_along_axis(out.hidden, at, axis=1)[:, 0])
    else:
        picked = jnp.take_along_axis(out.logits, at, axis=1)[:, 0]
    logits = jnp.where((last_index >= 0)[:, None], picked, logits)
    return out.cache, routes, logits


def _is_stop(stop_ids, tok):
    return jnp.any(stop_ids == tok[:, None], axis=-1)


def sample_first(logits, new: SlotParams):
    """The first token of each prefilled row from its last prompt token's logits [N, V]:
    ``(tokens [N] int32, logprobs [N] f32)``."""
    return sample_with_logprobs(logits, new.key_data, jnp.zeros_like(new.prompt_len), new.temperature, new.top_k,
                                new.top_p, new.processed)


def insert(state: SlotState, cache: KVCache, routes, first, first_lp, slot, new: SlotParams) -> SlotState:
    """Copy scratch row n (``cache``/``routes`` [N, Sp]) into slot ``slot[n]`` (== B: padding, dropped),
    set its parameters ``new`` ([N] each) and its first token ``first`` [N] (logprob ``first_lp``)."""
    sp = routes.shape[1]
    put = lambda dst, src: dst.at[slot, :sp].set(src.astype(dst.dtype), mode="drop")
    put_kv = lambda dst, src: dst.at[:, slot, :sp].set(src.astype(dst.dtype), mode="drop")  # [n, B, S, ...]
    kv = jax.tree.map(put_kv, state.cache, cache)
    stopped = _is_stop(new.stop_ids, first)
    at = lambda dst, val: dst.at[slot].set(val, mode="drop")
    params = jax.tree.map(at, state.params, new)
    return SlotState(cache=kv, routes=put(state.routes, routes),
                     tokens=state.tokens.at[slot, 0].set(first, mode="drop"),
                     logprobs=state.logprobs.at[slot, 0].set(first_lp, mode="drop"),
                     last=at(state.last, first), n_gen=at(state.n_gen, jnp.ones_like(first)),
                     done=at(state.done, stopped | (new.max_new <= 1)), stopped=at(state.stopped, stopped),
                     params=params)


# ---- decode ----------------------------------------------------------------------------------
def decode(graphdef, params, rest, state: SlotState, idx, *, steps: int, window: int,
           view_sharding=None) -> SlotState:
    """Advance the slots ``idx`` [n] int32 (every live slot; == B: padding) by up to ``steps`` tokens,
    in a ``lax.while_loop`` that stops early once all of them are done. With n == B, ``idx[s]`` must be
    s for a live slot and B otherwise (the in-place form).

    The loop runs on a compact copy of those n slots (the model sees [n, ...], so the cost follows the
    live slots, not B) and attends over positions ``[0, window)`` only; the copy is written back at the
    end. The host guarantees every live slot stays below ``window - 1``, the trash position.
    ``view_sharding``: the copy's sharding (rows along ``data`` like the slots); without it XLA may
    replicate the gathered copy, i.e. hold every slot's cache window on every device.
    """
    model = nnx.merge(graphdef, params, rest)
    b, s = state.tokens.shape
    valid = idx < b
    # n == B: the slots in place (idx[s] is s, or B where slot s is not live), so the cache window is a
    # slice that stays split over data like the slots. n < B: a gathered compact copy of the live rows.
    in_place = idx.shape[0] == b
    row = jnp.arange(b) if in_place else jnp.minimum(idx, b - 1)  # padding rows' writes are dropped
    p = jax.tree.map(lambda x: x[row], state.params)
    trash = window - 1
    if in_place:
        view = jax.tree.map(lambda x: x[:, :, :window], state.cache)
    else:
        view = jax.tree.map(lambda x: x[:, row, :window], state.cache)  # [n, B, S, ...] -> [n, rows, window, ...]
    if view_sharding is not None:
        view = jax.lax.with_sharding_constraint(view, jax.tree.map(lambda _: view_sharding, view))
    carry = (0, state.last[row], state.n_gen[row], state.done[row] | ~valid, state.stopped[row],
             state.tokens, state.logprobs, state.routes, view)

    def body(c):
        i, last, n_gen, done, stopped, tokens, logprobs, routes, cache = c
        active = ~done
        pos = jnp.where(active, p.prompt_len + n_gen - 1, trash)
        out = model(last[:, None], pos[:, None], cache=cache)
        at = jnp.where(active, idx, b)  # finished and padding rows write nothing
        routes = routes.at[at, pos].set(out.routes[:, 0].astype(routes.dtype), mode="drop")
        logits = out.logits[:, 0]
        tok, lp = sample_with_logprobs(logits, p.key_data, n_gen, p.temperature, p.top_k, p.top_p, p.processed)
        tokens = tokens.at[at, n_gen].set(tok, mode="drop")
        logprobs = logprobs.at[at, n_gen].set(lp, mode="drop")
        n_gen = n_gen + active.astype(jnp.int32)
        stop = active & _is_stop(p.stop_ids, tok)
        return (i + 1, jnp.where(active, tok, last), n_gen, done | stop | (n_gen >= p.max_new), stopped | stop,
                tokens, logprobs, routes, out.cache)

    _, last, n_gen, done, stopped, tokens, logprobs, routes, view = jax.lax.while_loop(
        lambda c: (c[0] < steps) & jnp.any(~c[3]), body, carry)
    back = lambda full, part: full.at[idx].set(part, mode="drop")
    if in_place:  # non-live rows only ever wrote their trash position, which nothing reads
        cache = jax.tree.map(lambda full, part: full.at[:, :, :window].set(part), state.cache, view)
    else:
        cache = jax.tree.map(lambda full, part: full.at[:, idx, :window].set(part, mode="drop"), state.cache, view)
    return state.replace(cache=cache, routes=routes, tokens=tokens, logprobs=logprobs, last=back(state.last, last),
                         n_gen=back(state.n_gen, n_gen), done=back(state.done, done),
                         stopped=back(state.stopped, stopped))


def progress(state: SlotState):
    """What the host needs after each decode call: ``(n_gen [B] int32, done [B] bool)``."""
    return state.n_gen, state.done


# ---- read-out --------------------------------------------------------------------------------
def read_slot(state: SlotState, slot, start, *, length: int):
    """One slot's output: ``(tokens [S] int32, logprobs [S] f32, stopped bool, routes [length, L, K])``,
    the route rows ``[start, start + length)`` of that slot (clamped at S - 1). Only this leaves the device."""
    s = state.routes.shape[1]
    idx = jnp.minimum(start + jnp.arange(length), s - 1)
    return state.tokens[slot], state.logprobs[slot], state.stopped[slot], state.routes[slot][idx]
