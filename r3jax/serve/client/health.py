"""Waiting for a server to be ready: ``GET /health`` until it answers 200.

One HTTP client serves every poll. ``httpx.get`` builds a new client, and with it an SSL context
(about 20 ms of CPU), per call: polled every 20 ms, that alone takes a whole core from the server
being waited on while it compiles its programs (on 2 cores, a cold start 10 s slower).
"""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, *, timeout: float = 600.0, poll_s: float = 0.05,
                 proc: subprocess.Popen | None = None) -> float:
    """Block until ``url/health`` answers 200; returns the seconds waited. Raises RuntimeError when
    ``proc`` (the server's process, if given) exits first, and TimeoutError after ``timeout`` s."""
    t0 = time.monotonic()
    with httpx.Client(timeout=min(2.0, timeout)) as client:
        while True:
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server at {url} exited with {proc.returncode} before /health answered 200")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{url}/health did not answer 200 within {timeout} s")
            time.sleep(poll_s)
