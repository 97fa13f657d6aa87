"""The rollout engine: a paged KV pool shared by every request, mixed prefill + decode steps under a
token budget, a host that plans the next step while the device runs the current one, and the routed
experts of every token recorded.

The public surface is :class:`Engine` (``submit`` / ``submit_async`` / ``generate`` / ``set_weights``
/ ``warmup`` / ``close``); the scheduling loop lives in :mod:`r3jax.engine.loop`, the step plan in
:mod:`r3jax.engine.planner`, layouts, programs and calls in :mod:`r3jax.engine.device`, the device
program in :mod:`r3jax.engine.step`, page bookkeeping in
:mod:`r3jax.engine.pages`, attention over pages in :mod:`models.paged`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from models import MoeConfig, MoeTransformer
from models.cache import cache_bytes_per_token
from models.routers import RouterBias
from models.weights import split_weights
from r3jax.checks import FieldError, check_int
from r3jax.engine.pages import PagePool
from r3jax.engine.device import DeviceSide
from r3jax.engine.programs import Programs, default_prefill_rows, prefill_buckets, round_up
from r3jax.engine.request import GREEDY_BELOW, GenerateOutput, GenerateRequest, each_checked, generate_all
from r3jax.engine.sampling import seed_words
from r3jax.engine.sharding import Placement
from r3jax.routes import route_dtype

# moe_impl=None on CPU: runs each chosen expert on only the tokens that chose it, the fastest
# decode kernel measured there (experiments/bench_decode.py); every MoeConfig accepts it
CPU_MOE_IMPL = "gather"
WEIGHT_UPDATE_MODES = ("wait", "keep", "abort")  # what set_weights does with running requests (vLLM's pause modes)
BLOCK_TOKENS = 128  # keys per block of the XLA paged-attention loop (rounded to whole pages)


class Engine(DeviceSide):
    """Continuous batching over a paged KV + route pool for a :class:`models.MoeTransformer`.

    Every request owns a block table of ``block_size``-token pages in one pool; a prompt starting with
    the whole pages of an earlier sequence (same weights) references them instead of recomputing them
    (their route rows come with them). Each device step feeds the next token of every running request
    plus chunks of waiting prompts, at most ``max_num_batched_tokens`` tokens; a long prompt is chunked
    over several steps while the others keep decoding. The host plans step n + 1 while step n runs and
    reads step n's tokens, logprobs and route rows with asynchronous copies; a finished request reads
    nothing more. The set of device programs is fixed by this configuration (decode-row buckets x
    prefill-row buckets); :meth:`warmup` compiles them all and ``stats["compiled_programs"]`` never
    changes afterwards.

    Args:
      model: the model; its parameters are copied (a trainer may donate or update its own).
      max_seq_len: longest prompt + max_tokens accepted.
      max_batch_size: most requests running at once (decode rows per step).
      num_pages: pages in the pool (page 0 is the trash page). Default: enough for ``max_batch_size``
        requests of ``max_seq_len`` tokens plus ``prefix_cache_bytes`` of cached prefixes.
      prefix_cache_bytes: extra pool memory for cached prefixes in the default ``num_pages``; 0 turns
        prefix caching off.
      block_size: tokens per page.
      prefill_chunk: tokens per prefill row (a prompt takes ceil(P / prefill_chunk) rows, over one or
        more steps).
      prefill_rows: most prefill rows per step (default 16, or 4 when ``max_batch_size`` < 12:
        :func:`r3jax.engine.programs.default_prefill_rows`); or give ``max_num_batched_tokens`` (tokens
        per step: ``max_batch_size`` decode rows + ``prefill_rows * prefill_chunk``). Steps that prefill
        get programs of 4, 16, ... rows up to ``prefill_rows`` (:func:`r3jax.engine.programs.prefill_buckets`),
        and a step takes up to 4 rows, more when that many prompts wait (:meth:`prefill_rows_for`): a
        batch of prompts submitted at once (a GRPO step) is prefilled up to 16 rows a step, while a long
        prompt or a few are prefilled 4 rows a step beside the requests decoding.
      decode_buckets: how many decode-row sizes get a decode program: B, B/2, B/4, ... (default 3);
        1 pads every decode call to B rows.
      mixed_decode_buckets: how many of those sizes, the largest first, also get the programs of steps
        that prefill (one per prefill-row bucket: 2 each by default). Default 1: a step that
        prefills pads its decode rows to B: its cost is mostly the prefill's, so padding costs it little
        next to what padding costs the decode loop (``python -m experiments.serve_start`` times every
        layout), and the warm-up compiles 5 programs, not 9.
      decode_steps: decode steps per device call while no prompt is being prefilled (default 8): the
        call runs them in a loop on device, with stop tokens and max_tokens checked there, so the host's
        per-call cost is paid once per ``decode_steps`` tokens of every request. A prompt that arrives
        meanwhile waits for the call to end; calls with prefill rows decode one step. A loop ends early
        when every row has stopped or run its budget.
      return_at_finish: a decode loop call ends where its first caller has all it waits for (default
        True): a request submitted alone when it reaches its max_tokens, a :meth:`submit_many` batch
        (``generate``, a server request's n samples) when its last request does. That answer returns at
        once instead of after the call's other steps (a multi-turn agent's next turn starts sooner);
        the others go on in the next call. Tokens are the same either way. A batch is not cut at its
        first request: its caller would gain nothing, and a batch prefilled over several steps (an RL
        step's), whose requests finish a step apart per prefill step, would pay one more call per step.
      dtype: compute dtype override (e.g. bf16 rollouts of an fp32 model); None keeps the model's.
      moe_impl: expert kernel; None picks "gather" on CPU and keeps the model's elsewhere.
      logits_dot_in_fp32: the LM head in fp32 (``MoeConfig.logits_dot_in_fp32``) whatever the compute dtype,
        so a bf16 rollout's logprobs carry no bf16 rounding of the head's own; None (default): on for a
        ``MoeTransformer`` (the model itself is not changed), the model's setting for any other model.
      router_noise: std of simulated selection noise on the router logits (``MoeConfig.router_noise``,
        a mismatch knob for experiments); None keeps the model's. The model itself is not changed.
      max_stop_tokens: most stop token ids per request.
      mesh: a device mesh with axes among (data, tensor, expert) (:mod:`r3jax.engine.sharding`).
      static: admit requests only when none is running (static batches, kept for comparisons).
      seed: seeds the draws of per-request seeds for requests with ``seed=None``.
      allow_replication: accept (with one warning) arrays a mesh axis cannot split.
      program_cache: a directory for this engine's compiled programs (:mod:`r3jax.engine.program_cache`):
        a later engine of the same model, configuration, code and JAX loads them from there without
        tracing, lowering or compiling (``serve --compilation-cache DIR`` uses ``DIR/r3jax-programs``).
    """

    def __init__(self, model: MoeTransformer, *, max_seq_len: int, max_batch_size: int, num_pages: int | None = None,
                 prefix_cache_bytes: int = 64 << 20, block_size: int = 16, prefill_chunk: int = 64,
                 prefill_rows: int | None = None, max_num_batched_tokens: int | None = None, decode_buckets: int = 3,
                 mixed_decode_buckets: int = 1,
                 decode_steps: int = 8, return_at_finish: bool = True, dtype=None, moe_impl: str | None = None, router_noise: float | None = None,
                 logits_dot_in_fp32: bool | None = None,
                 max_stop_tokens: int = 64, mesh=None, static: bool = False,
                 seed: int | None = None, allow_replication: bool = False, program_cache: str | None = None):
        for name, value, lo in [("max_seq_len", max_seq_len, 2), ("max_batch_size", max_batch_size, 1),
                                ("prefix_cache_bytes", prefix_cache_bytes, 0), ("block_size", block_size, 1),
                                ("prefill_chunk", prefill_chunk, 1), ("max_stop_tokens", max_stop_tokens, 1),
                                ("decode_buckets", decode_buckets, 1), ("mixed_decode_buckets", mixed_decode_buckets, 1),
                                ("decode_steps", decode_steps, 1)]:
            _check(name, value, lo)
        if prefill_rows is not None and max_num_batched_tokens is not None:
            raise FieldError("max_num_batched_tokens", max_num_batched_tokens, "None when prefill_rows is given",
                             "Engine max_num_batched_tokens: give it or prefill_rows, not both")
        if max_num_batched_tokens is not None:
            _check("max_num_batched_tokens", max_num_batched_tokens, max_batch_size + prefill_chunk)
            prefill_rows = (max_num_batched_tokens - max_batch_size) // prefill_chunk
        prefill_rows = default_prefill_rows(max_batch_size) if prefill_rows is None else prefill_rows
        _check("prefill_rows", prefill_rows, 1)
        _check_model_config(model)
        own = isinstance(model, MoeTransformer)
        if moe_impl is None and own and jax.default_backend() == "cpu":
            moe_impl = CPU_MOE_IMPL
        if logits_dot_in_fp32 is None and own:
            logits_dot_in_fp32 = True
        overrides = {k: v for k, v in (("dtype", dtype), ("moe_impl", moe_impl), ("router_noise", router_noise),
                                       ("logits_dot_in_fp32", logits_dot_in_fp32)) if v is not None}
        overrides = {k: v for k, v in overrides.items() if v != getattr(model.config, k)}
        if overrides and not own:
            name = next(iter(overrides))
            raise FieldError(name, overrides[name], f"None or model.config.{name} for a {type(model).__name__}",
                             f"Engine {name}={overrides[name]!r}: expected None or model.config.{name} for a "
                             f"{type(model).__name__} (only a MoeTransformer is rebuilt with another {name})")
        try:
            cfg = model.config.replace(**overrides)
        except FieldError as e:  # e.g. a negative router_noise: name the Engine argument
            name = e.field.removeprefix("MoeConfig.")
            raise FieldError(name, e.value, e.expected, f"Engine {name}={e.value!r}: expected {e.expected}") from None
        self.config = cfg
        self.max_seq_len, self.max_batch_size, self.block_size = max_seq_len, max_batch_size, block_size
        self.prefill_chunk, self.prefill_rows, self.max_stop_tokens = prefill_chunk, prefill_rows, max_stop_tokens
        self.decode_steps, self.return_at_finish = decode_steps, bool(return_at_finish)
        self.max_num_batched_tokens = max_batch_size + prefill_rows * prefill_chunk
        self.static = bool(static)
        self.route_dtype = route_dtype(cfg.num_experts)
        self.weight_version = 0
        self.placement = Placement(mesh, cfg, allow_replication=allow_replication)
        self.placement.kv()  # a mesh that would replicate the pool fails here, before any weight is placed

        route_row = cfg.num_moe_layers * cfg.top_k * self.route_dtype.itemsize
        self.page_bytes = block_size * (cache_bytes_per_token(cfg) + route_row)
        if num_pages is None:
            num_pages = 1 + max_batch_size * -(-max_seq_len // block_size) + prefix_cache_bytes // self.page_bytes
        _check("num_pages", num_pages, 1 + -(-max_seq_len // block_size))  # one request of max_seq_len must fit
        self.num_pages = num_pages
        self.pool = PagePool(num_pages, block_size, route_shape=(cfg.num_moe_layers, cfg.top_k),
                             route_dtype=self.route_dtype, prefix=prefix_cache_bytes > 0)
        block_pages = max(1, BLOCK_TOKENS // block_size)
        self._pages_per_row = round_up(-(-max_seq_len // block_size), block_pages)
        self._block_pages = min(block_pages, self._pages_per_row)
        # program buckets: decode rows B, B/2, B/4, ... (>= 1; decode_buckets of them) with no prefill row, and
        # the largest mixed_decode_buckets of them x prefill rows 4, 16, ..., prefill_rows
        self._decode_buckets = sorted({max(1, max_batch_size >> i) for i in range(decode_buckets)})
        self._mixed_buckets = self._decode_buckets[-mixed_decode_buckets:]
        self._prefill_buckets = prefill_buckets(prefill_rows)
        self._head_only = callable(getattr(model, "logits", None))

        _, params, rest = nnx.split(model, nnx.Param, ...)
        if overrides:
            model = nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, _, _ = nnx.split(model, nnx.Param, ...)
        self._graphdef = graphdef
        self._params = self.placement.params(params)
        self._rest = jax.tree.map(lambda x: self.placement.put(np.asarray(x)), rest)
        self._bits = jax.default_backend() == "cpu"  # 16-bit float scatters run in f32 over the whole pool there
        key = (graphdef, cfg, self.route_dtype.name, max_batch_size, num_pages, block_size, self._pages_per_row,
               self._block_pages, self._bits, mesh)
        disk = None
        if program_cache is not None:  # serialized executables: a restart loads them without tracing
            from r3jax.engine.program_cache import ProgramCache, fingerprint

            disk = ProgramCache(program_cache, fingerprint(type(model), graphdef, key[1:]))
        self.programs = Programs(key, disk)
        self._counters = dict(requests=0, steps=0, prefill_calls=0, prefill_tokens=0, cached_tokens=0,
                              padded_tokens=0, generated_tokens=0, decode_calls=0, decode_slot_steps=0,
                              max_live_slots=0, cancelled=0, aborted=0, failed=0, preempted=0, route_rows=0, wasted_tokens=0,
                              route_gather_s=0.0, host_wait_s=0.0, plan_s=0.0, dispatch_s=0.0, process_s=0.0, warmup_s=0.0)
        self._ttft: list[float] = []
        self._rng = np.random.default_rng(seed)
        self._k = self._v = self._last = None
        self._init_state()
        from r3jax.engine.loop import Loop

        self._sched = Loop(self)

    # ---- public ------------------------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.config.moe_layer_ids

    @property
    def warmed_up(self) -> bool:
        return self._sched.warmed

    @property
    def failure(self) -> str | None:
        """Why this engine serves no more requests, or None while it serves."""
        return self._sched.failure

    @property
    def stats(self) -> dict:
        """Counters since construction. steps: device steps; decode_calls: steps that decoded;
        prefill_calls: prefill rows run; prefill_tokens: prompt tokens run through the model;
        cached_tokens: prompt tokens whose KV and routes came from cached pages; padded_tokens: token
        slots of steps left empty; wasted_tokens: tokens computed for requests that had already
        stopped (the step planned before their stop token was read); route_rows / route_gather_s: route
        rows returned, and host seconds copying route rows out of step outputs into requests' buffers
        and answers; host_wait_s: seconds the host
        blocked on step outputs; plan_s / dispatch_s / process_s: host seconds planning steps (index
        arrays), handing them to the device (inputs placed, program enqueued) and taking in their outputs; compiled_programs: fixed after :meth:`warmup` (``warmup()["new"]`` counts
        programs new to this process, loaded from the persistent compilation cache or compiled);
        pages_in_use: pages some request references; pages_reserved: pages promised to admitted requests
        (prompt pages at admission, decode pages a call at a time) and not taken yet; preempted: requests
        whose pages were freed when the pool ran out, recomputed later (their answers unchanged); prefix_cache_blocks: indexed
        pages, any unreferenced one of which may be evicted (capacity: every page, 0 with caching off)."""
        ttft = np.asarray(self._ttft[-1024:]) if self._ttft else None
        pool = self.pool
        return {**self._counters, "compiled_programs": len(self.programs),
                "live_slots": self._sched.live, "queued": self._sched.queued,
                "pages_total": pool.num_pages - 1, "pages_in_use": pool.in_use, "pages_reserved": pool.reserved,
                "prefix_cache_blocks": pool.cached, "prefix_cache_capacity_blocks": pool.num_pages - 1 if pool.prefix else 0,
                "prefix_cache_block_bytes": self.page_bytes, "prefix_cache_evictions": pool.evictions,
                "ttft_p50_s": None if ttft is None else float(np.percentile(ttft, 50)),
                "ttft_p99_s": None if ttft is None else float(np.percentile(ttft, 99)),
                "failure": self.failure}

    def recent_ttft(self, n: int = 1024) -> list[float]:
        """Seconds from submit to the first token on the host, of the last ``n`` requests that got one."""
        return list(self._ttft[-n:])

    def submit(self, request: GenerateRequest, on_token=None) -> concurrent.futures.Future:
        """Queue one request; returns a ``concurrent.futures.Future[GenerateOutput]``. ``on_token(token,
        logprob)`` (optional) is called on the scheduler thread for each token as it reaches the host,
        in order (``logprob`` None when not asked for); a true return value stops the request at that
        token (finish_reason "stop", as a stop token would: stop strings use it). Keep it short and
        thread-safe (streaming hands tokens to an event loop with ``call_soon_threadsafe``); whatever it
        raises is logged. Raises
        :class:`r3jax.checks.FieldError` for bad input before anything is queued. ``future.cancel()``
        drops the request (a running one frees its pages). The future fails with
        :class:`r3jax.engine.EngineAborted` when a weight update aborts it (retry it), with the error of
        a device step that failed while it ran (the engine recovers and serves the next ones), and with
        :class:`r3jax.engine.EngineFailedError` when the engine cannot continue."""
        return self._sched.submit(self._job(request, on_token))[0]

    def submit_many(self, requests: Sequence[GenerateRequest], on_tokens=None) -> list[concurrent.futures.Future]:
        """:meth:`submit` of several requests at once: all are validated before any is queued (FieldError
        naming ``requests[i].field``), then queued together, so the scheduler admits them in one step as
        the pool and batch allow (a group of samples of one prompt prefills it once). Its caller is taken
        to wait for all of them (``return_at_finish``). ``on_tokens``: one callback (or None) per request."""
        return self._sched.submit(*each_checked(requests, on_tokens, self._job))

    def _job(self, request: GenerateRequest, on_token=None):
        from r3jax.engine.loop import Job

        prompt = self._validate(request)
        seed = int(self._rng.integers(1 << 63)) if request.seed is None else int(request.seed)
        return Job(request, prompt, seed, on_token=on_token)

    async def submit_async(self, request: GenerateRequest) -> GenerateOutput:
        """:meth:`submit` for asyncio callers; cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Continue every request; outputs come back in request order. Every request is validated
        before any is queued (FieldError naming ``requests[i].field``), and all are queued at once: the
        scheduler admits them together, as the pool and batch allow (a group of samples of one prompt
        prefills it once)."""
        return generate_all(requests, self._validate, self.submit_many)

    def set_weights(self, params_state, abort_in_flight: bool = False, *, mode: str | None = None,
                    version: int | None = None) -> int:
        """Replace the weights and return the new ``weight_version``: ``version`` when given (it must be
        above the current one: a trainer numbers its pushes by its step, so versions survive a restart
        of either side), else the current one + 1.

        ``params_state``: an ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)``, optionally with
        the model's router biases (:func:`r3jax.params_io.weights_of`), on any devices: each array is
        copied onto this engine's placement (device to device where it already lives on devices).

        ``mode`` (vLLM's pause modes), for the requests running when the update arrives:

        - ``"wait"`` (default): stop admitting, let them finish on the old weights, swap, resume.
        - ``"keep"``: swap between two device steps; they go on with the new weights (their KV so far
          stays), so one output can span versions: ``GenerateOutput.weight_versions`` says which token
          came from which.
        - ``"abort"``: each one that has sampled a token returns what it has (tokens, logprobs, route
          rows ``[s, P + G - 1)``) with ``finish_reason`` "abort", to be resumed by resubmitting prompt +
          tokens; one that has not is queued again and runs on the new weights. Then swap.

        ``abort_in_flight=True`` (the older form) fails them with :class:`EngineAborted` instead.
        Prefix pages computed under one version are never reused under another: the index is cleared
        at the swap and a request whose KV spans a swap indexes none of its pages. The new weights are
        copied in at the swap, chunk by chunk, each chunk of the old ones freed as its new one arrives
        (:meth:`r3jax.engine.sharding.Placement.replace`): the engine holds one copy plus at most one
        chunk (a tenth of the weights, or its largest array), never two copies."""
        if mode is not None and mode not in WEIGHT_UPDATE_MODES:
            raise FieldError("mode", mode, f"one of {', '.join(map(repr, WEIGHT_UPDATE_MODES))} or None")
        if abort_in_flight and mode not in (None, "abort"):
            raise FieldError("abort_in_flight", True, f"False with mode={mode!r}")
        mode = "wait" if mode is None else mode
        if version is not None:
            check_int("version", version, self.weight_version + 1)
        params, biases = split_weights(params_state) if isinstance(params_state, nnx.State) else (params_state, None)
        _check_like("params_state", params, self._params)
        rest = self._rest
        if biases is not None and jax.tree.leaves(biases):
            old_biases, other = nnx.split_state(self._rest, RouterBias, ...)
            _check_like("params_state (router biases)", biases, old_biases)
            rest = nnx.merge_state(self.placement.params(biases, like=old_biases), other)
        return self._sched.control(functools.partial(self._swap, params, rest, version), drain=mode == "wait",
                                   abort="error" if abort_in_flight else ("return" if mode == "abort" else None))

    def warmup(self) -> dict:
        """Compile every step program of this configuration; returns ``{"programs", "new", "seconds",
        "loaded", "compiled"}``: programs of the configuration, those new to this engine, the seconds it
        took, and of the programs this engine built (not shared with a live engine of the same
        configuration), how many JAX's persistent compilation cache supplied and how many XLA compiled."""
        return self._sched.control(self._warmup, drain=False, abort=None)

    def close(self) -> None:
        """Stop the scheduler (requests not finished fail with :class:`EngineClosed`) and release this
        engine's compiled programs: the process-wide cache frees those no other live engine holds."""
        self._sched.close()
        self.programs.release()

    # ---- loop callbacks (scheduler thread only) ----------------------------------------------------
    def _swap(self, params, rest, version: int | None = None) -> int:
        if version is not None and version <= self.weight_version:  # another update got in first
            raise FieldError("version", version, f"an int > weight_version={self.weight_version}")
        # between two device steps: the new weights replace the old chunk by chunk, each old chunk
        # freed as its new one arrives (peak near one copy, not two)
        self._params, self._rest = self.placement.replace(self._params, params), rest
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self.pool.clear(self.weight_version)
        return self.weight_version

    def _validate(self, req) -> np.ndarray:
        if not isinstance(req, GenerateRequest):
            raise FieldError("request", type(req).__name__, "a GenerateRequest",
                             f"{type(req).__name__}: expected a GenerateRequest")
        return req.validate(vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len,
                            max_stop_tokens=self.max_stop_tokens)

    def prepare(self, job) -> dict[str, np.ndarray]:
        """The host-side sampling parameters of one request (built at admission). Whatever raises here
        fails this request alone (e.g. a value its dtype cannot hold), never the others."""
        req = job.request
        stop = np.asarray(req.stop_token_ids, np.int64).astype(np.int32)
        stop_ids = np.full(self.max_stop_tokens, -1, np.int32)  # the decode loop's on-device stop check
        stop_ids[:len(stop)] = stop
        greedy = req.temperature < GREEDY_BELOW  # 1e-30 would overflow the scaled logits to inf / NaN
        return dict(temperature=np.float32(0.0 if greedy else req.temperature), top_k=np.int32(req.top_k),
                    top_p=np.float32(req.top_p), key_data=seed_words(job.seed), processed=np.bool_(req.logprobs_mode == "processed_logprobs"),
                    stop=set(int(t) for t in stop), stop_ids=stop_ids)


def _check(name, value, lo):
    try:
        check_int(name, value, lo=lo)
    except FieldError as e:
        raise FieldError(e.field, value, e.expected, f"Engine {e.message}") from None


def _check_model_config(model) -> None:
    """The engine sizes the pool, the route rows and the logits from ``model.config``."""
    if not isinstance(getattr(model, "config", None), MoeConfig):
        got = type(getattr(model, "config", None)).__name__
        raise FieldError("model.config", got, "a models.MoeConfig",
                         f"Engine model.config: {type(model).__name__} has a {got}: expected a models.MoeConfig "
                         "describing its vocab_size, KV cache (num_layers, first_dense_layers, num_kv_heads, "
                         "head_dim, dtype) and routes (num_experts, top_k)")


def _check_like(name: str, got, want) -> None:
    """Host-side: ``got`` has ``want``'s tree structure, leaf shapes and dtypes (naming the first difference)."""
    g, w = jax.tree_util.tree_flatten_with_path(got), jax.tree_util.tree_flatten_with_path(want)
    if g[1] != w[1]:
        raise ValueError(f"{name}: tree structure {g[1]} differs from the model's {w[1]}")
    for (path, new), (_, old) in zip(g[0], w[0]):
        if tuple(new.shape) != tuple(old.shape) or np.dtype(new.dtype) != np.dtype(old.dtype):
            raise ValueError(f"{name}{jax.tree_util.keystr(path)}: shape {tuple(new.shape)} dtype {new.dtype}, "
                             f"expected shape {tuple(old.shape)} dtype {old.dtype}")
