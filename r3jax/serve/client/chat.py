"""The client side of OpenAI chat: a :class:`ChatRequest` (messages instead of prompt ids) sent to
``POST /v1/chat/completions`` with ``return_token_ids``, and the :class:`ChatOutput` read back, whose
``prompt_ids`` are the server's rendering of the messages (its chat template).

Route rows follow the same rule as every other form: ``routed_experts_prompt_start`` = s asks for the
rows of positions ``[s, P + G - 1)`` of the *rendered* prompt. A harness can only ask for s > 0 safely
when the rendering of the conversation so far is unchanged (a prefix-stable template); the agent loop
(:mod:`r3jax.rollout.chat`) checks that with ``POST /tokenize`` before each turn.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from r3jax.checks import DEFAULT_LOGPROBS_MODE, check_int
from r3jax.engine.request import GenerateOutput
from r3jax.serve.peers import common, vllm
from r3jax.serve.protocol import ProtocolError, logprobs_mode_field


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One chat turn: ``messages`` (``[{role, content, ...}]``, OpenAI's form) and optional ``tools``,
    with :class:`~r3jax.engine.GenerateRequest`'s sampling and route fields."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    return_logprobs: bool = True
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0
    session_id: str | None = None
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    def __post_init__(self):
        if isinstance(self.messages, (str, bytes)) or not isinstance(self.messages, Sequence) or not self.messages:
            raise ValueError(f"messages={self.messages!r}: expected a non-empty list of {{role, content}} dicts")
        for i, m in enumerate(self.messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"messages[{i}]={m!r}: expected a {{role, content}} dict")


@dataclasses.dataclass(frozen=True, eq=False)
class ChatOutput(GenerateOutput):
    """A :class:`~r3jax.engine.GenerateOutput` (rows counted against ``prompt_ids``) plus what only a
    chat answer has: ``prompt_ids`` (the server's rendering of the messages, ``prompt_token_ids``),
    the assistant message's ``content`` and parsed ``tool_calls``."""

    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    content: str | None = None
    tool_calls: list = dataclasses.field(default_factory=list)

    @property
    def message(self) -> dict:
        """The assistant message to append to the conversation (OpenAI's form)."""
        msg = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = list(self.tool_calls)
        return msg


def chat_body(request: ChatRequest, *, model: str | None) -> dict:
    """The ``/v1/chat/completions`` body for ``request`` (token ids back via ``return_token_ids``)."""
    body = {"messages": [dict(m) for m in request.messages], "max_tokens": int(request.max_tokens),
            "temperature": float(request.temperature), "top_p": float(request.top_p), "top_k": int(request.top_k),
            "stop_token_ids": [int(t) for t in request.stop_token_ids], "logprobs": bool(request.return_logprobs),
            "return_token_ids": True, "return_routed_experts": bool(request.return_routed_experts),
            "routed_experts_prompt_start": check_int("routed_experts_prompt_start", request.routed_experts_prompt_start, 0),
            **logprobs_mode_field(request)}
    if model is not None:
        body["model"] = model
    if request.tools is not None:
        body["tools"] = [dict(t) for t in request.tools]
    if request.seed is not None:
        body["seed"] = int(request.seed)
    if request.session_id is not None:
        body["session_id"] = request.session_id
    return body


def parse_chat_response(content: bytes | str | Mapping, request: ChatRequest, *, num_experts: int, num_layers: int,
                        top_k: int, vocab_size: int | None = None, where: str = "chat") -> ChatOutput:
    """A ``/v1/chat/completions`` answer → :class:`ChatOutput`, rows checked against the rendered prompt."""
    with common.reading(where, "/v1/chat/completions response"):
        obj = json.loads(content) if isinstance(content, (bytes, str)) else content
        prompt = obj.get("prompt_token_ids")
        if not isinstance(prompt, list) or not prompt or any(not isinstance(t, int) or isinstance(t, bool)
                                                             for t in prompt):
            raise ProtocolError(f"{where}: prompt_token_ids {str(prompt)[:80]}: expected the rendered prompt's "
                                "ids (the server must honour return_token_ids)", "prompt_token_ids")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
            raise ProtocolError(f"{where}: prompt_token_ids: expected ids in [0, {vocab_size})", "prompt_token_ids")
        choice = obj["choices"][0]
        ids = common.output_ids(choice["token_ids"], request, vocab_size, where)
        lps = None
        if request.return_logprobs:
            entries = (choice.get("logprobs") or {}).get("content")
            values = [e.get("logprob") for e in entries] if isinstance(entries, list) else entries
            lps = common.logprob_list(values, len(ids), where)
        s = int(request.routed_experts_prompt_start)
        if s > len(prompt):
            raise ProtocolError(f"{where}: routed_experts_prompt_start={s} is past the rendered prompt's "
                                f"{len(prompt)} tokens", "routed_experts_prompt_start")
        routes = None
        if request.return_routed_experts:
            if choice.get("routed_experts") is None:
                raise ProtocolError(f"{where}: routed_experts missing (is the server started with "
                                    "--enable-return-routed-experts?)")
            rendered = SimpleNamespace(prompt_ids=prompt, routed_experts_prompt_start=s)
            routes = common.route_rows(vllm.decode_routes(choice["routed_experts"], num_experts), rendered, len(ids),
                                       num_experts=num_experts, num_layers=num_layers, top_k=top_k, where=where)
        reason = choice.get("finish_reason")
        message = choice.get("message") or {}
        calls = message.get("tool_calls") or []
        finish = "stop" if reason == "tool_calls" else common.finish(reason, where, abort=False)
        cached = vllm.cached_tokens(obj.get("usage"), where)
        spans = common.read_span_list(choice.get("weight_versions"), len(ids), where)
    return ChatOutput(output_ids=ids, logprobs=lps, finish_reason=finish, routed_experts=routes,
                      prompt_tokens=len(prompt), cached_tokens=cached, weight_version=common.UNKNOWN_VERSION,
                      routed_experts_start=s, prompt_ids=[int(t) for t in prompt], content=message.get("content"),
                      tool_calls=list(calls), weight_versions=spans)


def tokenize_body(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                  model: str | None) -> dict:
    """vLLM's chat ``/tokenize`` body: the ids ``/v1/chat/completions`` would prompt with."""
    body = {"messages": [dict(m) for m in messages], "add_generation_prompt": True}
    if tools is not None:
        body["tools"] = [dict(t) for t in tools]
    if model is not None:
        body["model"] = model
    return body


def parse_tokenize_response(content: bytes | str, vocab_size: int | None, where: str) -> list[int]:
    with common.reading(where, "/tokenize response"):
        tokens = json.loads(content)["tokens"]
        if not isinstance(tokens, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in tokens):
            raise ProtocolError(f"{where}: tokens {str(tokens)[:80]}: expected a list of ints", "tokens")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in tokens):
            raise ProtocolError(f"{where}: tokens: expected ids in [0, {vocab_size})", "tokens")
    return [int(t) for t in tokens]
