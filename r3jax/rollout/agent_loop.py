"""The multi-turn agent loop: many trajectories in flight, routes gathered incrementally.

Every turn of a trajectory sends the whole conversation with ``routed_experts_prompt_start =
trace.prompt_start``, so the generator returns only the route rows it has not sent before and the
trajectory's :class:`RoutedExpertTrace` grows by exactly those rows: every token's routes cross the
wire once, O(N) in total instead of O(N^2) (DESIGN.md §1). ``full_regather=True`` sends start 0 and
keeps only the last turn's rows: the baseline for experiments and tests.

Against the in-process engine (a plain ``generate``), the turns of all live trajectories go in one
batch per round. Against :class:`RemoteInferenceClient` (``agenerate``), each trajectory is an
asyncio task and at most ``max_concurrency`` requests are in flight; the server batches them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from r3jax.engine import GenerateRequest
from r3jax.rollout.env import Env, FullPrompt, check_prefix
from r3jax.rollout.trajectory import Trajectory, TurnStats
from r3jax.routes import route_dtype, uncaptured_rows
from r3jax.trace import RoutedExpertTrace


class MissingRoutesError(ValueError):
    """The generator returned no (or misplaced) routes although they were asked for."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-turn sampling. ``stop_token_ids=None`` takes the environment's ``stop_token_ids``."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ValueError(f"sampling.max_tokens={mt!r}: expected an int >= 1")


def describe(generator: Any) -> dict:
    """``num_experts, top_k, moe_layer_ids, vocab_size, max_seq_len`` of an engine or a client."""
    if callable(getattr(generator, "model_info", None)):
        info = dict(generator.model_info())
    elif hasattr(generator, "config"):
        cfg = generator.config
        info = {"num_experts": cfg.num_experts, "top_k": cfg.top_k, "vocab_size": cfg.vocab_size,
                "moe_layer_ids": list(generator.moe_layer_ids), "max_seq_len": generator.max_seq_len}
    else:
        raise ValueError(f"generator: {type(generator).__name__} has neither model_info() nor "
                         f"config; expected an Engine or a RemoteInferenceClient")
    missing = [k for k in ("num_experts", "top_k", "moe_layer_ids", "vocab_size", "max_seq_len")
               if k not in info]
    if missing:
        raise ValueError(f"generator model info lacks {missing}")
    info["moe_layer_ids"] = tuple(int(i) for i in info["moe_layer_ids"])
    return info


def _seed(*parts: int) -> int:
    """A request/env seed in [0, 2**31) from a tuple of ints (stable across runs and batchings)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


class _Rollout:
    """One trajectory in flight: ``request()`` → generator → ``consume(output)``, until ``finished``."""

    def __init__(self, loop: "AgentLoop", group: int, sample: int, env_seed: int, with_routes: bool):
        self.loop, self.group, self.sample, self.env_seed = loop, group, sample, env_seed
        self.with_routes = with_routes
        self.env: Env = loop.env_factory()
        prompt = [int(t) for t in self.env.reset(env_seed)]
        self._check_tokens(prompt, "reset")
        if not 0 < len(prompt) < loop.max_seq_len:
            raise ValueError(f"env.reset({env_seed}) gave a prompt of {len(prompt)} tokens: expected "
                             f"1 .. max_seq_len - 1 = {loop.max_seq_len - 1}")
        stops = loop.sampling.stop_token_ids
        self.stops = tuple(getattr(self.env, "stop_token_ids", ()) if stops is None else stops)
        self.eos = getattr(self.env, "eos_id", self.stops[0] if self.stops else None)
        self.prompt_len = len(prompt)
        self.tokens, self.loss, self.logp = prompt, [0.0] * len(prompt), [0.0] * len(prompt)
        self.trace = RoutedExpertTrace(loop.info["moe_layer_ids"])
        self.turns: list[TurnStats] = []
        self.rewards: list[float] = []
        self.finish_reason: str | None = None
        self._start = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _where(self) -> str:
        return f"turn {len(self.turns)} of trajectory (group {self.group}, sample {self.sample})"

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        v = self.loop.info["vocab_size"]
        bad = [t for t in tokens if not 0 <= t < v]
        if bad:
            raise ValueError(f"env.{what} returned token id {bad[0]}: expected ids in [0, vocab_size={v})")

    def request(self) -> GenerateRequest:
        loop = self.loop
        self._start = 0 if loop.full_regather else self.trace.prompt_start
        room = loop.max_seq_len - len(self.tokens)
        s = loop.sampling
        return GenerateRequest(
            prompt_ids=list(self.tokens), max_tokens=min(s.max_tokens, room),
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=_seed(loop.seed, self.group, self.sample, len(self.turns)),
            stop_token_ids=self.stops, return_logprobs=True,
            return_routed_experts=self.with_routes,
            routed_experts_prompt_start=self._start,
            session_id=f"{loop.session_prefix}-{self.group}-{self.sample}")

    def _record(self, out: Any, p: int, g: int) -> tuple[int, int]:
        """Append this call's rows to the trace; returns (rows, bytes) received."""
        if not self.with_routes:
            return 0, 0
        routes = out.routed_experts
        if routes is None:
            raise MissingRoutesError(f"{self._where()}: the generator returned no routed_experts "
                                     f"although return_routed_experts=True")
        start = getattr(out, "routed_experts_start", self._start)
        if start != self._start:
            raise MissingRoutesError(f"{self._where()}: routes start at row {start}, expected "
                                     f"routed_experts_prompt_start={self._start}")
        routes = np.asarray(routes)
        base = RoutedExpertTrace(self.trace.moe_layer_ids) if self.loop.full_regather else self.trace
        self.trace = base.record(prompt_len=p, generated_len=g, routes=routes)
        return int(routes.shape[0]), int(routes.nbytes)

    def consume(self, out: Any) -> None:
        loop, p = self.loop, len(self.tokens)
        ids = [int(t) for t in out.output_ids]
        g = len(ids)
        if g == 0:
            raise ValueError(f"{self._where()}: the generator returned no tokens")
        logprobs = out.logprobs
        if logprobs is None or len(logprobs) != g:
            raise ValueError(f"{self._where()}: {0 if logprobs is None else len(logprobs)} logprobs "
                             f"for {g} generated tokens")
        rows, nbytes = self._record(out, p, g)
        self.tokens += ids
        self.loss += [1.0] * g
        self.logp += [float(x) for x in logprobs]
        synthetic = (ids[-1] not in self.stops and self.eos is not None
                     and len(self.tokens) < loop.max_seq_len)
        if synthetic:  # close the cut-off turn so the next prompt keeps the chat format
            self.tokens.append(int(self.eos))
            self.loss.append(0.0)
            self.logp.append(0.0)
        obs, reward, done = self.env.step(ids)
        self.rewards.append(float(reward))
        appended = 0
        if done:
            self.finish_reason = "done"
        elif len(self.turns) + 1 >= loop.max_turns:
            self.finish_reason = "max_turns"
        else:
            if isinstance(obs, FullPrompt):
                check_prefix(self.tokens, obs.tokens, self.trace.prompt_start)
                new = list(obs.tokens[len(self.tokens):])
            else:
                new = [int(t) for t in obs]
            self._check_tokens(new, "step")
            # The next turn needs room for the observation and at least one generated token.
            if len(self.tokens) + len(new) >= loop.max_seq_len:
                self.finish_reason = "max_seq_len"
            else:
                self.tokens += new
                self.loss += [0.0] * len(new)
                self.logp += [0.0] * len(new)
                appended = len(new)
        self.turns.append(TurnStats(
            routes_start=self._start, route_rows=rows, route_bytes=nbytes, prompt_tokens=p,
            cached_tokens=int(getattr(out, "cached_tokens", 0) or 0), generated_tokens=g,
            observation_tokens=appended, finish_reason=str(out.finish_reason),
            weight_version=int(getattr(out, "weight_version", 0) or 0), reward=float(reward),
            synthetic_eos=synthetic))

    def result(self) -> Trajectory:
        info, n, p0 = self.loop.info, len(self.tokens), self.prompt_len
        loss = np.asarray(self.loss, np.float32)
        if self.with_routes:
            routes, captured = self.trace.finalize(token_count=n, loss_mask=loss)
        else:  # rows the trainer must route live: captured False, filled with 0..K-1
            k, num_layers = info["top_k"], len(info["moe_layer_ids"])
            routes = uncaptured_rows(n, num_layers, k, route_dtype(info["num_experts"])).copy()
            captured = np.zeros(n, bool)
        versions = [t.weight_version for t in self.turns]
        return Trajectory(
            prompt_ids=np.asarray(self.tokens[:p0], np.int32),
            response_ids=np.asarray(self.tokens[p0:], np.int32),
            response_loss_mask=loss[p0:], response_logprobs=np.asarray(self.logp[p0:], np.float32),
            routes=routes, captured=captured, reward=float(sum(self.rewards)),
            turn_rewards=tuple(self.rewards), turns=tuple(self.turns), weight_version=versions[0],
            weight_version_changed=len(set(versions)) > 1, finish_reason=self.finish_reason,
            group=self.group, sample=self.sample, env_seed=self.env_seed,
            moe_layer_ids=tuple(info["moe_layer_ids"]))


class AgentLoop:
    """Runs multi-turn rollouts of ``env_factory()`` environments against ``generator``.

    generator: the in-process ``Engine`` or a ``RemoteInferenceClient`` (or anything with the
    same ``generate``/``agenerate``). ``mode``: ``"auto"`` (async if the generator has
    ``agenerate``), ``"batched"`` or ``"async"``. ``max_seq_len`` bounds each trajectory (<= the
    generator's). ``seed`` fixes env seeds and per-request sampling seeds, so a run is reproducible
    whatever the batching. ``return_routed_experts=False`` samples without routes (captured all
    False).
    """

    def __init__(self, generator: Any, env_factory: Callable[[], Env], *, max_turns: int,
                 max_seq_len: int, sampling: SamplingParams | dict | None = None,
                 full_regather: bool = False, return_routed_experts: bool = True,
                 max_concurrency: int = 64, mode: str = "auto", seed: int = 0,
                 session_prefix: str = "r3"):
        for name, v in (("max_turns", max_turns), ("max_seq_len", max_seq_len),
                        ("max_concurrency", max_concurrency)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "max_seq_len" else 1):
                raise ValueError(f"{name}={v!r}: expected an int >= {2 if name == 'max_seq_len' else 1}")
        if mode not in ("auto", "batched", "async"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'batched' or 'async'")
        if mode == "async" and not hasattr(generator, "agenerate"):
            raise ValueError(f"mode='async': generator {type(generator).__name__} has no agenerate")
        self.generator, self.env_factory = generator, env_factory
        self.max_turns, self.max_seq_len = max_turns, max_seq_len
        if isinstance(sampling, dict):
            sampling = SamplingParams(**sampling)
        self.sampling = sampling or SamplingParams()
        self.full_regather, self.return_routed_experts = full_regather, return_routed_experts
        self.max_concurrency, self.seed, self.session_prefix = max_concurrency, seed, session_prefix
        self.mode = ("async" if hasattr(generator, "agenerate") else "batched") if mode == "auto" else mode
        self._info: dict | None = None
        self._next_group = 0
        self._aio: asyncio.AbstractEventLoop | None = None

    @property
    def info(self) -> dict:
        """The generator's model info (fetched once; ``max_seq_len`` checked against ours)."""
        if self._info is None:
            info = describe(self.generator)
            if self.max_seq_len > info["max_seq_len"]:
                raise ValueError(f"max_seq_len={self.max_seq_len}: expected <= the generator's "
                                 f"max_seq_len={info['max_seq_len']}")
            self._info = info
        return self._info

    def _rollouts(self, n_prompts: int, samples_per_prompt: int, env_seeds,
                  with_routes: bool) -> list[_Rollout]:
        for name, v in (("n_prompts", n_prompts), ("samples_per_prompt", samples_per_prompt)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an int >= 1")
        if env_seeds is not None and len(env_seeds) != n_prompts:
            raise ValueError(f"env_seeds has {len(env_seeds)} seeds: expected n_prompts={n_prompts}")
        groups = range(self._next_group, self._next_group + n_prompts)
        self._next_group += n_prompts
        seeds = env_seeds if env_seeds is not None else [_seed(self.seed, 1 << 30, g) for g in groups]
        self.info  # fetch (and check) before building environments
        return [_Rollout(self, g, s, int(es), with_routes) for g, es in zip(groups, seeds)
                for s in range(samples_per_prompt)]

    def run(self, n_prompts: int, samples_per_prompt: int = 1, *,
            env_seeds: Sequence[int] | None = None) -> list[Trajectory]:
        """``n_prompts`` environments × ``samples_per_prompt`` samples each, ordered by prompt then
        sample (samples of a prompt share ``group`` and env seed). New env seeds every call unless
        ``env_seeds`` is given. Not callable from a running event loop: use :meth:`arun` there."""
        if self.mode == "async":
            # One event loop for all runs, so the client's per-loop HTTP connections are reused.
            if self._aio is None or self._aio.is_closed():
                self._aio = asyncio.new_event_loop()
            return self._aio.run_until_complete(self.arun(n_prompts, samples_per_prompt, env_seeds=env_seeds))
        rollouts = self._rollouts(n_prompts, samples_per_prompt, env_seeds, self.return_routed_experts)
        self._drive_batched(rollouts, self._generate_batched)
        return [r.result() for r in rollouts]

    def close(self) -> None:
        """Close the event loop :meth:`run` uses in async mode, and the generator's connections
        opened from it (``aclose``); the generator stays usable."""
        if self._aio is not None and not self._aio.is_closed():
            if hasattr(self.generator, "aclose"):
                self._aio.run_until_complete(self.generator.aclose())
            self._aio.close()

    def __enter__(self) -> "AgentLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def arun(self, n_prompts: int, samples_per_prompt: int = 1, *,
                   env_seeds: Sequence[int] | None = None) -> list[Trajectory]:
        """:meth:`run` from inside an event loop (requires ``agenerate``)."""
        if not hasattr(self.generator, "agenerate"):
            raise ValueError(f"arun: generator {type(self.generator).__name__} has no agenerate")
        if self._info is None:
            self._info = await asyncio.to_thread(lambda: self.info)
        rollouts = self._rollouts(n_prompts, samples_per_prompt, env_seeds, self.return_routed_experts)
        sem = asyncio.Semaphore(self.max_concurrency)

        async def drive(r: _Rollout) -> None:
            while not r.finished:
                req = r.request()
                async with sem:
                    outs = await self.generator.agenerate([req])
                if len(outs) != 1:
                    raise ValueError(f"generator returned {len(outs)} outputs for 1 request")
                r.consume(outs[0])

        tasks = [asyncio.create_task(drive(r)) for r in rollouts]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [r.result() for r in rollouts]

    def _generate_batched(self, rollouts: list[_Rollout], requests: list[GenerateRequest]) -> list:
        size = getattr(self.generator, "max_batch_size", None) or len(requests)
        outs = []
        for i in range(0, len(requests), size):
            chunk = requests[i:i + size]
            got = list(self.generator.generate(chunk))
            if len(got) != len(chunk):
                raise ValueError(f"generator returned {len(got)} outputs for {len(chunk)} requests")
            outs += got
        return outs

    @staticmethod
    def _drive_batched(rollouts: list[_Rollout], generate) -> None:
        live = [r for r in rollouts if not r.finished]
        while live:
            requests = [r.request() for r in live]
            for r, out in zip(live, generate(live, requests)):
                r.consume(out)
            live = [r for r in live if not r.finished]

    def demonstrations(self, n_prompts: int, *, env_seeds: Sequence[int] | None = None) -> list[Trajectory]:
        """Oracle trajectories for a supervised warm-up: each turn's action is the environment's
        ``reference_action()`` (cut at ``max_tokens``), in the same token format as :meth:`run`.
        ``loss_mask`` is 1 on the oracle's tokens; logprobs are 0 and no routes are captured."""
        rollouts = self._rollouts(n_prompts, 1, env_seeds, with_routes=False)

        def oracle(live, requests):
            outs = []
            for r, q in zip(live, requests):
                ids = [int(t) for t in r.env.reference_action()][:q.max_tokens]
                stop = next((j for j, t in enumerate(ids) if t in q.stop_token_ids), None)
                ids = ids if stop is None else ids[:stop + 1]
                outs.append(_Output(ids, [0.0] * len(ids), "length" if stop is None else "stop"))
            return outs

        self._drive_batched(rollouts, oracle)
        return [r.result() for r in rollouts]


@dataclasses.dataclass(frozen=True)
class _Output:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: None = None
    cached_tokens: int = 0
    weight_version: int = 0

