"""What an HTTP answer means to the client: success, a retryable refusal, bad input, or a server fault.

| answer                                   | client                                                  |
|------------------------------------------|---------------------------------------------------------|
| 2xx/3xx                                  | decoded and checked (``ProtocolError`` if it breaks the contract) |
| 408, 429, 502, 503, 504                  | :class:`Retryable` (``Retry-After`` honoured within the budget) |
| other 4xx (400, 401, 404, 413, 422, ...) | :class:`RemoteInputError` at once: resending the same body cannot help |
| other 5xx (500, ...)                     | :class:`RemoteError` at once: a server bug, not a transient state |
"""

from __future__ import annotations

import email.utils
import math
import time

import httpx

RETRY_STATUS = frozenset({408, 429, 502, 503, 504})


class RemoteError(RuntimeError):
    """The request could not be served: no replica answered within the retry budget, or a 5xx."""


class RemoteInputError(ValueError):
    """The server refused the request (4xx): ``status``, ``field`` and ``detail`` from its JSON body."""

    def __init__(self, status: int, field: str | None, detail: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {detail}" + (f" (field {field})" if field else ""))
        self.status, self.field, self.detail = status, field, detail


class Retryable(Exception):
    """One attempt failed in a way that resending the whole request may fix. ``retry_after``: the
    server's ``Retry-After`` in seconds, or None."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` (RFC 9110: delay-seconds or an HTTP date) in seconds from now; None if absent
    or unreadable (then the client's own backoff applies)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def json_body(r: httpx.Response) -> dict:
    """The answer's JSON object, or ``{"detail": text}`` when it is not one."""
    try:
        body = r.json()
    except ValueError:  # not JSON (a proxy's HTML page, a truncated body)
        return {"detail": r.text[:200]}
    return body if isinstance(body, dict) else {"detail": str(body)}


def raise_for(r: httpx.Response, url: str) -> None:
    """Raise what the answer ``r`` from replica ``url`` means (table above); return if it succeeded."""
    status = r.status_code
    if status < 400:
        return
    body = json_body(r)
    error = body.get("error")
    if isinstance(error, dict):  # the peers' shape: {"error": {"message", "param", ...}} (vLLM, SkyRL, SGLang)
        body = {"detail": error.get("message") or "", "field": error.get("param")}
    detail = body.get("detail") or body.get("error") or ""
    if status in RETRY_STATUS:
        raise Retryable(f"{url}: HTTP {status}" + (f": {detail}" if detail else ""),
                        parse_retry_after(r.headers.get("retry-after")))
    if status < 500:
        raise RemoteInputError(status, body.get("field"), str(detail), url)
    raise RemoteError(f"{url}: HTTP {status}: {detail}")
