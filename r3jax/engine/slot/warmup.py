"""Ahead-of-time compilation of every device program an engine configuration can call.

The program set is the product of the engine's buckets (prefill rows x chunk x prompt bucket; insert
per rows x prompt bucket; decode per attention window; read-out per length; prefix-cache store), so
warm-up lowers each one at abstract arguments of exactly the shapes and placements the scheduler
passes, without running anything or touching the slots.
"""

from __future__ import annotations

import jax
import numpy as np

from r3jax.engine.slot import slots as dev


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compile_all(engine) -> int:
    """Compile every program of ``engine`` not compiled yet; returns how many programs it has."""
    e, put, cfg = engine, engine.placement.put, engine.config
    rep = e.placement.replicated
    i32 = lambda *shape: put(np.zeros(shape, np.int32))
    for rows in e._row_buckets:
        for sp in e._seq_buckets:
            n_blocks = rows * (sp // e.block_size)
            plan = (i32(n_blocks), i32(n_blocks), i32(n_blocks))
            args = ((e._prefix.pool,) if e._prefix.enabled else ()) + plan
            e.programs.get("begin", (rows, sp, e._prefix.capacity), lambda: e._build_begin(rows, sp), *args)
            cache_sh, _ = e._scratch_shardings(rows, sp)
            cache = _abstract(jax.eval_shape(lambda: dev.KVCache.init(cfg, rows, sp)), cache_sh)
            routes = jax.ShapeDtypeStruct((rows, sp, cfg.num_moe_layers, cfg.top_k), e.route_dtype, sharding=rep)
            logits = jax.ShapeDtypeStruct((rows, cfg.vocab_size), np.float32, sharding=rep)
            for t in e._chunk_buckets:
                if t > sp:
                    continue
                e.programs.get("prefill", (rows, t, sp), lambda: e._build_prefill(rows, sp), e._params, e._rest,
                               cache, routes, i32(rows, t), i32(rows, t), i32(rows), logits)
            new = jax.tree.map(put, e._slot_params([], rows))
            e.programs.get("first", rows, e._build_first, logits, new)
            first = jax.ShapeDtypeStruct((rows,), np.int32, sharding=rep)
            first_lp = jax.ShapeDtypeStruct((rows,), np.float32, sharding=rep)
            e.programs.get("insert", (rows, sp), e._build_insert, e._state, cache, routes, first, first_lp,
                           i32(rows), new)
    for n in e._live_buckets:
        for window in e._seq_buckets:
            e.programs.get("decode", (n, window), lambda: e._build_decode(n, window), e._params, e._rest, e._state,
                           i32(n))
    for length in e._read_buckets:
        e.programs.get("read", length, lambda: e._build_read(length), e._state, put(np.int32(0)),
                       put(np.int32(0)))
    if e._prefix.enabled:
        n = e.seq_len // e.block_size
        e.programs.get("store", e._prefix.capacity, e._build_store, e._prefix.pool, e._state.cache, e._state.routes,
                       i32(n), i32(n), i32(n))
    return len(e.programs)
