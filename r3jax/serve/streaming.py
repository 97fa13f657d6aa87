"""One streamed request (``stream: true`` on vLLM's completions and chat forms), from the engine's
per-token callback to server-sent events (:mod:`r3jax.serve.peers.stream` has the chunk shapes).

Tokens travel from the engine's scheduler thread to the event loop with ``call_soon_threadsafe``;
whatever arrives between two sends goes out in one chunk. A request the engine or the bridge refuses
before its first token gets the ordinary error answer (4xx, or 503 to retry); after that the status
is sent, so a failure becomes an ``{"error": ...}`` event before ``[DONE]``. A client that leaves
mid-stream cancels the request, which frees its pages.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from fastapi.responses import Response, StreamingResponse

from r3jax.checks import FieldError
from r3jax.engine.errors import EngineAborted, EngineFailedError
from r3jax.serve.batcher import ShuttingDown
from r3jax.serve.dispatch import ServeContext, Unavailable, unavailable
from r3jax.serve.peers import common, stream, vllm


async def stream_answer(ctx: ServeContext, req, *, kind: str, request_id: str, model: str, num_experts: int,
                        decode: Callable[[list[int]], str], return_token_ids: bool, include_usage: bool,
                        on_error: Callable[[BaseException], Response], stops: list[str] | None = None) -> Response:
    """``kind``: ``"completion"`` or ``"chat"``. ``on_error(err)``: the answer for a FieldError or
    :class:`Unavailable` raised before the stream starts. ``stops``: stop strings."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    watch = stream.StopWatch(stops, decode) if stops else None

    def on_token(token: int, logprob: float | None) -> bool:  # the engine's thread
        stop = watch is not None and watch(token, logprob)  # before the event: its chunk sees the cut
        loop.call_soon_threadsafe(events.put_nowait, (token, logprob))
        return stop

    ctx.count_session(req.session_id)
    task = asyncio.ensure_future(ctx.bridge.submit(req, on_token=on_token))  # its refusals surface below
    first = asyncio.ensure_future(events.get())
    await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
    if task.done() and not first.done():
        first.cancel()
        err = task.exception()
        if isinstance(err, (ShuttingDown, EngineFailedError, EngineAborted)):
            return on_error(unavailable(err))
        if err is not None:
            return on_error(err)
    ctx.protocols["vllm"] += 1
    head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}", "created": int(time.time()),
            "model": model}
    text = stream.TextStream(decode, hold=0 if watch is None else watch.hold)
    prompt = list(req.prompt_ids)

    def chunk(ids: list[int], lps, delta_text: str, **kw) -> bytes:
        lps = lps if req.return_logprobs else None
        if kind == "chat":
            delta = {"content": delta_text} if delta_text or ids else {}
            return stream.sse(stream.chat_chunk(head, delta=delta, ids=ids, logprobs=lps,
                                                return_token_ids=return_token_ids, **kw))
        return stream.sse(stream.completion_chunk(head, text=delta_text, ids=ids, logprobs=lps,
                                                  return_token_ids=return_token_ids, **kw))

    async def chunks():
        pending, sent = first, 0
        try:
            if kind == "chat":  # OpenAI's first chat chunk: the role
                yield stream.sse(stream.chat_chunk(head, delta={"role": "assistant", "content": ""}, ids=[],
                                                   logprobs=None, return_token_ids=return_token_ids,
                                                   prompt_ids=prompt))
            while True:
                if not pending.done():
                    await asyncio.wait({task, pending}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    break  # the request finished and every token event is queued
                got = [pending.result()]
                while not events.empty():
                    got.append(events.get_nowait())
                pending = asyncio.ensure_future(events.get())
                ids = [t for t, _ in got]
                yield chunk(ids, [lp for _, lp in got], text.push(ids, None if watch is None else watch.cut),
                            prompt_ids=prompt if kind == "completion" and sent == 0 else None)
                sent += len(ids)
            pending.cancel()
            try:
                out = task.result()
            except Exception as e:  # noqa: BLE001 - the status is sent: say it in the stream
                err = unavailable(e) if isinstance(e, (ShuttingDown, EngineFailedError, EngineAborted)) else e
                retry = isinstance(err, Unavailable)
                yield stream.sse({"error": {"message": str(err), "type": type(err).__name__,
                                            "code": 503 if retry else 400}})
                yield stream.DONE
                return
            rest = [int(t) for t in out.output_ids[sent:]]  # an engine without on_token streams nothing early
            if rest:
                lps = None if out.logprobs is None else list(out.logprobs[sent:])
                yield chunk(rest, lps, text.push(rest, None if watch is None else watch.cut),
                            prompt_ids=prompt if kind == "completion" and sent == 0 else None)
            routes = None if out.routed_experts is None else vllm.encode_routes(out.routed_experts, num_experts)
            yield chunk([], None, text.flush(None if watch is None else watch.cut), finish_reason=out.finish_reason,
                        routes=routes, stop_reason=None if watch is None else watch.matched,
                        versions=common.with_spans({}, out).get("weight_versions"))
            if include_usage:
                yield stream.sse(stream.usage_chunk(head, "chat.completion.chunk" if kind == "chat" else "text_completion",
                                                    len(prompt), len(out.output_ids), out.cached_tokens))
            yield stream.DONE
        finally:  # also when the client left: cancelling the task cancels the engine request
            pending.cancel()
            if not task.done():
                task.cancel()

    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={"X-Weight-Version": str(int(getattr(ctx.engine, "weight_version", 0)))})


def stream_request(body: Any):
    """``(stream, include_usage, body without them)`` for a JSON object body; other bodies pass
    through unchanged for the parser to refuse."""
    if not isinstance(body, dict):
        return False, False, body
    return stream.stream_options(body)

