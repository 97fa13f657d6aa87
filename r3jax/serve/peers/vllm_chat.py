"""vLLM's ``POST /v1/chat/completions`` (OpenAI chat form) on r3jax's engine.

``messages`` are rendered to prompt ids by the server's chat tokenizer (``chat_ids(messages)``:
:class:`r3jax.rollout.ByteTokenizer`'s pieces for the presets, a Hugging Face chat template for
:class:`r3jax.rollout.tokenizer.HFChatTokenizer`), then the request is the one ``/v1/completions``
would make of those ids: the same sampling fields (``max_completion_tokens`` or ``max_tokens``; null:
up to the context), ``n`` samples sharing one prefill, ``return_token_ids`` (top-level
``prompt_token_ids``, ``choices[i].token_ids``), ``return_routed_experts`` and
``routed_experts_prompt_start`` with the same route encoding (base64 ``.npy`` ``[rows, L, K]``).
``logprobs: true`` returns the sampled token's logprob (``top_logprobs`` 0 or null). The reply's
``message.content`` is the decoded ``token_ids``.

Tools: ``tools`` (and assistant messages' ``tool_calls``, tool messages' ``tool_call_id``) go to a chat
template that reads them (a tokenizer with ``supports_tools``; otherwise a 400 naming the field). With
a tool-call parser (``serve --tool-call-parser hermes``: :mod:`r3jax.serve.peers.tool_calls`) the
reply's calls fill ``message.tool_calls`` and ``finish_reason`` is ``"tool_calls"``. ``stream: true``:
:mod:`r3jax.serve.streaming`; stop strings: :class:`r3jax.serve.peers.stream.StopWatch`.
"""

from __future__ import annotations

from typing import Any, Mapping

from r3jax.checks import FieldError, check_int, check_text
from r3jax.engine.request import GenerateOutput, GenerateRequest
from r3jax.serve.peers import common, tool_calls, vllm

ROLES = ("system", "user", "assistant", "tool")
CHAT_READ = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
             "n", "stop_token_ids", "logprobs", "top_logprobs", "routed_experts_prompt_start", "logprobs_mode",
             "return_routed_experts", "return_token_ids", "session_id", "request_id", "user", "cache_salt",
             "add_generation_prompt")
CHAT_DEFAULTS = {
    "stream": (None, False), "stream_options": (None,), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False), "echo": (None, False), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None,), "response_format": (None,), "documents": (None,),
    "add_special_tokens": (None, False), "priority": (0,), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "mm_processor_kwargs": (None,), "truncate_prompt_tokens": (None,),
}


def messages_text(value: Any) -> list[dict]:
    """``messages`` checked: a non-empty list of ``{role, content}`` with a known role and text content
    (a string, or a list of ``{"type": "text", "text": ...}`` parts, joined). Returns
    ``[{"role", "content": str}]``."""
    if not isinstance(value, list) or not value:
        raise FieldError("messages", value, "a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        m = common.mapping(where, m)
        role = m.get("role")
        if role not in ROLES:
            raise FieldError(f"{where}.role", role, f"one of {', '.join(map(repr, ROLES))}")
        content = m.get("content")
        extra = {}
        if m.get("tool_calls") is not None:
            if role != "assistant" or not isinstance(m["tool_calls"], list):
                raise FieldError(f"{where}.tool_calls", m["tool_calls"], "a list of calls, on an assistant message")
            extra["tool_calls"] = m["tool_calls"]
            content = "" if content is None else content
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise FieldError(f"{where}.tool_call_id", m["tool_call_id"], "a string")
            extra["tool_call_id"] = m["tool_call_id"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                part = common.mapping(f"{where}.content[{j}]", part)
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(f"{where}.content[{j}]", part, 'a {"type": "text", "text": str} part')
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise FieldError(f"{where}.content", content, "a string or a list of text parts")
        out.append({"role": role, "content": check_text(f"{where}.content", content), **extra})
    return out


def chat_prompt(body: Mapping[str, Any], tokenizer: Any, vocab_size: int | None) -> list[int]:
    """The prompt ids the chat tokenizer renders of ``body``'s ``messages`` (and ``tools``), with the
    generation prompt: what ``/v1/chat/completions`` generates from and ``/tokenize`` returns."""
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise FieldError("tools", tools, "a list of tool objects")
    messages = messages_text(body.get("messages"))
    if body.get("add_generation_prompt") not in (None, True):
        raise FieldError("add_generation_prompt", body["add_generation_prompt"], "true (the reply is generated)")
    if tokenizer is None or not callable(getattr(tokenizer, "chat_ids", None)):
        raise FieldError("messages", f"{len(messages)} messages",
                         "a server with a chat tokenizer (start it with --tokenizer byte for the presets)")
    calls = [f"messages[{i}].tool_calls" for i, m in enumerate(messages) if "tool_calls" in m]
    if (tools is not None or calls) and not getattr(tokenizer, "supports_tools", False):
        field = "tools" if tools is not None else calls[0]
        raise FieldError(field, tools if tools is not None else "[...]",
                         "null: the server's chat template takes no tools (serve a model whose template does)")
    try:
        prompt = [int(t) for t in (tokenizer.chat_ids(messages, tools=tools) if tools is not None
                                   else tokenizer.chat_ids(messages))]
    except ValueError as e:  # the template refused the conversation
        raise FieldError("messages", f"{len(messages)} messages", f"a conversation the chat template renders ({e})")
    return common.token_ids("messages", prompt, vocab_size)


def parse_chat(body: Any, *, served_model: str, tokenizer: Any, return_routed_experts_default: bool = False,
               session_id: str | None = None, vocab_size: int | None = None,
               max_seq_len: int | None = None) -> tuple[GenerateRequest, int]:
    """A chat body → ``(GenerateRequest of the rendered prompt ids, n)``; FieldError naming the field."""
    body = common.mapping("body", body)
    common.refuse_unknown(body, (*CHAT_READ, *CHAT_DEFAULTS, *vllm.SAMPLING_FREE, *vllm.SAMPLING_DEFAULTS))
    common.only_defaults(body, {k: v for k, v in CHAT_DEFAULTS.items() if k != "tools"})
    model = body.get("model")
    if model is not None and model != served_model:
        raise FieldError("model", model, f"the served model {served_model!r}")
    prompt = chat_prompt(body, tokenizer, vocab_size)
    sampling = {k: v for k, v in body.items() if k in (*vllm.SAMPLING_READ, *vllm.SAMPLING_FREE, *vllm.SAMPLING_DEFAULTS)
                and k not in ("n", "logprobs", "max_tokens")}
    mct, mt = body.get("max_completion_tokens"), body.get("max_tokens")
    if mct is not None and mt is not None and mct != mt:
        raise FieldError("max_completion_tokens", mct, f"null or equal to max_tokens={mt!r}")
    sampling["max_tokens"] = mct if mct is not None else mt
    top = body.get("top_logprobs")
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and top == 0):
        raise FieldError("top_logprobs", top, "0 or null (r3jax returns the sampled token's logprob only)")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        sampling["logprobs"] = 0 if common.flag("logprobs", logprobs) else None
    kwargs = vllm.read_sampling(sampling, "", prompt, vocab_size=vocab_size, max_seq_len=max_seq_len,
                                null_max_tokens=None, top_logprobs=False)
    n = body.get("n")
    n = 1 if n is None else check_int("n", n, 1, vllm.MAX_N)
    routes = body.get("return_routed_experts")
    routes = return_routed_experts_default if routes is None else common.flag("return_routed_experts", routes)
    if body.get("return_token_ids") is not None:
        common.flag("return_token_ids", body["return_token_ids"])
    sid = body.get("session_id", session_id)
    if sid is not None and not isinstance(sid, str):
        raise FieldError("session_id", sid, "a string or null")
    return GenerateRequest(prompt_ids=prompt, return_routed_experts=routes, session_id=sid, **kwargs), n


def render_chat(outs: list[GenerateOutput], request: GenerateRequest, *, texts: list[str], model: str,
                request_id: str, created: int, num_experts: int, return_token_ids: bool,
                tool_call_parser: str | None = None) -> dict:
    """vLLM's ``ChatCompletionResponse``: ``choices[i]`` is sample i (message, logprobs, token ids,
    routes); usage counts the prompt once. ``tool_call_parser`` ("hermes" or None) reads tool calls
    out of each reply's text."""
    p = len(request.prompt_ids)
    choices = []
    for i, (out, text) in enumerate(zip(outs, texts)):
        ids = [int(t) for t in out.output_ids]
        logprobs = None
        if out.logprobs is not None:
            logprobs = {"content": [{"token": f"token_id:{t}", "logprob": common.clamp_logprob(lp), "bytes": None,
                                     "top_logprobs": []} for t, lp in zip(ids, out.logprobs)]}
        routes = None if out.routed_experts is None else vllm.encode_routes(out.routed_experts, num_experts)
        content, calls = tool_calls.parse_hermes(text) if tool_call_parser == "hermes" else (text, [])
        choices.append(common.with_spans(
            {"index": i, "message": {"role": "assistant", "content": content, "tool_calls": calls},
             "logprobs": logprobs, "finish_reason": "tool_calls" if calls else out.finish_reason,
             "stop_reason": ids[-1] if out.finish_reason == "stop" else None,  # a stop string: the caller's
             "token_ids": ids if return_token_ids else None, "routed_experts": routes}, out))
    g = sum(len(o.output_ids) for o in outs)
    usage = {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g,
             "prompt_tokens_details": {"cached_tokens": int(outs[0].cached_tokens)}}
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(created), "model": model,
            "choices": choices, "usage": usage,
            "prompt_token_ids": list(request.prompt_ids) if return_token_ids else None}


def chat_body_fields() -> tuple[tuple, Mapping]:
    """(fields read, fields accepted only at their defaults) for the OpenAPI body."""
    fields = (*CHAT_READ, *vllm.SAMPLING_FREE)
    defaults = {**CHAT_DEFAULTS, **{k: v for k, v in vllm.SAMPLING_DEFAULTS.items() if k != "n"}}
    return fields, defaults
