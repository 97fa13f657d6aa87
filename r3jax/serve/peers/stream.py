"""``stream: true`` on vLLM's ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's server-sent
events, one chunk per token as it reaches the host, ending with ``data: [DONE]``.

Each token chunk carries its text delta and its ``token_ids`` (with ``return_token_ids``; the first
chunk also ``prompt_token_ids``) and its logprob when asked for. The chunk with ``finish_reason``
carries ``routed_experts``: every row of the request, encoded as the non-streamed answer encodes them
(vLLM's proposal: routes on the last chunk), and ``weight_versions``, the request's version spans. With ``stream_options: {"include_usage": true}`` a last
chunk with no choices carries ``usage``. Text deltas never end inside a UTF-8 character
(:class:`TextStream`). One sample per streamed request (``n`` 1).

Stop strings (vLLM's ``stop``, on both endpoints, streamed or not): :class:`StopWatch` decodes the
reply as its tokens arrive and stops the request at the token that completes one (the engine's
``on_token`` answering True); the answer's text ends before the stop string, ``finish_reason`` is
"stop" and ``stop_reason`` the string; a stream holds back the characters a stop string may be
forming, so the streamed text joins to the same cut text.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from r3jax.checks import FieldError, check_text
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


MAX_STOP_STRINGS = 16


def stop_strings(body: Mapping[str, Any]) -> tuple[list[str], dict]:
    """vLLM's ``stop`` (a string or a list of non-empty strings, at most 16) and the body without it."""
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise FieldError("stop", stop, f"a string or a list of at most {MAX_STOP_STRINGS} strings")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise FieldError(f"stop[{i}]", s, "a non-empty string")
        check_text(f"stop[{i}]", s)
    return stops, {k: v for k, v in body.items() if k != "stop"}


class StopWatch:
    """An ``on_token`` for stop strings: decodes the generated ids as they arrive and answers True (stop
    here) once the text contains one of ``stops``. ``cut`` / ``matched``: where the first stop string
    starts in the text, and which one (None while none has appeared); :meth:`text` cuts a text there
    (vLLM leaves the stop string out of the answer's text; its token ids stay)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str]):
        self.stops, self.decode, self.ids = list(stops), decode, []
        self.cut: int | None = None
        self.matched: str | None = None

    def __call__(self, token: int, logprob=None) -> bool:
        self.ids.append(int(token))
        if self.cut is None:
            text = self.decode(self.ids)
            hits = [(text.find(s), i) for i, s in enumerate(self.stops) if s in text]
            if hits:
                self.cut, first = min(hits)
                self.matched = self.stops[first]
        return self.cut is not None

    def text(self, text: str) -> str:
        return text if self.cut is None else text[:self.cut]

    @property
    def hold(self) -> int:
        """Characters a stream holds back: the longest stop string but one could be forming."""
        return max((len(s) for s in self.stops), default=1) - 1


class TextStream:
    """Incremental detokenization: :meth:`push` returns the text the new ids add, holding back a
    trailing U+FFFD (an incomplete UTF-8 character) until the next ids complete it, and the last
    ``hold`` characters (where a stop string may be forming); :meth:`flush` returns the rest, up to
    ``end`` characters of the whole text. The deltas join to ``decode(all ids)[:end]``."""

    def __init__(self, decode: Callable[[Sequence[int]], str], hold: int = 0):
        self.decode, self.ids, self.sent, self.hold = decode, [], "", hold

    def push(self, ids: Sequence[int], end: int | None = None) -> str:
        """The text ``ids`` add; ``end``: never past this many characters (a stop string's start)."""
        self.ids += [int(t) for t in ids]
        text = self.decode(self.ids)
        while text.endswith("\ufffd"):
            text = text[:-1]
        return self._advance(text[:max(len(self.sent), len(text) - self.hold)][:end])

    def flush(self, end: int | None = None) -> str:
        return self._advance(self.decode(self.ids)[:end])

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # the decoder rewrote earlier text: hold until it agrees
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def completion_chunk(head: Mapping[str, Any], *, text: str, ids: list[int], logprobs: list[float] | None,
                     return_token_ids: bool, finish_reason: str | None = None, routes: str | None = None,
                     prompt_ids: list[int] | None = None, stop_reason: Any = None,
                     versions: list | None = None) -> dict:
    lp = None
    if logprobs is not None:
        tokens = [f"token_id:{t}" for t in ids]
        lps = [common.clamp_logprob(x) for x in logprobs]
        lp = {"text_offset": [0] * len(ids), "token_logprobs": lps, "tokens": tokens,
              "top_logprobs": [{t: v} for t, v in zip(tokens, lps)]}
    choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason,
              "stop_reason": stop_reason if stop_reason is not None else ids[-1] if finish_reason == "stop" and ids else None,
              "token_ids": ids if return_token_ids else None, "routed_experts": routes}
    if prompt_ids is not None and return_token_ids:
        choice["prompt_token_ids"] = prompt_ids
    if versions is not None:
        choice["weight_versions"] = versions
    return {**head, "object": "text_completion", "choices": [choice]}


def chat_chunk(head: Mapping[str, Any], *, delta: dict, ids: list[int], logprobs: list[float] | None,
               return_token_ids: bool, finish_reason: str | None = None, routes: str | None = None,
               prompt_ids: list[int] | None = None, stop_reason: Any = None, versions: list | None = None) -> dict:
    lp = None
    if logprobs is not None:
        lp = {"content": [{"token": f"token_id:{t}", "logprob": common.clamp_logprob(x), "bytes": None,
                           "top_logprobs": []} for t, x in zip(ids, logprobs)]}
    out = {**head, "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                        "stop_reason": stop_reason, "token_ids": ids if return_token_ids else None,
                        "routed_experts": routes}]}
    if prompt_ids is not None and return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    if versions is not None:
        out["choices"][0]["weight_versions"] = versions
    return out


def usage_chunk(head: Mapping[str, Any], object_name: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int) -> dict:
    return {**head, "object": object_name, "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": int(cached_tokens)}}}
