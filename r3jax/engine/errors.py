"""Why the engine did not finish a request (bad input is :class:`r3jax.checks.FieldError` instead)."""

from __future__ import annotations


class EngineAborted(RuntimeError):
    """The request was stopped before it finished and may simply be sent again: a weight update with
    ``abort_in_flight=True`` (no output ever mixes weight versions) or an engine shutting down.
    Servers answer 503 with ``"retryable": true``."""

    retryable = True


Aborted = EngineAborted


class EngineClosed(EngineAborted):
    """The engine was closed before the request finished (or before it was submitted)."""


class EngineFailedError(EngineClosed):
    """The engine cannot continue (its scheduler could not recover from a device failure, e.g. fresh
    slot buffers could not be allocated): every request not finished fails with it, and so does
    every later ``submit``, at once. ``reason`` says why. The request itself may be sent to another
    engine (servers answer 503, ``/health`` answers 503 ``{"status": "failed", "reason": ...}``);
    this one has to be rebuilt."""

    def __init__(self, reason: str):
        super().__init__(f"engine failed: {reason}")
        self.reason = reason
