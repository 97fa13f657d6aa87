"""Server dialects the client speaks: where a request goes, how it is encoded, how the answer is read.

The codecs themselves (bodies, response parsing, the row-rule checks) live in
:mod:`r3jax.serve.protocol`; this module only binds each dialect to its endpoint, headers and codec,
and measures the route bytes of an answer for :mod:`~r3jax.serve.client.stats`.

- ``"r3jax"``: ``POST /v1/generate``; with ``binary_routes`` it asks for the binary framing
  (a 4-byte JSON length, the JSON, then the raw route bytes), else routes come as base64 JSON.
- ``"sglang"``: SGLang's native ``POST /generate`` (routes for the whole sequence, int32 base64;
  the client keeps rows ``[s, P + G - 1)``). SGLang does not report E, K and the MoE layers, so the
  client needs ``model_info``.
"""

from __future__ import annotations

import json
import struct

from r3jax.serve import protocol
from r3jax.serve.protocol import ServedModel

_ROUTES_KEY = b'"routed_experts":'


def json_route_bytes(content: bytes) -> int:
    """Bytes of the ``routed_experts`` member's value in a compact JSON body (0 if absent or null).
    The wire form (DESIGN.md §3) is a flat object, so the value ends at the first ``}``; a plain
    search instead of a second JSON parse keeps this free."""
    i = content.find(_ROUTES_KEY)
    if i < 0:
        return 0
    j = i + len(_ROUTES_KEY)
    while content[j:j + 1] in (b" ", b"\n", b"\t", b"\r"):
        j += 1
    if content[j:j + 1] != b"{":
        return 0  # null (or a form without an object; nothing to count)
    end = content.find(b"}", j)
    return (end + 1 - j) if end >= 0 else 0


class R3jax:
    name, path = "r3jax", "/v1/generate"

    def __init__(self, binary_routes: bool = True):
        self.binary_routes = binary_routes
        self.headers = {"Content-Type": "application/json"}
        if binary_routes:
            self.headers["Accept"] = f"{protocol.BINARY_MEDIA_TYPE}, application/json"

    @staticmethod
    def encode(request) -> bytes:
        """The request body (checks ``routed_experts_prompt_start`` and the id lists first)."""
        return json.dumps(protocol.request_body(request), separators=(",", ":")).encode()

    @staticmethod
    def decode(content: bytes, media_type: str, request, info: ServedModel, where: str):
        return protocol.parse_response(content, media_type, request, info, where)

    @staticmethod
    def route_bytes(content: bytes, media_type: str) -> int:
        if media_type.startswith(protocol.BINARY_MEDIA_TYPE):
            (n,) = struct.unpack_from("<I", content)
            return len(content) - 4 - n  # the raw route frame after the JSON
        return json_route_bytes(content)


class SGLang:
    name, path = "sglang", "/generate"
    headers = {"Content-Type": "application/json"}

    def __init__(self, binary_routes: bool = True):
        del binary_routes  # SGLang has no binary framing

    @staticmethod
    def encode(request) -> bytes:
        return json.dumps(protocol.sglang_body(request), separators=(",", ":")).encode()

    @staticmethod
    def decode(content: bytes, media_type: str, request, info: ServedModel, where: str):
        del media_type
        return protocol.parse_sglang(content, request, info, where)

    @staticmethod
    def route_bytes(content: bytes, media_type: str) -> int:
        return _sglang_route_bytes(content)


def _sglang_route_bytes(content: bytes) -> int:
    """SGLang sends ``meta_info.routed_experts`` as one base64 string."""
    i = content.find(_ROUTES_KEY)
    if i < 0:
        return 0
    j = content.find(b'"', i + len(_ROUTES_KEY))
    k = content.find(b'"', j + 1) if j >= 0 else -1
    return k + 1 - j if k > j else 0


PROTOCOLS = {"r3jax": R3jax, "sglang": SGLang}


def make(name: str, *, binary_routes: bool = True):
    """The dialect ``name`` (``"r3jax"`` or ``"sglang"``), or ValueError naming the choices."""
    if name not in PROTOCOLS:
        raise ValueError(f"protocol={name!r}: expected one of {sorted(PROTOCOLS)}")
    return PROTOCOLS[name](binary_routes)
