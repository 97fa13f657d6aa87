"""The engine's device side: the step layouts its configuration allows, their compiled programs
(:class:`r3jax.engine.programs.Programs`), warm-up, and one call of one.

:class:`DeviceSide` is a base of :class:`r3jax.engine.Engine` and reads the attributes its ``__init__``
sets (placement, buckets, pool shape, graphdef, parameters); the scheduler thread alone calls it.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from models.paged import PagedCache, RaggedLayout
from r3jax.engine import step as dev
from r3jax.engine.programs import bucket, fill


class DeviceSide:
    def layouts(self) -> list[RaggedLayout]:
        """Every step layout this engine can run (one program each)."""
        return [self.layout(d, p) for d in self._decode_buckets for p in self._prefill_buckets
                if p == 0 or d in self._mixed_buckets]

    def prefill_rows_for(self, ready: int, prompts: int) -> int:
        """Prefill rows the next step takes when ``ready`` chunks of ``prompts`` prompts wait: up to 4
        (``prefill_rows`` if fewer), more only when that many prompts wait, as many as
        :func:`r3jax.engine.programs.fill` gives them. So one long prompt, or a few, is prefilled in
        steps of 4 rows that keep the requests decoding beside it at their pace; a batch of prompts
        submitted at once (a GRPO step) in steps of up to ``prefill_rows``."""
        return min(ready, max(min(4, self.prefill_rows), fill(prompts, self._prefill_buckets)))

    def layout(self, decode_rows: int, prefill_rows: int) -> RaggedLayout:
        rows = self._mixed_buckets if prefill_rows > 0 else self._decode_buckets
        return RaggedLayout(decode_rows=bucket(max(decode_rows, 1), rows),
                            prefill_rows=bucket(prefill_rows, self._prefill_buckets), prefill_len=self.prefill_chunk,
                            pages_per_row=self._pages_per_row, block_pages=self._block_pages)

    def step_program(self, decode_rows: int | None = None, prefill_rows: int = 0):
        """The compiled program of the layout that serves ``decode_rows`` decode rows (default
        ``max_batch_size``) and ``prefill_rows`` prefill rows (with ``decode_steps`` > 1 and no prefill
        row: the ``decode_steps``-step decode loop): a ``jax.stages.Compiled`` whose ``as_text()``,
        ``cost_analysis()`` and ``memory_analysis()`` show what one call does. Compiled on first use,
        like every program (by the scheduler thread, between steps)."""
        lay = self.layout(self.max_batch_size if decode_rows is None else decode_rows, prefill_rows)
        return self._sched.control(lambda: self._program(lay, self._abstract_args(lay)), drain=False, abort=None)

    def steps_of(self, lay: RaggedLayout) -> int:
        """Decode steps one call of ``lay`` runs: ``decode_steps`` for a decode-only layout, else 1."""
        return self.decode_steps if lay.prefill_rows == 0 else 1

    def _program(self, lay: RaggedLayout, args: tuple):
        if self.steps_of(lay) > 1:
            return self.programs.get("decode", (lay, self.decode_steps, self.max_stop_tokens),
                                     lambda: self._build(lay, True), *args)
        return self.programs.get("step", lay, lambda: self._build(lay, False), *args)

    def _warmup(self) -> dict:
        t0, before, built = time.perf_counter(), len(self.programs), self.programs.compiles
        disk = self.programs._disk
        from_disk = 0 if disk is None else disk.loaded
        hits = []

        def count(event: str, **_):  # JAX's persistent compilation cache reports each hit
            if event == "/jax/compilation_cache/cache_hits":
                hits.append(1)

        jax.monitoring.register_event_listener(count)
        try:
            for lay in self.layouts():
                self._program(lay, self._abstract_args(lay))
        finally:
            jax.monitoring.unregister_event_listener(count)
        self._sched.warmed = True
        seconds = time.perf_counter() - t0
        self._counters["warmup_s"] += seconds
        built = self.programs.compiles - built
        loaded = min(len(hits) + (0 if disk is None else disk.loaded - from_disk), built)
        return {"programs": len(self.programs), "new": len(self.programs) - before, "seconds": seconds,
                "loaded": loaded, "compiled": built - loaded}

    def _init_state(self) -> None:
        """A zeroed pool and ``last`` tokens, on the placement (no program of ours: jnp.zeros on device)."""
        kv = self.placement.kv()  # [n, P, ps, Hc, Dc]: heads along tensor, pages whole
        k, v = jax.eval_shape(lambda: PagedCache.init_pool(self.config, self.num_pages, self.block_size, bits=self._bits))
        zeros = lambda a: jax.device_put(np.zeros(a.shape, a.dtype), kv)
        self._k, self._v = tuple(map(zeros, k)), tuple(map(zeros, v))
        self._last = self.placement.put(np.zeros((self.max_batch_size,), np.int32))

    def _abstract_args(self, lay: RaggedLayout) -> tuple:
        """A call's arguments with its inputs abstract: the packed vector (:func:`r3jax.engine.step.pack`)
        and, for the decode loop, ``extra`` [R, 1 + max_stop_tokens] (budgets and stop ids), replicated."""
        rep = self.placement.replicated
        x = jax.ShapeDtypeStruct((dev.packed_size(lay),), np.int32, sharding=rep)
        extra = jax.ShapeDtypeStruct((lay.rows, 1 + self.max_stop_tokens), np.int32, sharding=rep)
        return self._params, self._rest, self._k, self._v, self._last, x, *((extra,) if self.steps_of(lay) > 1 else ())

    def _build(self, lay: RaggedLayout, loop: bool):
        common = dict(layout=lay, head_only=self._head_only, route_dtype=self.route_dtype)
        if loop:
            fn = functools.partial(dev.decode_loop, self._graphdef, steps=self.decode_steps, page_size=self.block_size,
                                   route_shape=(self.config.num_moe_layers, self.config.top_k), **common)
        else:
            fn = functools.partial(dev.step, self._graphdef, **common)
        mesh = self.placement.mesh
        if mesh is not None:  # traced under the mesh: attention picks its kernel by the mesh's devices
            inner = fn

            def fn(*args):
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    return inner(*args)
        rep = self.placement.replicated
        kv = self.placement.kv()
        out = (tuple(kv for _ in self._k), tuple(kv for _ in self._v), rep, rep, rep, rep)
        return fn, {"donate_argnums": (2, 3, 4), "out_shardings": out}

    def dispatch(self, lay: RaggedLayout, x: dict[str, np.ndarray], extra: np.ndarray | None = None):
        """Enqueue one call (a mixed step, or with ``extra`` the decode loop); returns its outputs
        ``(tokens, logprobs, routes)`` as device arrays whose host copies have been started."""
        args = (self._params, self._rest, self._k, self._v, self._last, self.placement.put(dev.pack(x, lay)))
        if extra is not None:
            args += (self.placement.put(extra),)
        exe = self._program(lay, args)
        self._k, self._v, self._last, tok, lp, routes = exe(*args)
        for a in (tok, lp, routes):
            a.copy_to_host_async()
        return tok, lp, routes


    def reset_state(self) -> None:
        """A fresh pool (after a failed step left a donated buffer unusable); cached prefixes dropped."""
        self._init_state()
        self.pool.reset(self.weight_version)
