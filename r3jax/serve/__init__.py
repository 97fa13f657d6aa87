"""HTTP serving: the FastAPI app around the engine (``create_app``: r3jax's ``/v1/generate`` and the
SkyRL / vLLM / SGLang endpoints), its command line (``python -m r3jax serve``) and
``RemoteInferenceClient``, which has the engine's ``generate`` in any of those protocols.

Imports are lazy so the client works without FastAPI/uvicorn installed.
"""

from __future__ import annotations

__all__ = ["BINARY_MEDIA_TYPE", "ChatOutput", "ChatRequest", "ProtocolError", "RemoteError", "RemoteInferenceClient", "RemoteInputError",
           "create_app"]


def __getattr__(name):
    if name == "create_app":
        from r3jax.serve.app import create_app
        return create_app
    if name in ("RemoteInferenceClient", "RemoteError", "RemoteInputError", "ChatRequest", "ChatOutput"):
        from r3jax.serve import client
        return getattr(client, name)
    if name in ("BINARY_MEDIA_TYPE", "ProtocolError"):
        from r3jax.serve import protocol
        return getattr(protocol, name)
    raise AttributeError(f"module 'r3jax.serve' has no attribute {name!r}")
