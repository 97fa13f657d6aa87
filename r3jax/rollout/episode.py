"""One multi-turn trajectory in flight: the conversation so far, its routed-expert trace growing by
exactly the rows each turn returns, and the environment it talks to.

Every turn sends the whole conversation with ``routed_experts_prompt_start = trace.prompt_start``,
so the generator returns only the route rows it has not sent before: every token's routes cross the
wire once, O(N) in total instead of O(N^2) (docs/design.md §1). ``full_regather`` sends start 0 and keeps
only the last turn's rows: the baseline for experiments and tests.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3jax.engine import GenerateRequest
from r3jax.rollout.env import Env, FullPrompt, check_prefix
from r3jax.rollout.sampling import request_seed
from r3jax.rollout.trajectory import Trajectory, TurnStats
from r3jax.routes import route_dtype, uncaptured_rows
from r3jax.trace import RoutedExpertTrace


class MissingRoutesError(ValueError):
    """The generator returned no (or misplaced) routes although they were asked for."""


class Episode:
    """One trajectory in flight: ``request()`` → generator → ``consume(output)``, until ``finished``.

    ``loop`` supplies the settings (an :class:`~r3jax.rollout.agent_loop.AgentLoop`): ``env_factory``,
    ``info``, ``sampling``, ``max_turns``, ``max_seq_len``, ``full_regather``, ``seed``, ``session_prefix``."""

    def __init__(self, loop: Any, group: int, sample: int, env_seed: int, with_routes: bool):
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
        self.turn = 0  # environment turns completed (a turn an update aborted takes several calls)
        self.partial: list[int] = []  # the current turn's tokens from calls a weight update aborted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _where(self) -> str:
        return f"turn {self.turn} of trajectory (group {self.group}, sample {self.sample})"

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
        # an aborted turn goes on from its tokens so far: the rest of its budget, its own seed
        parts = (self.turn,) if not self.partial else (self.turn, len(self.partial))
        return GenerateRequest(
            prompt_ids=list(self.tokens), max_tokens=min(s.max_tokens - len(self.partial), room),
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=request_seed(loop.seed, self.group, self.sample, *parts),
            stop_token_ids=self.stops, return_logprobs=True,
            return_routed_experts=self.with_routes,
            routed_experts_prompt_start=self._start,
            session_id=f"{loop.session_prefix}-{self.group}-{self.sample}", logprobs_mode=s.logprobs_mode)

    def _record(self, out: Any, p: int, g: int) -> tuple[int, int]:
        """Append this call's rows to the trace; returns (rows, bytes) received."""
        if not self.with_routes:
            return 0, 0
        routes = out.routed_experts
        if routes is None:
            raise MissingRoutesError(f"{self._where()}: the generator returned no routed_experts "
                                     f"although return_routed_experts=True")
        start = out.routed_experts_start
        if start != self._start:
            raise MissingRoutesError(f"{self._where()}: routes start at row {start}, expected "
                                     f"routed_experts_prompt_start={self._start}")
        routes = np.asarray(routes)
        base = RoutedExpertTrace(self.trace.moe_layer_ids) if self.loop.full_regather else self.trace
        self.trace = base.record(prompt_len=p, generated_len=g, routes=routes,
                                 versions=getattr(out, "weight_versions", ()) or out.weight_version)
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
        stats = dict(routes_start=self._start, route_rows=rows, route_bytes=nbytes, prompt_tokens=p,
                     cached_tokens=None if out.cached_tokens is None else int(out.cached_tokens), generated_tokens=g,
                     weight_version=int(out.weight_version),
                     weight_versions=tuple((int(i), int(v)) for i, v in getattr(out, "weight_versions", ())))
        room = len(self.partial) + g < loop.sampling.max_tokens and len(self.tokens) < loop.max_seq_len
        if out.finish_reason == "abort" and room:
            # a weight update returned this call's tokens mid-turn: the turn goes on from them (its rows
            # stay the version that computed them); the environment sees the whole turn when it ends
            self.partial += ids
            self.turns.append(TurnStats(**stats, observation_tokens=0, finish_reason="abort", reward=0.0,
                                        synthetic_eos=False))
            return
        ids, self.partial = self.partial + ids, []
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
        elif self.turn + 1 >= loop.max_turns:
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
        self.turn += 1
        self.turns.append(TurnStats(**stats, observation_tokens=appended, finish_reason=str(out.finish_reason),
                                    reward=float(reward), synthetic_eos=synthetic))

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
            moe_layer_ids=tuple(info["moe_layer_ids"]), route_versions=self.trace.row_versions(n))  # all -1 without routes
