"""``stream: true`` on vLLM's ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's server-sent
events, one chunk per token as it reaches the host, ending with ``data: [DONE]``.

Each token chunk carries its text delta and its ``token_ids`` (with ``return_token_ids``; the first
chunk also ``prompt_token_ids``) and its logprob when asked for. The chunk with ``finish_reason``
carries ``routed_experts``: every row of the request, encoded as the non-streamed answer encodes them
(vLLM's proposal: routes on the last chunk). With ``stream_options: {"include_usage": true}`` a last
chunk with no choices carries ``usage``. Text deltas never end inside a UTF-8 character
(:class:`TextStream`). One sample per streamed request (``n`` 1).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from r3jax.checks import FieldError
from r3jax.serve.peers import common

DONE = b"data: [DONE]\n\n"


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def stream_options(body: Mapping[str, Any]) -> tuple[bool, bool, dict]:
    """``(stream, include_usage, body without stream and stream_options)``; FieldError naming a bad one."""
    stream = body.get("stream")
    stream = False if stream is None else common.flag("stream", stream)
    opts = common.mapping("stream_options", body.get("stream_options"))
    common.refuse_unknown(opts, ("include_usage", "continuous_usage_stats"), "stream_options.")
    usage = opts.get("include_usage")
    usage = False if usage is None else common.flag("stream_options.include_usage", usage)
    if opts and not stream:
        raise FieldError("stream_options", dict(opts), "null unless stream is true")
    if stream and body.get("n") not in (None, 1):
        raise FieldError("n", body["n"], "1 or null with stream: true (one sample per streamed request)")
    return stream, usage, {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


class TextStream:
    """Incremental detokenization: :meth:`push` returns the text the new ids add, holding back a
    trailing U+FFFD (an incomplete UTF-8 character) until the next ids complete it; :meth:`flush`
    returns the rest. The deltas join to ``decode(all ids)``."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode, self.ids, self.sent = decode, [], ""

    def push(self, ids: Sequence[int]) -> str:
        self.ids += [int(t) for t in ids]
        text = self.decode(self.ids)
        while text.endswith("\ufffd"):
            text = text[:-1]
        return self._advance(text)

    def flush(self) -> str:
        return self._advance(self.decode(self.ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # the decoder rewrote earlier text: hold until it agrees
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def completion_chunk(head: Mapping[str, Any], *, text: str, ids: list[int], logprobs: list[float] | None,
                     return_token_ids: bool, finish_reason: str | None = None, routes: str | None = None,
                     prompt_ids: list[int] | None = None) -> dict:
    lp = None
    if logprobs is not None:
        tokens = [f"token_id:{t}" for t in ids]
        lps = [common.clamp_logprob(x) for x in logprobs]
        lp = {"text_offset": [0] * len(ids), "token_logprobs": lps, "tokens": tokens,
              "top_logprobs": [{t: v} for t, v in zip(tokens, lps)]}
    choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason,
              "stop_reason": ids[-1] if finish_reason == "stop" and ids else None,
              "token_ids": ids if return_token_ids else None, "routed_experts": routes}
    if prompt_ids is not None and return_token_ids:
        choice["prompt_token_ids"] = prompt_ids
    return {**head, "object": "text_completion", "choices": [choice]}


def chat_chunk(head: Mapping[str, Any], *, delta: dict, ids: list[int], logprobs: list[float] | None,
               return_token_ids: bool, finish_reason: str | None = None, routes: str | None = None,
               prompt_ids: list[int] | None = None) -> dict:
    lp = None
    if logprobs is not None:
        lp = {"content": [{"token": f"token_id:{t}", "logprob": common.clamp_logprob(x), "bytes": None,
                           "top_logprobs": []} for t, x in zip(ids, logprobs)]}
    out = {**head, "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                        "token_ids": ids if return_token_ids else None, "routed_experts": routes}]}
    if prompt_ids is not None and return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


def usage_chunk(head: Mapping[str, Any], object_name: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int) -> dict:
    return {**head, "object": object_name, "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": int(cached_tokens)}}}
