"""The rollout engine: validates requests, batches and buckets them, runs the device programs, and
returns tokens, logprobs and the route rows past each request's prompt start."""

from __future__ import annotations

import functools
import threading
import types
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from models import MoeTransformer
from r3jax.engine import decode as dev
from r3jax.engine.prefix_cache import PrefixCache
from r3jax.engine.programs import CountedJit, pow2_at_least, pow2_at_most, round_up
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.engine.sampling import seed_words
from r3jax.routes import route_dtype


_LOGITS_BYTES = 256 << 20  # most prefill logits held at once


class Engine:
    """Batched, jitted generation over a :class:`models.MoeTransformer` that records routes.

    ``generate(requests)`` takes any number of requests and runs them in batches of at most
    ``max_batch_size``. The batch size, the prefill chunk and the cache length are bucketed to powers
    of two, so the number of compiled programs stays small and bounded (``stats["compiled_programs"]``).

    Args:
      model: the model; its parameters are copied (a trainer may donate or update its own).
      max_seq_len: longest prompt + max_tokens accepted.
      max_batch_size: most requests decoded together.
      prefix_cache_bytes: device memory for the prefix cache (KV + route rows); 0 turns it off.
      dtype: compute dtype override (e.g. bf16 rollouts of an fp32 model); None keeps the model's.
      moe_impl: expert kernel of the engine's own programs (any MoeConfig.moe_impl); None picks the
        fastest decode kernel on CPU ("loop" where the model offers it, else "dense") and keeps the
        model's elsewhere. Routes are the router's choice either way; only float summation order
        differs.
      block_size: tokens per prefix-cache block.
      prefill_chunk: most prompt tokens fed per prefill call (longer prompts take several calls).
      min_seq_bucket: smallest cache length bucket.
      seed: seeds the draws of per-request seeds for requests with ``seed=None``.
    """

    def __init__(self, model: MoeTransformer, *, max_seq_len: int, max_batch_size: int,
                 prefix_cache_bytes: int = 64 << 20, dtype=None, moe_impl: str | None = None,
                 block_size: int = 16, prefill_chunk: int = 256, min_seq_bucket: int = 64,
                 seed: int | None = None):
        for name, value, lo in [("max_seq_len", max_seq_len, 2), ("max_batch_size", max_batch_size, 1),
                                ("prefix_cache_bytes", prefix_cache_bytes, 0), ("block_size", block_size, 1),
                                ("prefill_chunk", prefill_chunk, 1), ("min_seq_bucket", min_seq_bucket, 1)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"Engine {name}={value!r}: expected an int >= {lo}")
        if moe_impl is None and jax.default_backend() == "cpu":
            moe_impl = _cpu_moe_impl(model.config)
        overrides = {k: v for k, v in (("dtype", dtype), ("moe_impl", moe_impl)) if v is not None}
        overrides = {k: v for k, v in overrides.items() if v != getattr(model.config, k)}
        cfg = model.config.replace(**overrides)  # MoeConfig validates moe_impl
        self.config = cfg
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.block_size, self.prefill_chunk, self.min_seq_bucket = block_size, prefill_chunk, min_seq_bucket
        self.route_dtype = route_dtype(cfg.num_experts)
        self.weight_version = 0

        _, params, rest = nnx.split(model, nnx.Param, ...)
        if overrides:  # same parameter tree, programs traced with the overridden config
            model = nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, _, _ = nnx.split(model, nnx.Param, ...)
        self._params, self._rest = _copy(params), rest

        self._signatures: set = set()
        jit = lambda fn, name, **kw: CountedJit(fn, name, self._signatures, **kw)
        shared = _programs(graphdef, cfg, self.route_dtype)
        self._init = jit(shared.init, "init_buffers", static_argnames=("batch", "seq_len"))
        self._prefill = jit(shared.prefill, "prefill", static_argnames=("capture",))
        self._decode = jit(shared.decode, "decode", static_argnames=("capture",))
        self._read = jit(_read_routes, "read_routes", static_argnames=("length",))
        self._prefix = PrefixCache(cfg, self.route_dtype, block_size=block_size,
                                   budget_bytes=prefix_cache_bytes, jit=jit)
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(seed)
        self._counters = dict(requests=0, batches=0, prefill_tokens=0, cached_tokens=0,
                              generated_tokens=0, decode_steps=0, padded_prefill_tokens=0)

    # ---- public ------------------------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.config.moe_layer_ids

    @property
    def stats(self) -> dict:
        """Counters since construction. prefill_tokens: prompt tokens run through the model;
        cached_tokens: prompt tokens whose KV and routes came from the prefix cache;
        padded_prefill_tokens: prefill slots computed including bucket padding; compiled_programs:
        distinct device programs this engine has compiled."""
        return {**self._counters, "compiled_programs": len(self._signatures),
                "prefix_cache_blocks": self._prefix.num_blocks,
                "prefix_cache_capacity_blocks": self._prefix.capacity,
                "prefix_cache_block_bytes": self._prefix.block_bytes,
                "prefix_cache_evictions": self._prefix.evictions}

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Continue every request; outputs come back in request order. Every request is validated
        before anything runs (ValueError naming the request index, field and value)."""
        with self._lock:
            if isinstance(requests, GenerateRequest) or not isinstance(requests, Sequence):
                raise ValueError(f"requests={type(requests).__name__}: expected a list of GenerateRequest")
            prompts = []
            for i, req in enumerate(requests):
                if not isinstance(req, GenerateRequest):
                    raise ValueError(f"requests[{i}]={type(req).__name__}: expected a GenerateRequest")
                try:
                    prompts.append(req.validate(vocab_size=self.config.vocab_size,
                                                max_seq_len=self.max_seq_len))
                except ValueError as e:
                    raise ValueError(f"requests[{i}].{e}") from None
            seeds = [int(self._rng.integers(1 << 63)) if r.seed is None else r.seed for r in requests]
            order = sorted(range(len(requests)), key=lambda i: len(prompts[i]))  # less padding per batch
            outputs: list[GenerateOutput | None] = [None] * len(requests)
            for lo in range(0, len(order), self.max_batch_size):
                idx = order[lo:lo + self.max_batch_size]
                outs = self._run_batch([requests[i] for i in idx], [prompts[i] for i in idx],
                                       [seeds[i] for i in idx])
                for i, out in zip(idx, outs):
                    outputs[i] = out
            return outputs

    def set_weights(self, params_state) -> int:
        """Replace the parameters (an ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)``, on any
        devices: they are copied onto the current parameters' placement), bump and return
        ``weight_version``, and drop the prefix cache (its KV and routes are stale)."""
        with self._lock:
            want = jax.tree_util.tree_flatten_with_path(self._params)
            got = jax.tree_util.tree_flatten_with_path(params_state)
            if got[1] != want[1]:
                raise ValueError(f"params_state: tree structure {got[1]} differs from the model's "
                                 f"parameter tree {want[1]}")
            for (path, new), (_, old) in zip(got[0], want[0]):
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise ValueError(f"params_state{jax.tree_util.keystr(path)}: shape {new.shape} dtype "
                                     f"{new.dtype}, expected shape {old.shape} dtype {old.dtype}")
            self._params = _copy(params_state, like=self._params)
            self.weight_version += 1
            self._prefix.clear(self.weight_version)
            return self.weight_version

    # ---- one batch ---------------------------------------------------------------------------
    def _run_batch(self, reqs, prompts, seeds) -> list[GenerateOutput]:
        n, bs = len(reqs), self.block_size
        b = pow2_at_least(n, hi=self.max_batch_size)
        s = min(round_up(pow2_at_least(max(len(p) + r.max_tokens for p, r in zip(prompts, reqs)),
                                       lo=self.min_seq_bucket), bs), round_up(self.max_seq_len, bs))
        slots = [self._prefix.match(p) for p in prompts]
        cached = [len(sl) * bs for sl in slots]
        capture = self._prefix.enabled or any(r.return_routed_experts for r in reqs)

        cache, routes = self._init(batch=b, seq_len=s)
        cache, routes = self._prefix.load(cache, routes, slots)
        cache, routes, logits = self._prefill_rows(cache, routes, prompts, cached, capture)
        st = self._decode(self._params, self._rest, cache, routes, logits,
                          self._row_params(b, reqs, prompts, seeds), capture=capture)
        tokens, logprobs, n_gen, stopped, steps = jax.device_get(
            (st.tokens, st.logprobs, st.n_gen, st.stopped, st.steps))
        gens = [int(g) for g in n_gen[:n]]
        fed = [len(p) + g - 1 for p, g in zip(prompts, gens)]  # rows [0, P + G - 1) exist
        rows = self._route_rows(st.routes, reqs, fed)
        self._prefix.store(st.cache, st.routes, [np.concatenate([p, tokens[r, :g - 1]])
                                                 for r, (p, g) in enumerate(zip(prompts, gens))])

        c = self._counters
        c["requests"] += n
        c["batches"] += 1
        c["cached_tokens"] += sum(cached)
        c["generated_tokens"] += sum(gens)
        c["decode_steps"] += int(steps)
        return [GenerateOutput(
            output_ids=tokens[r, :g].tolist(),
            logprobs=logprobs[r, :g].tolist() if req.return_logprobs else None,
            finish_reason="stop" if stopped[r] else "length",
            routed_experts=rows[r], prompt_tokens=len(prompts[r]), cached_tokens=cached[r],
            weight_version=self.weight_version, routed_experts_start=req.routed_experts_prompt_start)
            for r, (req, g) in enumerate(zip(reqs, gens))]

    def _prefill_rows(self, cache, routes, prompts, cached, capture):
        """Feed tokens ``[cached_r, P_r)`` of every row, in chunks of T (a power of two) right-padded
        to the trash slot. Returns (cache, routes, logits [B, V] at each row's last prompt token)."""
        b, s = routes.shape[:2]
        todo = [len(p) - c for p, c in zip(prompts, cached)]
        # the model returns logits at every fed position, [B, T, V] f32: bound that buffer
        t_logits = pow2_at_most(max(16, _LOGITS_BYTES // (4 * b * self.config.vocab_size)))
        t = pow2_at_least(max(todo), lo=16, hi=min(self.prefill_chunk, s, t_logits))
        logits = np.zeros((b, self.config.vocab_size), np.float32)
        chunks = -(-max(todo) // t)
        for ci in range(chunks):
            tokens, positions = np.zeros((b, t), np.int32), np.full((b, t), s - 1, np.int32)
            last = np.full((b,), -1, np.int32)
            for r, (p, c) in enumerate(zip(prompts, cached)):
                lo = c + ci * t
                hi = min(len(p), lo + t)
                if hi > lo:
                    tokens[r, :hi - lo], positions[r, :hi - lo] = p[lo:hi], np.arange(lo, hi)
                    if hi == len(p):
                        last[r] = hi - lo - 1
            cache, routes, logits = self._prefill(self._params, self._rest, cache, routes, tokens,
                                                  positions, last, logits, capture=capture)
        self._counters["prefill_tokens"] += sum(todo)
        self._counters["padded_prefill_tokens"] += chunks * b * t
        return cache, routes, logits

    def _row_params(self, b, reqs, prompts, seeds) -> dev.RowParams:
        n = len(reqs)
        pad = lambda vals, fill, dtype: np.array(list(vals) + [fill] * (b - n), dtype)
        ns = pow2_at_least(max(len(r.stop_token_ids) for r in reqs), lo=4)
        stop_ids = np.full((b, ns), -1, np.int32)
        for r, req in enumerate(reqs):
            stop_ids[r, :len(req.stop_token_ids)] = np.asarray(req.stop_token_ids, np.int64)
        key_data = np.zeros((b, 2), np.uint32)
        key_data[:n] = [seed_words(sd) for sd in seeds]
        field = lambda name, fill, dtype: pad((getattr(r, name) for r in reqs), fill, dtype)
        return dev.RowParams(
            prompt_len=pad(map(len, prompts), 1, np.int32), max_new=field("max_tokens", 1, np.int32),
            live=pad([True] * n, False, np.bool_), temperature=field("temperature", 0.0, np.float32),
            top_k=field("top_k", 0, np.int32), top_p=field("top_p", 1.0, np.float32),
            key_data=key_data, stop_ids=stop_ids)

    def _route_rows(self, routes, reqs, fed) -> list[np.ndarray | None]:
        """Rows [s, P + G - 1) of the requests that asked for them; only that window is transferred."""
        want = [r for r, req in enumerate(reqs) if req.return_routed_experts]
        if not want:
            return [None] * len(reqs)
        b = routes.shape[0]
        start = np.zeros((b,), np.int32)
        for r in want:
            start[r] = reqs[r].routed_experts_prompt_start
        length = pow2_at_least(max(fed[r] - start[r] for r in want), lo=16, hi=routes.shape[1])
        window = np.asarray(self._read(routes, start, length=length))
        return [window[r, :fed[r] - start[r]].copy() if r in want else None for r in range(len(reqs))]


def _cpu_moe_impl(cfg) -> str:
    """Decode on CPU: "loop" (runs only the chosen experts) if this MoeConfig accepts it, else "dense"
    (ragged_dot lowers to a dense masked matmul on CPU: K x the dense kernel's work). Measured in
    experiments/bench_decode.py."""
    try:
        cfg.replace(moe_impl="loop")
        return "loop"
    except ValueError:
        return "dense"


_read_routes = jax.jit(dev.read_routes, static_argnames=("length",))


@functools.lru_cache(maxsize=None)
def _programs(graphdef, cfg, rdtype) -> types.SimpleNamespace:
    """Jitted programs of one model graph, shared by every engine over an equal graph (a rebuilt
    engine, a second engine in the same process) so none compiles twice. Buffers are donated."""
    return types.SimpleNamespace(
        init=jax.jit(functools.partial(dev.init_buffers, cfg, rdtype), static_argnames=("batch", "seq_len")),
        prefill=jax.jit(functools.partial(dev.prefill_chunk, graphdef), static_argnames=("capture",),
                        donate_argnames=("cache", "routes")),
        decode=jax.jit(functools.partial(dev.decode, graphdef), static_argnames=("capture",),
                       donate_argnames=("cache", "routes")))


def _copy(tree, like=None):
    """Own copies of the arrays, so nothing the caller later donates or deletes is shared; placed like
    ``like``'s leaves when given, so new weights never change the compiled programs' input placement."""
    if like is None:
        return jax.tree.map(lambda x: jax.device_put(x, may_alias=False), tree)
    return jax.tree.map(lambda x, old: jax.device_put(x, old.sharding, may_alias=False), tree, like)
