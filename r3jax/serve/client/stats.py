"""Client-side counters (``RemoteInferenceClient.stats``), cumulative since the client was made.

- ``requests``: generate requests answered; ``failed``: requests that raised for good.
- ``attempts``: HTTP generate attempts sent; ``retries``: attempts beyond each request's first
  (all retryable causes: refused, reset, timeout, 408/429/502/503/504, no live replica).
- ``responses``: answers decoded; ``body_bytes``: their bytes as received (after any transfer
  decoding); ``route_bytes``: the route payload within them (the raw frame of the binary framing,
  or the ``routed_experts`` JSON value with its base64 data); ``route_rows``: route rows decoded.
- ``decode_s``: seconds spent decoding and checking answers (JSON, routes, the row rule), on the
  client's event loop; ``request_s``: seconds from sending each request to its decoded answer,
  summed over requests (retries and waits included); ``retry_wait_s``: seconds slept between
  attempts (backoff and ``Retry-After``).
"""

from __future__ import annotations

import threading

FIELDS = ("requests", "failed", "attempts", "retries", "responses", "body_bytes", "route_bytes",
          "route_rows", "decode_s", "request_s", "retry_wait_s")


class ClientStats:
    """Thread-safe counters (the sync API and user event loops may update them concurrently)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = {k: (0.0 if k.endswith("_s") else 0) for k in FIELDS}

    def add(self, **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v  # KeyError on a misspelt counter: a bug, not a default

    def __getitem__(self, key: str):
        with self._lock:
            return self._values[key]

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._values)
