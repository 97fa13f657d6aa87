"""Peer protocols on r3jax's engine: pure functions between each peer's HTTP bodies and
``GenerateRequest`` / ``GenerateOutput``, both directions, one module per peer.

- :mod:`.skyrl`: SkyRL 0.4.0 ``/skyrl/v1/generate`` and ``/inference/v1/generate`` (X-Session-ID).
- :mod:`.vllm`: vLLM ``/v1/completions`` (token-id prompts, routed experts), ``/v1/models``.
- :mod:`.sglang`: SGLang ``/generate`` with ``input_ids`` and routed experts.

Server side: ``parse_*`` (peer body → ``GenerateRequest``, raising ``r3jax.checks.FieldError`` that
names the peer's field), ``render_*`` (``GenerateOutput`` → peer body), ``error_response``
(``FieldError`` → (status, peer error body)). Client side: the peer body for a request and the
peer's answer → ``GenerateOutput`` under the row rule ``[s, P + G - 1)`` (``ProtocolError`` if
broken). Where each form comes from: docs/peers.md.
"""

from r3jax.serve.peers import sglang, skyrl, vllm

__all__ = ["sglang", "skyrl", "vllm"]
