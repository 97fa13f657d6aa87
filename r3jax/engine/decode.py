"""The engine's device programs: buffer set-up, chunked prefill, the whole decode loop, route read-out.

Every function here is pure and meant to be jitted with the model's graphdef bound (``functools.partial``)
and the buffers donated. Layout of one batch of B rows over a cache of S slots:

- ``KVCache`` [B, S, Hkv, Dh] per layer and a route buffer ``routes [B, S, L, K]`` (compact dtype):
  slot j holds absolute position j of that row. A query at position p sees slots <= p, so rows of
  different lengths share one buffer with right padding.
- Slot ``S - 1`` is a trash slot: padding tokens and finished rows are fed there. The engine sizes S
  so that no real token is ever fed at S - 1 (``S >= P + max_tokens``; the last sampled token is never
  fed), hence nothing real ever reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models import KVCache, MoeConfig
from r3jax.engine.sampling import sample_tokens, token_logprobs


@struct.dataclass
class RowParams:
    """Per-row inputs of a decode batch. prompt_len, max_new, top_k [B] int32; live [B] bool (False for
    batch padding); temperature, top_p [B] f32; key_data [B, 2] uint32; stop_ids [B, NS] int32 (-1 pads).
    """

    prompt_len: jax.Array
    max_new: jax.Array
    live: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key_data: jax.Array
    stop_ids: jax.Array


@struct.dataclass
class DecodeState:
    """The while-loop carry. tokens / logprobs [B, S]: token g of a row at column g; last [B] the last
    sampled token (fed next at position prompt_len + n_gen - 1); n_gen [B] tokens sampled so far;
    done / stopped [B] bool; steps: loop iterations (model calls) run."""

    cache: KVCache
    routes: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    last: jax.Array
    n_gen: jax.Array
    done: jax.Array
    stopped: jax.Array
    steps: jax.Array


def init_buffers(cfg: MoeConfig, route_dtype, *, batch: int, seq_len: int) -> tuple[KVCache, jax.Array]:
    """Zeroed ``KVCache`` [B, S, ...] in the compute dtype and route buffer [B, S, L, K]."""
    routes = jnp.zeros((batch, seq_len, cfg.num_moe_layers, cfg.top_k), route_dtype)
    return KVCache.init(cfg, batch, seq_len), routes


def prefill_chunk(graphdef, params, rest, cache, routes, tokens, positions, last_index, logits, *, capture):
    """Feed one chunk of prompt tokens; keep the logits of each row's last prompt token.

    tokens, positions [B, T] int32 (padding: any token at position S - 1); last_index [B] int32: index
    in this chunk of the row's last prompt token, or -1; logits [B, V] f32: carried from earlier chunks.
    Returns ``(cache, routes, logits)``.
    """
    out = nnx.merge(graphdef, params, rest)(tokens, positions, cache=cache)
    if capture:
        rows = jnp.arange(tokens.shape[0])[:, None]
        routes = routes.at[rows, positions].set(out.routes.astype(routes.dtype))
    picked = jnp.take_along_axis(out.logits, jnp.maximum(last_index, 0)[:, None, None], axis=1)[:, 0]
    logits = jnp.where((last_index >= 0)[:, None], picked, logits)
    return out.cache, routes, logits


def decode(graphdef, params, rest, cache, routes, logits, rows: RowParams, *, capture) -> DecodeState:
    """Sample every row to completion in one ``lax.while_loop``.

    logits [B, V]: the prefill logits at each row's last prompt token. Each iteration feeds the last
    sampled token of every unfinished row at its position (records its route row there when capture),
    then samples the next one. A row finishes on a stop token or after max_new tokens; the loop ends
    when all rows have. Returns the final :class:`DecodeState`.
    """
    model = nnx.merge(graphdef, params, rest)
    b, s = routes.shape[:2]
    batch = jnp.arange(b)

    def is_stop(tok):
        return jnp.any(rows.stop_ids == tok[:, None], axis=-1)

    def sample(logits, index):
        tok = sample_tokens(logits, rows.key_data, index, rows.temperature, rows.top_k, rows.top_p)
        return tok, token_logprobs(logits, tok)

    first, first_lp = sample(logits, jnp.zeros((b,), jnp.int32))
    stopped = rows.live & is_stop(first)
    state = DecodeState(
        cache=cache, routes=routes,
        tokens=jnp.zeros((b, s), jnp.int32).at[:, 0].set(first),
        logprobs=jnp.zeros((b, s), jnp.float32).at[:, 0].set(first_lp),
        last=first, n_gen=jnp.ones((b,), jnp.int32),
        done=~rows.live | stopped | (rows.max_new <= 1), stopped=stopped,
        steps=jnp.zeros((), jnp.int32))

    def body(st: DecodeState) -> DecodeState:
        active = ~st.done
        pos = jnp.where(active, rows.prompt_len + st.n_gen - 1, s - 1)
        out = model(st.last[:, None], pos[:, None], cache=st.cache)
        new_routes = st.routes
        if capture:
            new_routes = new_routes.at[batch, pos].set(out.routes[:, 0].astype(new_routes.dtype))
        tok, lp = sample(out.logits[:, 0], st.n_gen)
        col = jnp.where(active, st.n_gen, s - 1)  # finished rows write to a scratch column
        n_gen = st.n_gen + active.astype(jnp.int32)
        stop = active & is_stop(tok)
        return DecodeState(
            cache=out.cache, routes=new_routes,
            tokens=st.tokens.at[batch, col].set(tok), logprobs=st.logprobs.at[batch, col].set(lp),
            last=jnp.where(active, tok, st.last), n_gen=n_gen,
            done=st.done | stop | (n_gen >= rows.max_new), stopped=st.stopped | stop,
            steps=st.steps + 1)

    return jax.lax.while_loop(lambda st: jnp.any(~st.done), body, state)


def read_routes(routes, start, *, length):
    """Rows ``[start_b, start_b + length)`` of each row's route buffer, shifted to 0 (clamped at S - 1).

    routes [B, S, L, K], start [B] int32 -> [B, length, L, K]. Only this window leaves the device.
    """
    idx = jnp.minimum(start[:, None] + jnp.arange(length), routes.shape[1] - 1)
    return jnp.take_along_axis(routes, idx[:, :, None, None], axis=1)
