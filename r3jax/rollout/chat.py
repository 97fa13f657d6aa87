"""Multi-turn rollouts through an OpenAI chat endpoint (``/v1/chat/completions``), routes kept aligned.

A chat harness sends messages and the server renders the whole conversation with its chat template
every turn. Route rows belong to absolute token positions, so R3's incremental trace (each turn asks
only for the rows after those it holds, ``routed_experts_prompt_start`` = s) is right only while the
rendering keeps every earlier token. Many templates do not: Qwen3's drops earlier turns' reasoning, and
a reply re-tokenized from its text need not be the ids the model sampled. So before each turn a
:class:`ChatEpisode` asks the server's chat ``/tokenize`` for the rendering, finds the first token d
where it differs from the tokens recorded, drops the tokens and rows from d on, and asks for the rows
from ``min(s, d)``: re-rendered tokens get their rows again, never a misaligned row. The turn says so
in ``TurnStats.rerendered_from``; ``on_prefix_break="raise"`` raises
:class:`~r3jax.rollout.env.PrefixMismatchError` instead. Generated tokens that a re-rendering replaced
are no longer in the trajectory, so they are not trained on (their replacement is prompt, loss 0).
Token-in, token-out requests (the other drivers) never re-render and need none of this.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from r3jax.rollout.concurrent import drive_all
from r3jax.rollout.env import check_prefix
from r3jax.rollout.episode import MissingRoutesError
from r3jax.rollout.sampling import request_seed
from r3jax.rollout.trajectory import Trajectory, TurnStats
from r3jax.routes import route_dtype, uncaptured_rows
from r3jax.trace import RoutedExpertTrace

ON_PREFIX_BREAK = ("resend", "raise")


@runtime_checkable
class ChatEnv(Protocol):
    """``reset(seed) -> messages``; ``step(assistant message) -> (new messages, reward, done)``.

    Messages are OpenAI's ``{role, content}`` dicts (``tool_calls`` / ``tool_call_id`` where the
    template takes tools). ``step`` gets the assistant message as the server parsed it (``content``,
    and ``tool_calls`` when the server has a tool-call parser) and returns the user or tool messages
    that follow it. Optional attributes: ``tools`` (sent with every turn) and ``stop_token_ids``.
    """

    def reset(self, seed: int) -> Sequence[Mapping[str, Any]]: ...

    def step(self, message: Mapping[str, Any]) -> tuple[Sequence[Mapping[str, Any]], float, bool]: ...


def _messages(value: Any, what: str) -> list[dict]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"env.{what} returned {type(value).__name__}: expected a list of {{role, content}} dicts")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"env.{what} message {i} is {m!r}: expected a {{role, content}} dict")
        out.append(dict(m))
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class ChatEpisode:
    """One chat trajectory in flight: ``prepare(rendered ids) -> ChatRequest`` (None when the next turn
    does not fit), ``achat`` it, ``consume(output)``, until ``finished``. ``loop`` supplies the settings
    (an :class:`~r3jax.rollout.agent_loop.AgentLoop` with ``chat=True``)."""

    def __init__(self, loop: Any, group: int, sample: int, env_seed: int, with_routes: bool):
        self.loop, self.group, self.sample, self.env_seed = loop, group, sample, env_seed
        self.with_routes = with_routes
        self.env = loop.env_factory()
        self.messages = _messages(self.env.reset(env_seed), f"reset({env_seed})")
        if not self.messages:
            raise ValueError(f"env.reset({env_seed}) returned no messages: expected at least one")
        tools = getattr(self.env, "tools", None)
        self.tools = None if tools is None else [dict(t) for t in tools]
        stops = loop.sampling.stop_token_ids
        self.stops = tuple(getattr(self.env, "stop_token_ids", ()) if stops is None else stops)
        self.session = f"{loop.session_prefix}-{group}-{sample}"
        self.tokens: list[int] = []
        self.loss: list[float] = []
        self.logp: list[float] = []
        self.prompt_len: int | None = None
        self.trace = RoutedExpertTrace(loop.info["moe_layer_ids"])
        self.turns: list[TurnStats] = []
        self.rewards: list[float] = []
        self.finish_reason: str | None = None
        self._start, self._rerendered = 0, None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _where(self) -> str:
        return f"turn {len(self.turns)} of chat trajectory (group {self.group}, sample {self.sample})"

    def prepare(self, rendered: Sequence[int]):
        """The next turn's :class:`~r3jax.serve.client.ChatRequest`, given the server's rendering of
        ``messages`` (its chat ``/tokenize``); None (``finish_reason`` "max_seq_len") when the rendering
        leaves no room for a generated token."""
        from r3jax.serve.client.chat import ChatRequest

        loop = self.loop
        rendered = [int(t) for t in rendered]
        v = loop.info["vocab_size"]
        if not rendered or any(not 0 <= t < v for t in rendered):
            raise ValueError(f"{self._where()}: the rendered prompt has {len(rendered)} tokens: expected at "
                             f"least one, ids in [0, vocab_size={v})")
        room = loop.max_seq_len - len(rendered)
        if room < 1:
            self.finish_reason = "max_seq_len"
            return None
        d = common_prefix(rendered, self.tokens)
        self._rerendered = None
        if d < len(self.tokens):  # the template rewrote tokens already in the trajectory
            if loop.on_prefix_break == "raise":
                check_prefix(self.tokens, rendered, self.trace.prompt_start)
            self._rerendered = d
            del self.tokens[d:], self.loss[d:], self.logp[d:]
            if self.trace.prompt_start > d:
                self.trace = self.trace.truncate(d)
            self.prompt_len = min(self.prompt_len, d)
        new = rendered[len(self.tokens):]
        if self.turns:
            self.turns[-1] = dataclasses.replace(self.turns[-1], observation_tokens=len(new))
        self.tokens += new
        self.loss += [0.0] * len(new)
        self.logp += [0.0] * len(new)
        if self.prompt_len is None:
            self.prompt_len = len(rendered)
        self._start = 0 if loop.full_regather else self.trace.prompt_start
        s = loop.sampling
        return ChatRequest(messages=list(self.messages), tools=self.tools, max_tokens=min(s.max_tokens, room),
                           temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                           seed=request_seed(loop.seed, self.group, self.sample, len(self.turns)),
                           stop_token_ids=self.stops, return_logprobs=True, return_routed_experts=self.with_routes,
                           routed_experts_prompt_start=self._start, session_id=self.session,
                           logprobs_mode=s.logprobs_mode)

    def _record(self, out: Any, p: int, g: int) -> tuple[int, int]:
        if not self.with_routes:
            return 0, 0
        if out.routed_experts is None:
            raise MissingRoutesError(f"{self._where()}: the server returned no routed_experts "
                                     "although return_routed_experts=True")
        if out.routed_experts_start != self._start:
            raise MissingRoutesError(f"{self._where()}: routes start at row {out.routed_experts_start}, "
                                     f"expected routed_experts_prompt_start={self._start}")
        routes = np.asarray(out.routed_experts)
        base = RoutedExpertTrace(self.trace.moe_layer_ids) if self.loop.full_regather else self.trace
        self.trace = base.record(prompt_len=p, generated_len=g, routes=routes,
                                 versions=getattr(out, "weight_versions", ()) or out.weight_version)
        return int(routes.shape[0]), int(routes.nbytes)

    def consume(self, out: Any) -> None:
        """Append a :class:`~r3jax.serve.client.ChatOutput` of the request :meth:`prepare` made."""
        loop, p = self.loop, len(self.tokens)
        if list(out.prompt_ids) != self.tokens:
            i = common_prefix(out.prompt_ids, self.tokens)
            raise ValueError(f"{self._where()}: the chat answer's prompt_token_ids ({len(out.prompt_ids)} tokens) "
                             f"differ from /tokenize's rendering ({p} tokens) at token {i}: the server must "
                             "render a conversation the same way on both endpoints")
        ids = [int(t) for t in out.output_ids]
        g = len(ids)
        if out.logprobs is None or len(out.logprobs) != g:
            raise ValueError(f"{self._where()}: {0 if out.logprobs is None else len(out.logprobs)} logprobs "
                             f"for {g} generated tokens")
        rows, nbytes = self._record(out, p, g)
        self.tokens += ids
        self.loss += [1.0] * g
        self.logp += [float(x) for x in out.logprobs]
        message = out.message
        self.messages.append(message)
        new, reward, done = self.env.step(dict(message))
        self.rewards.append(float(reward))
        if done:
            self.finish_reason = "done"
        elif len(self.turns) + 1 >= loop.max_turns:
            self.finish_reason = "max_turns"
        else:
            self.messages += _messages(new, "step")
        self.turns.append(TurnStats(
            routes_start=self._start, route_rows=rows, route_bytes=nbytes, prompt_tokens=p,
            cached_tokens=None if out.cached_tokens is None else int(out.cached_tokens), generated_tokens=g,
            observation_tokens=0, finish_reason=str(out.finish_reason), weight_version=int(out.weight_version),
            reward=float(reward), synthetic_eos=False, rerendered_from=self._rerendered))

    def result(self) -> Trajectory:
        info, n = self.loop.info, len(self.tokens)
        if not self.turns:
            raise ValueError(f"{self._where()}: the first rendered prompt left no room to generate "
                             f"(max_seq_len={self.loop.max_seq_len})")
        p0 = self.prompt_len
        loss = np.asarray(self.loss, np.float32)
        if self.with_routes:
            routes, captured = self.trace.finalize(token_count=n, loss_mask=loss)
        else:
            routes = uncaptured_rows(n, len(info["moe_layer_ids"]), info["top_k"],
                                     route_dtype(info["num_experts"])).copy()
            captured = np.zeros(n, bool)
        versions = [t.weight_version for t in self.turns]
        return Trajectory(
            prompt_ids=np.asarray(self.tokens[:p0], np.int32), response_ids=np.asarray(self.tokens[p0:], np.int32),
            response_loss_mask=loss[p0:], response_logprobs=np.asarray(self.logp[p0:], np.float32),
            routes=routes, captured=captured, reward=float(sum(self.rewards)), turn_rewards=tuple(self.rewards),
            turns=tuple(self.turns), weight_version=versions[0], weight_version_changed=len(set(versions)) > 1,
            finish_reason=self.finish_reason, group=self.group, sample=self.sample, env_seed=self.env_seed,
            moe_layer_ids=tuple(info["moe_layer_ids"]), route_versions=self.trace.row_versions(n))  # all -1 without routes


async def drive_chat(episodes: Sequence[ChatEpisode], client: Any, max_concurrency: int) -> None:
    """Run every chat episode to its end against ``client`` (``atokenize_chat`` + ``achat``: a
    :class:`~r3jax.serve.RemoteInferenceClient`); the first failure cancels the others and is raised."""
    sem = asyncio.Semaphore(max_concurrency)

    async def drive(e: ChatEpisode) -> None:
        while not e.finished:
            async with sem:
                rendered = await client.atokenize_chat(e.messages, e.tools, session_id=e.session)
                request = e.prepare(rendered)
                if request is None:
                    return
                outs = await client.achat([request])
            if len(outs) != 1:
                raise ValueError(f"achat returned {len(outs)} outputs for 1 request")
            e.consume(outs[0])

    await drive_all(episodes, drive)
