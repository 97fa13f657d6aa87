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
