"""The previous rollout engine, kept for comparisons (experiments/ measure the paged engine beside it):
continuous batching over fixed decode slots that each reserve a contiguous ``max_seq_len`` KV cache,
a prefix cache copied into and out of slots, and admission that prefills everything waiting before
the next decode call. :class:`r3jax.engine.Engine` replaced it.

The public surface is :class:`Engine` (``submit`` / ``submit_async`` / ``generate`` / ``set_weights``
/ ``warmup``); the scheduling loop lives in :mod:`r3jax.engine.slot.scheduler`, the device programs in
:mod:`r3jax.engine.slot.slots`, shape buckets and the program registry in :mod:`r3jax.engine.programs`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from models import MoeConfig, MoeTransformer
from models.attention import resolve_impl
from models.routers import RouterBias
from models.weights import split_weights
from r3jax.checks import FieldError, check_int
from r3jax.engine.slot import slots as dev
from r3jax.engine.slot.prefix_cache import PrefixCache, init_pool, store_blocks
from r3jax.engine.programs import Programs, bucket, buckets, pow2_at_most, round_up
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.engine.sampling import seed_words
from r3jax.engine.slot.scheduler import Job, Scheduler
from r3jax.engine.engine import _check_like
from r3jax.engine.sharding import Placement
from r3jax.routes import route_dtype

_LOGITS_BYTES = 256 << 20  # most prefill logits [N, T, V] f32 held at once (a model without logits(hidden))
_SCORES_BYTES = 1 << 30  # most prefill attention scores [N, H, T, S] f32 held at once
# moe_impl=None on CPU: runs each chosen expert on only the tokens that chose it, the fastest
# decode kernel measured there (experiments/bench_decode.py); every MoeConfig accepts it
CPU_MOE_IMPL = "gather"


class SlotEngine:
    """Continuous-batching generation over a :class:`models.MoeTransformer` that records routes.

    ``max_batch_size`` decode slots live on device (KV cache, route buffer, sampling state). A
    scheduler thread admits waiting requests into free slots (chunked prefill, prefix-cache blocks
    first), advances every live slot ``decode_steps`` tokens per device call, and hands back each
    request as soon as it finishes (its slot is reused at once). The set of device programs is fixed by
    this configuration; :meth:`warmup` compiles all of them and ``stats["compiled_programs"]`` never
    changes afterwards.

    Args:
      model: the model; its parameters are copied (a trainer may donate or update its own).
      max_seq_len: longest prompt + max_tokens accepted.
      max_batch_size: decode slots.
      prefix_cache_bytes: device memory for the prefix cache (KV + route rows); 0 turns it off.
      dtype: compute dtype override (e.g. bf16 rollouts of an fp32 model); None keeps the model's.
      moe_impl: expert kernel of the engine's programs; None picks "gather" on CPU (the fastest
        measured there, experiments/bench_decode.py) and keeps the model's elsewhere.
      block_size: tokens per prefix-cache block (the cache length is a multiple of it).
      prefill_chunk: most prompt tokens fed per prefill call (longer prompts take several calls).
      min_prefill_chunk: smallest prefill chunk bucket (chunks are powers of two in between; fewer
        buckets, fewer programs to compile).
      prefill_rows: most requests prefilled together (default min(max_batch_size, 8)).
      min_seq_bucket: smallest prompt / attention-window bucket.
      decode_steps: tokens per slot per decode call (amortises the host round trip).
      max_stop_tokens: most stop token ids per request.
      mesh: a device mesh with axes among (data, tensor, expert) (:mod:`r3jax.engine.sharding`).
      static: admit requests only when every slot is free (the old static-batch behaviour, kept for
        comparisons).
      seed: seeds the draws of per-request seeds for requests with ``seed=None``.
      allow_replication: accept (with one warning naming the multiplier) arrays that a mesh axis
        cannot split, e.g. 2 kv heads on tensor = 8 (an 8x KV cache); by default that raises
        :class:`models.axes.ReplicationError`.
    """

    def __init__(self, model: MoeTransformer, *, max_seq_len: int, max_batch_size: int,
                 prefix_cache_bytes: int = 64 << 20, dtype=None, moe_impl: str | None = None,
                 block_size: int = 16, prefill_chunk: int = 256, min_prefill_chunk: int = 64,
                 prefill_rows: int | None = None,
                 min_seq_bucket: int = 64, decode_steps: int = 8, max_stop_tokens: int = 64, mesh=None,
                 static: bool = False, seed: int | None = None, allow_replication: bool = False):
        if prefill_rows is None and isinstance(max_batch_size, int) and not isinstance(max_batch_size, bool):
            prefill_rows = min(max_batch_size, 8)
        for name, value, lo in [("max_seq_len", max_seq_len, 2), ("max_batch_size", max_batch_size, 1),
                                ("prefix_cache_bytes", prefix_cache_bytes, 0), ("block_size", block_size, 1),
                                ("prefill_chunk", prefill_chunk, 1), ("min_prefill_chunk", min_prefill_chunk, 1),
                                ("prefill_rows", prefill_rows, 1),
                                ("min_seq_bucket", min_seq_bucket, 1), ("decode_steps", decode_steps, 1),
                                ("max_stop_tokens", max_stop_tokens, 1)]:
            try:
                check_int(name, value, lo=lo)
            except FieldError as e:
                raise FieldError(e.field, value, e.expected, f"Engine {e.message}") from None
        _check_model_config(model)
        own = isinstance(model, MoeTransformer)  # only a MoeTransformer can be rebuilt with overrides
        if moe_impl is None and own and jax.default_backend() == "cpu":
            moe_impl = CPU_MOE_IMPL
        overrides = {k: v for k, v in (("dtype", dtype), ("moe_impl", moe_impl)) if v is not None}
        overrides = {k: v for k, v in overrides.items() if v != getattr(model.config, k)}
        if overrides and not own:
            name = next(iter(overrides))
            raise FieldError(name, overrides[name], f"None or model.config.{name} for a {type(model).__name__}",
                             f"Engine {name}={overrides[name]!r}: expected None or model.config.{name} for a "
                             f"{type(model).__name__} (only a MoeTransformer is rebuilt with another {name})")
        cfg = model.config.replace(**overrides)  # MoeConfig validates moe_impl
        self.config = cfg
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.block_size, self.prefill_chunk, self.min_seq_bucket = block_size, prefill_chunk, min_seq_bucket
        self.decode_steps, self.max_stop_tokens, self.static = decode_steps, max_stop_tokens, bool(static)
        self.route_dtype = route_dtype(cfg.num_experts)
        self.weight_version = 0
        self.placement = Placement(mesh, cfg, allow_replication=allow_replication)

        # shapes: every bucket is fixed here, so the set of programs is too
        self.seq_len = round_up(max_seq_len, block_size)  # S > every fed position (the last is P + G - 2)
        lo = pow2_at_most(max(1, min(min_seq_bucket, self.seq_len)))
        # prompt buckets (Sp) and attention windows: whole prefix-cache blocks, at most S
        self._seq_buckets = sorted({min(round_up(b, block_size), self.seq_len) for b in buckets(lo, self.seq_len)})
        self._row_buckets = sorted({1, min(prefill_rows, max_batch_size)})
        # a model with logits(hidden) gets the LM head at the last prompt token only (slots.prefill_chunk)
        self._head_only = callable(getattr(model, "logits", None))
        t_hi = prefill_chunk_limit(cfg, max(self._row_buckets), self.seq_len, prefill_chunk,
                                   head_only=self._head_only)
        self._chunk_buckets = buckets(min(pow2_at_most(min_prefill_chunk), t_hi), t_hi)
        self._read_buckets = buckets(min(16, lo), self.seq_len)
        # live-slot counts a decode program is compiled for: B, B/2, B/4, B/8 (>= 1)
        self._live_buckets = sorted({max(1, max_batch_size >> i) for i in range(4)})

        _, params, rest = nnx.split(model, nnx.Param, ...)
        if overrides:  # same parameter tree, programs traced with the overridden config
            model = nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, _, _ = nnx.split(model, nnx.Param, ...)
        self._graphdef = graphdef
        self._params = self.placement.params(params)
        self._rest = jax.tree.map(lambda x: self.placement.put(np.asarray(x)), rest)
        self._prefix = PrefixCache(cfg, self.route_dtype, block_size=block_size, budget_bytes=prefix_cache_bytes)
        # what every program's shapes depend on (the pool capacity goes into the prefix programs' buckets)
        key = (graphdef, cfg, self.route_dtype.name, max_batch_size, self.seq_len, max_stop_tokens, decode_steps,
               block_size, mesh)
        self.programs = Programs(key)
        self._counters = dict(requests=0, prefill_calls=0, prefill_tokens=0, cached_tokens=0,
                              padded_prefill_tokens=0, generated_tokens=0, decode_calls=0, decode_slot_steps=0,
                              max_live_slots=0, cancelled=0, aborted=0, failed=0, route_gather_s=0.0, route_rows=0,
                              warmup_s=0.0)
        self._ttft: list[float] = []
        self._rng = np.random.default_rng(seed)
        self._state = self._init_state()
        if self._prefix.enabled:
            self._prefix.pool = self._init_pool()
        self._sched = Scheduler(self)

    # ---- public ------------------------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.config.moe_layer_ids

    @property
    def warmed_up(self) -> bool:
        return self._sched.warmed

    @property
    def failure(self) -> str | None:
        """Why this engine serves no more requests (its scheduler could not recover from a device
        failure), or None while it serves. Once set, ``submit`` raises :class:`EngineFailedError`."""
        return self._sched.failure

    @property
    def stats(self) -> dict:
        """Counters since construction. prefill_tokens: prompt tokens run through the model;
        cached_tokens: prompt tokens whose KV and routes came from the prefix cache; decode_calls:
        device calls of the decode program; compiled_programs: distinct device programs this engine
        has compiled (fixed after :meth:`warmup`); route_gather_s / route_rows: seconds spent reading
        route rows off the device and rows read; ttft_p50_s / ttft_p99_s: submit -> first token over
        the last 1024 requests; failed: requests that ended with an error other than an abort (their
        own, or a failed device step they were in); failure: :attr:`failure`."""
        ttft = np.asarray(self._ttft[-1024:]) if self._ttft else None
        return {**self._counters, "compiled_programs": len(self.programs),
                "live_slots": self._sched.live, "queued": self._sched.queued,
                "prefix_cache_blocks": self._prefix.num_blocks,
                "prefix_cache_capacity_blocks": self._prefix.capacity,
                "prefix_cache_block_bytes": self._prefix.block_bytes,
                "prefix_cache_evictions": self._prefix.evictions,
                "ttft_p50_s": None if ttft is None else float(np.percentile(ttft, 50)),
                "ttft_p99_s": None if ttft is None else float(np.percentile(ttft, 99)),
                "failure": self.failure}

    def recent_ttft(self, n: int = 1024) -> list[float]:
        """Seconds from submit to first token (sampled at admission) of the last ``n`` admitted requests."""
        return list(self._ttft[-n:])

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Queue one request; returns a ``concurrent.futures.Future[GenerateOutput]``. Raises
        :class:`r3jax.checks.FieldError` for bad input before anything is queued. ``future.cancel()``
        drops the request (a running one frees its slot at the next decode call). The future fails
        with :class:`r3jax.engine.EngineAborted` when a weight update aborts it (retry it), with the
        error of a device step that failed while it ran (the engine recovers and serves the next
        ones), and with :class:`r3jax.engine.EngineFailedError` when the engine cannot continue;
        a failed engine raises that here at once."""
        prompt = self._validate(request)
        seed = int(self._rng.integers(1 << 63)) if request.seed is None else int(request.seed)
        return self._sched.submit(Job(request, prompt, seed))

    async def submit_async(self, request: GenerateRequest) -> GenerateOutput:
        """:meth:`submit` for asyncio callers; cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Continue every request; outputs come back in request order. Every request is validated
        before any is queued (FieldError naming ``requests[i].field``)."""
        if isinstance(requests, GenerateRequest) or not isinstance(requests, Sequence):
            raise FieldError("requests", type(requests).__name__, "a list of GenerateRequest",
                             f"requests={type(requests).__name__}: expected a list of GenerateRequest")
        for i, req in enumerate(requests):
            if not isinstance(req, GenerateRequest):
                raise FieldError(f"requests[{i}]", type(req).__name__, "a GenerateRequest",
                                 f"requests[{i}]={type(req).__name__}: expected a GenerateRequest")
            try:
                self._validate(req)
            except FieldError as e:
                raise e.within(f"requests[{i}]") from None
        futures = [self.submit(r) for r in requests]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def set_weights(self, params_state, abort_in_flight: bool = False) -> int:
        """Replace the weights and return the new ``weight_version``.

        ``params_state``: an ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)``, optionally with
        the model's router biases too (:func:`r3jax.params_io.weights_of`: what ``push_to_engine`` and
        ``POST /v1/weights`` send; biases not given stay as they are), on any devices: they are copied
        onto the current placement.

        Drain (default): stop admitting, let in-flight requests finish on the old weights, swap,
        resume. ``abort_in_flight=True``: in-flight requests fail with :class:`EngineAborted` (they may
        be retried) and the swap happens at once. Requests still waiting run on the new weights. No
        output ever mixes versions; the prefix cache is dropped (its KV and routes are stale)."""
        params, biases = split_weights(params_state) if isinstance(params_state, nnx.State) else (params_state, None)
        _check_like("params_state", params, self._params)
        placed = self.placement.params(params, like=self._params)
        rest = self._rest
        if biases is not None and jax.tree.leaves(biases):
            old_biases, other = nnx.split_state(self._rest, RouterBias, ...)
            _check_like("params_state (router biases)", biases, old_biases)
            rest = nnx.merge_state(self.placement.params(biases, like=old_biases), other)
        return self._sched.control(functools.partial(self._swap, placed, rest), drain=True, abort=abort_in_flight)

    def warmup(self) -> dict:
        """Compile every device program of this configuration (prefill buckets, insert, decode
        windows, read-outs, prefix cache); returns ``{"programs": n, "seconds": s}``."""
        return self._sched.control(self._warmup, drain=False, abort=False)

    def close(self) -> None:
        """Stop the scheduler; requests not finished fail with :class:`EngineClosed`."""
        self._sched.close()

    # ---- scheduler callbacks (scheduler thread only) ----------------------------------------------
    def _swap(self, placed, rest) -> int:
        self._params, self._rest = placed, rest
        self.weight_version += 1
        self._prefix.clear(self.weight_version)
        return self.weight_version

    def _validate(self, req) -> np.ndarray:
        if not isinstance(req, GenerateRequest):
            raise FieldError("request", type(req).__name__, "a GenerateRequest",
                             f"{type(req).__name__}: expected a GenerateRequest")
        return req.validate(vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len,
                            max_stop_tokens=self.max_stop_tokens)

    def _warmup(self) -> dict:
        t0, before = time.perf_counter(), len(self.programs)
        from r3jax.engine.slot.warmup import compile_all

        compile_all(self)
        self._sched.warmed = True
        seconds = time.perf_counter() - t0
        self._counters["warmup_s"] += seconds
        return {"programs": len(self.programs), "new": len(self.programs) - before, "seconds": seconds}

    def _run(self, name, key, build, *args):
        return self.programs.run(name, key, build, *args)

    def _init_state(self) -> dev.SlotState:
        abstract = jax.eval_shape(functools.partial(
            dev.init_state, self.config, self.route_dtype, slots=self.max_batch_size, seq_len=self.seq_len,
            stop_width=self.max_stop_tokens))
        shardings = self.placement.state(abstract)
        fn = functools.partial(dev.init_state, self.config, self.route_dtype, slots=self.max_batch_size,
                               seq_len=self.seq_len, stop_width=self.max_stop_tokens)
        return self._run("state_init", (), lambda: (fn, {"out_shardings": shardings}))

    def _build_pool_init(self):
        fn = functools.partial(init_pool, self.config, self.route_dtype, capacity=self._prefix.capacity,
                               block_size=self.block_size)
        return fn, {"out_shardings": self.placement.pool(jax.eval_shape(fn))}

    def _init_pool(self):
        return self._run("pool_init", self._prefix.capacity, self._build_pool_init)

    # ---- device steps (scheduler thread only) -------------------------------------------------------
    def _scratch_shardings(self, rows, sp):
        p = self.placement
        kv = p.kv(rows, by_row=False)
        cache = jax.tree.map(lambda _: kv, jax.eval_shape(lambda: dev.KVCache.init(self.config, rows, sp)))
        return cache, p.replicated

    def _build_begin(self, rows, sp):
        fn = functools.partial(dev.begin_prefill, self.config, self.route_dtype, rows=rows, seq_len=sp)
        if not self._prefix.enabled:
            fn = functools.partial(lambda f, row, blk, slot: f(None, row, blk, slot), fn)
        return fn, {"out_shardings": self._scratch_shardings(rows, sp)}

    def _build_prefill(self, rows, sp):
        cache, rep = self._scratch_shardings(rows, sp)
        return (functools.partial(dev.prefill_chunk, self._graphdef, head_only=self._head_only),
                {"donate_argnums": (2, 3, 7), "out_shardings": (cache, rep, rep)})

    def _build_first(self):
        return dev.sample_first, {"out_shardings": (self.placement.replicated, self.placement.replicated)}

    def _build_insert(self):
        return dev.insert, {"donate_argnums": (0,), "out_shardings": self.placement.state(self._state)}

    def _build_decode(self, n, window):
        return decode_program(self._graphdef, self.placement, self._state, n=n, window=window,
                              steps=self.decode_steps)

    def _build_read(self, length):
        return functools.partial(dev.read_slot, length=length), {}

    def _build_store(self):
        return store_blocks, {"donate_argnums": (0,), "out_shardings": self.placement.pool(self._prefix.pool)}

    def prefill(self, jobs: list[Job], slot_ids: list[int]) -> None:
        """Prefill ``jobs`` (at most the largest row bucket) and insert them into ``slot_ids``."""
        put, cfg, bs = self.placement.put, self.config, self.block_size
        n = len(jobs)
        rows = bucket(n, self._row_buckets)
        prompts = [j.prompt for j in jobs]
        sp = bucket(max(len(p) for p in prompts) + 1, self._seq_buckets)  # + 1: the trash position
        hits = [self._prefix.match(p) for p in prompts]
        cached = [len(h) * bs for h in hits]
        plan = self._prefix.load_plan(hits, rows, sp)
        args = ((self._prefix.pool,) if self._prefix.enabled else ()) + tuple(put(tuple(plan)))
        cache, routes = self._run("begin", (rows, sp, self._prefix.capacity), lambda: self._build_begin(rows, sp), *args)
        todo = [len(p) - c for p, c in zip(prompts, cached)]
        t = min(bucket(max(todo), self._chunk_buckets), sp)
        logits = put(np.zeros((rows, cfg.vocab_size), np.float32))
        chunks = -(-max(todo) // t)
        for ci in range(chunks):
            tokens, positions = np.zeros((rows, t), np.int32), np.full((rows, t), sp - 1, np.int32)
            last = np.full((rows,), -1, np.int32)
            for r, (p, c) in enumerate(zip(prompts, cached)):
                lo = c + ci * t
                hi = min(len(p), lo + t)
                if hi > lo:
                    tokens[r, :hi - lo], positions[r, :hi - lo] = p[lo:hi], np.arange(lo, hi)
                    if hi == len(p):
                        last[r] = hi - lo - 1
            cache, routes, logits = self._run(
                "prefill", (rows, t, sp), lambda: self._build_prefill(rows, sp), self._params, self._rest, cache,
                routes, *put((tokens, positions, last)), logits)
        slot_arr = np.full((rows,), self.max_batch_size, np.int32)
        slot_arr[:n] = slot_ids
        slot_dev, new = put((slot_arr, self._slot_params(jobs, rows)))  # one transfer call
        first, first_lp = self._run("first", rows, self._build_first, logits, new)
        self._state = self._run("insert", (rows, sp), self._build_insert, self._state, cache, routes, first,
                                first_lp, slot_dev, new)
        for job, c in zip(jobs, cached):
            job.cached = c
        c = self._counters
        c["prefill_calls"] += chunks
        c["prefill_tokens"] += sum(todo)
        c["cached_tokens"] += sum(cached)
        c["padded_prefill_tokens"] += chunks * rows * t

    def prepare(self, job: Job) -> dict[str, np.ndarray]:
        """The host-side slot parameters of one request (one row of :class:`SlotParams`, built at
        admission). Whatever raises here fails this request alone (e.g. a value its dtype cannot hold:
        numpy raises OverflowError), never the others admitted with it."""
        req = job.request
        stop_ids = np.full((self.max_stop_tokens,), -1, np.int32)
        stop_ids[:len(req.stop_token_ids)] = np.asarray(req.stop_token_ids, np.int64)
        return dict(prompt_len=np.int32(len(job.prompt)), max_new=np.int32(req.max_tokens),
                    temperature=np.float32(req.temperature), top_k=np.int32(req.top_k),
                    top_p=np.float32(req.top_p), key_data=seed_words(job.seed), stop_ids=stop_ids,
                    processed=np.bool_(req.logprobs_mode == "processed_logprobs"))

    def _slot_params(self, jobs: list[Job], rows: int) -> dev.SlotParams:
        """The rows of ``jobs`` (:meth:`prepare`), padded to ``rows`` with an idle row."""
        idle = dict(prompt_len=np.int32(1), max_new=np.int32(1), temperature=np.float32(0.0), top_k=np.int32(0),
                    top_p=np.float32(1.0), key_data=np.zeros((2,), np.uint32),
                    stop_ids=np.full((self.max_stop_tokens,), -1, np.int32), processed=np.bool_(False))
        table = [j.row for j in jobs] + [idle] * (rows - len(jobs))
        return dev.SlotParams(**{name: np.stack([row[name] for row in table]) for name in idle})

    def decode(self, live: dict[int, Job], n_gen: np.ndarray):
        """One decode call over the live slots; returns ``(n_gen [B], done [B])`` on the host."""
        need = max(min(len(j.prompt) + int(n_gen[s]) + self.decode_steps, len(j.prompt) + j.request.max_tokens)
                   for s, j in live.items())
        window = bucket(need, self._seq_buckets)
        n = bucket(len(live), self._live_buckets)
        idx = np.full((n,), self.max_batch_size, np.int32)
        if n == self.max_batch_size:  # every slot in place (slots.decode): idx[s] = s where live
            idx[sorted(live)] = sorted(live)
        else:
            idx[:len(live)] = sorted(live)
        self._state = self._run("decode", (n, window), lambda: self._build_decode(n, window), self._params, self._rest,
                                self._state, self.placement.put(idx))
        c = self._counters
        c["decode_calls"] += 1
        c["max_live_slots"] = max(c["max_live_slots"], len(live))
        return jax.device_get((self._state.n_gen, self._state.done))

    def harvest(self, slot: int, job: Job, n_gen: int) -> GenerateOutput:
        """The finished request in ``slot``: its tokens, and route rows ``[s, P + G - 1)`` of that slot only;
        its fed tokens' whole blocks go to the prefix cache."""
        req, p, g = job.request, len(job.prompt), n_gen
        s = req.routed_experts_prompt_start
        rows = p + g - 1 - s
        length = bucket(max(rows, 1), self._read_buckets) if req.return_routed_experts else self._read_buckets[0]
        put = self.placement.put
        t0 = time.perf_counter()
        tokens, logprobs, stopped, routes = jax.device_get(self._run(
            "read", length, lambda: self._build_read(length), self._state,
            *put((np.int32(slot), np.int32(s if req.return_routed_experts else 0)))))
        routed = None
        if req.return_routed_experts:
            routed = np.ascontiguousarray(routes[:rows])
            self._counters["route_gather_s"] += time.perf_counter() - t0
            self._counters["route_rows"] += rows
        plan = self._prefix.store_plan(np.concatenate([job.prompt, tokens[:g - 1]]), slot, self.seq_len)
        if plan is not None:
            self._prefix.pool = self._run("store", self._prefix.capacity, self._build_store, self._prefix.pool, self._state.cache,
                                          self._state.routes, *put(tuple(plan)))
        c = self._counters
        c["requests"] += 1
        c["generated_tokens"] += g
        return GenerateOutput(
            output_ids=tokens[:g].tolist(), logprobs=logprobs[:g].tolist() if req.return_logprobs else None,
            finish_reason="stop" if stopped else "length", routed_experts=routed, prompt_tokens=p,
            cached_tokens=job.cached, weight_version=job.version, routed_experts_start=s)

    def reset_state(self) -> None:
        """Fresh slot buffers and an empty prefix cache (after a device error left a donated buffer
        unusable: the pool is donated to every store)."""
        self._state = self._init_state()
        if self._prefix.enabled:
            self._prefix.clear(self.weight_version)
            self._prefix.pool = self._init_pool()


def prefill_chunk_limit(cfg: MoeConfig, rows: int, seq_len: int, prefill_chunk: int, *,
                        head_only: bool = True) -> int:
    """The largest prefill chunk bucket (a power of two, >= 16): ``prefill_chunk``, capped with the
    einsum attention (``attention_impl="xla"``; the other kernels hold O(T * block)) by the f32
    attention scores [rows, num_heads, T, seq_len] (``_SCORES_BYTES``) and, for a model whose
    LM head runs on every fed position (``head_only=False``), by its logits [rows, T, V]
    (``_LOGITS_BYTES``). With ``head_only`` the vocabulary does not limit the chunk."""
    cap = prefill_chunk
    if resolve_impl(cfg.attention_impl) == "xla":  # only the einsum reference holds the whole scores
        cap = min(cap, _SCORES_BYTES // (4 * rows * cfg.num_heads * seq_len))
    if not head_only:
        cap = min(cap, _LOGITS_BYTES // (4 * rows * cfg.vocab_size))
    return pow2_at_most(max(16, cap))


def _check_model_config(model) -> None:
    """The engine sizes the KV cache, the route buffers and the logits from ``model.config``, so any
    model must carry a :class:`models.MoeConfig` that describes it (docs/own-model.md)."""
    if not isinstance(getattr(model, "config", None), MoeConfig):
        got = type(getattr(model, "config", None)).__name__
        raise FieldError("model.config", got, "a models.MoeConfig",
                         f"Engine model.config: {type(model).__name__} has a {got}: expected a models.MoeConfig "
                         "describing its vocab_size, KV cache (num_layers, first_dense_layers, num_kv_heads, "
                         "head_dim, dtype) and routes (num_experts, top_k)")


def decode_program(graphdef, placement: Placement, state, *, n: int, window: int, steps: int):
    """``(fn, jit kwargs)`` of the decode program for ``n`` live-slot rows and an attention ``window``
    (:func:`r3jax.engine.slot.slots.decode`; the slot state is donated and keeps its placement). Also what
    ``experiments/scale_plan.py`` compiles for real TPU topologies."""
    fn = functools.partial(dev.decode, graphdef, steps=steps, window=window,
                           view_sharding=placement.kv(n, by_row=True))
    return fn, {"donate_argnums": (2,), "out_shardings": placement.state(state)}
