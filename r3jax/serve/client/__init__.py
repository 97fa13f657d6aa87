"""The HTTP client of r3jax servers (and of SkyRL's, vLLM's and SGLang's): :class:`RemoteInferenceClient`
has the in-process ``Engine``'s ``generate``. One concept per module:

- :mod:`.remote`: the client itself (sync and async API, stats);
- :mod:`.retry`: the time-based retry budget, backoff with full jitter, Retry-After;
- :mod:`.errors`: what each HTTP status means (retry, bad input, server fault);
- :mod:`.replicas`: replica choice (rendezvous hashing for sessions, least loaded, dead ones skipped);
- :mod:`.pool`: connections per event loop, and the private loop behind the sync API;
- :mod:`.protocols`: the r3jax, SkyRL, vLLM and SGLang dialects (codecs in :mod:`r3jax.serve.protocol`
  and :mod:`r3jax.serve.peers`);
- :mod:`.chat`: OpenAI chat turns (:class:`ChatRequest` → :class:`ChatOutput`) and chat ``/tokenize``;
- :mod:`.stats`: the client's counters;
- :mod:`.health`: :func:`wait_healthy`, waiting for a server's ``/health`` 200.
"""

from r3jax.serve.client.chat import ChatOutput, ChatRequest
from r3jax.serve.client.health import wait_healthy
from r3jax.serve.client.errors import RemoteError, RemoteInputError
from r3jax.serve.client.remote import RemoteInferenceClient
from r3jax.serve.client.retry import RetryPolicy
from r3jax.serve.protocol import ProtocolError

__all__ = ["ChatOutput", "ChatRequest", "ProtocolError", "RemoteError", "RemoteInferenceClient", "RemoteInputError", "RetryPolicy", "wait_healthy"]
