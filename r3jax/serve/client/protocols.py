"""Server dialects the client speaks: where a request goes, how it is encoded, how the answer is read.

The codecs live elsewhere (r3jax's own in :mod:`r3jax.serve.protocol`, the peers' in
:mod:`r3jax.serve.peers`); this module binds each dialect to its endpoint, headers and codec, and
measures the route bytes of an answer for :mod:`~r3jax.serve.client.stats`. Every dialect returns
the same checked ``GenerateOutput`` (routes: exactly ``P - s + G - 1`` rows, ``route_dtype(E)``).

- ``"r3jax"``: ``POST /v1/generate``; with ``binary_routes`` it asks for the binary framing
  (a 4-byte JSON length, the JSON, then the raw route bytes), else routes come as base64 JSON.
- ``"skyrl"``: SkyRL 0.4.0's ``POST /skyrl/v1/generate`` (``/inference/v1/generate`` without
  routes), ``X-Session-ID`` header, packed routes in the chunk's value-canonical dtype.
- ``"vllm"``: ``POST /v1/completions`` with a token-id prompt, ``routed_experts_prompt_start``,
  ``return_token_ids``; routes as base64 ``.npy`` (a vLLM server needs ``--enable-return-routed-experts``).
- ``"sglang"``: SGLang's ``POST /generate`` with ``input_ids`` and ``routed_experts_start_len``;
  int32 base64 routes (a server that ignores the start sends every row: the first s are dropped).

The peers' bodies carry no integer weight version; an r3jax server adds an ``X-Weight-Version``
header, which the client reads. From a real vLLM/SkyRL server (no header) the version is
``r3jax.serve.peers.common.UNKNOWN_VERSION`` (-1); SGLang's ``"default"`` is too.
"""

from __future__ import annotations

import dataclasses
import json
import struct

from r3jax.serve import protocol
from r3jax.serve.client import chat
from r3jax.serve.peers import common, sglang, skyrl, vllm
from r3jax.serve.protocol import ProtocolError, ServedModel

VERSION_HEADER = "x-weight-version"
_ROUTES_KEY = b'"routed_experts":'
_JSON = {"Content-Type": "application/json"}


def json_route_bytes(content: bytes) -> int:
    """Bytes of the ``routed_experts`` member's value in a compact JSON body (0 if absent or null):
    an object (r3jax's and SkyRL's wire forms are flat, so it ends at the first ``}``) or a string
    (vLLM's .npy base64, SGLang's int32 base64). A plain search instead of a second JSON parse."""
    i = content.find(_ROUTES_KEY)
    if i < 0:
        return 0
    j = i + len(_ROUTES_KEY)
    while content[j:j + 1] in (b" ", b"\n", b"\t", b"\r"):
        j += 1
    head = content[j:j + 1]
    if head not in (b"{", b'"'):
        return 0  # null
    end = content.find(b"}" if head == b"{" else b'"', j + 1)
    return (end + 1 - j) if end >= 0 else 0


def _version(out, headers) -> object:
    """``out`` with the server's ``X-Weight-Version`` header when its body had no version, and then
    its one version span when the body sent none (:func:`r3jax.serve.peers.common.one_span`)."""
    value = (headers or {}).get(VERSION_HEADER)
    if out.weight_version != common.UNKNOWN_VERSION or value is None:
        return common.one_span(out)
    if not value.strip().lstrip("-").isdigit():
        raise ProtocolError(f"X-Weight-Version={value!r}: expected an int", "weight_version")
    return common.one_span(dataclasses.replace(out, weight_version=int(value)))


def _dump(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class R3jax:
    name = "r3jax"

    def __init__(self, binary_routes: bool = True, model: str | None = None):
        self.binary_routes = binary_routes
        self._headers = dict(_JSON)
        if binary_routes:
            self._headers["Accept"] = f"{protocol.BINARY_MEDIA_TYPE}, application/json"

    def path(self, request) -> str:
        return "/v1/generate"

    def headers(self, request) -> dict:
        return self._headers

    @staticmethod
    def encode(request) -> bytes:
        """The request body (checks ``routed_experts_prompt_start`` and the id lists first)."""
        return _dump(protocol.request_body(request))

    @staticmethod
    def decode(content: bytes, media_type: str, request, info: ServedModel, where: str, headers=None):
        return protocol.parse_response(content, media_type, request, info, where)

    @staticmethod
    def route_bytes(content: bytes, media_type: str) -> int:
        if media_type.startswith(protocol.BINARY_MEDIA_TYPE):
            (n,) = struct.unpack_from("<I", content)
            return len(content) - 4 - n  # the raw route frame after the JSON
        return json_route_bytes(content)


class _Peer:
    """A peer dialect: a body builder and a response parser from :mod:`r3jax.serve.peers`."""

    name = ""

    def __init__(self, binary_routes: bool = True, model: str | None = None):
        del binary_routes  # the peers have no binary framing
        self.model = model

    def path(self, request) -> str:
        raise NotImplementedError

    def headers(self, request) -> dict:
        return _JSON

    def body(self, request) -> dict:
        raise NotImplementedError

    def encode(self, request) -> bytes:
        return _dump(self.body(request))

    def parse(self, content: bytes, request, **kw):
        raise NotImplementedError

    def decode(self, content: bytes, media_type: str, request, info: ServedModel, where: str, headers=None):
        out = self.parse(content, request, num_experts=info.num_experts, num_layers=len(info.moe_layer_ids),
                         top_k=info.top_k, vocab_size=info.vocab_size, where=where)
        return _version(out, headers)

    @staticmethod
    def route_bytes(content: bytes, media_type: str) -> int:
        return json_route_bytes(content)


class SkyRL(_Peer):
    name = "skyrl"

    def path(self, request) -> str:
        return skyrl.request_for(request)[0]

    def headers(self, request) -> dict:
        return skyrl.request_for(request)[2]

    def body(self, request) -> dict:
        return skyrl.request_for(request, model=self.model or "default")[1]

    parse = staticmethod(skyrl.parse_generate_response)


class VLLM(_Peer):
    name = "vllm"

    def path(self, request) -> str:
        return "/v1/completions"

    def body(self, request) -> dict:
        body = vllm.completion_body(request, model=self.model or "")
        if self.model is None:
            del body["model"]  # vLLM then serves its (only) model
        return body

    parse = staticmethod(vllm.parse_completion_response)


class SGLang(_Peer):
    name = "sglang"

    def path(self, request) -> str:
        return "/generate"

    def body(self, request) -> dict:
        return sglang.generate_body(request)

    parse = staticmethod(sglang.parse_generate_response)


class VLLMChat(_Peer):
    """OpenAI chat (``/v1/chat/completions``) for :class:`~r3jax.serve.client.chat.ChatRequest`, whatever
    the client's dialect: an r3jax server and a vLLM server answer it alike."""

    name = "vllm-chat"

    def path(self, request) -> str:
        return "/v1/chat/completions"

    def body(self, request) -> dict:
        return chat.chat_body(request, model=self.model)

    parse = staticmethod(chat.parse_chat_response)


class ChatTokenize(_Peer):
    """vLLM's chat ``POST /tokenize``: the ids ``/v1/chat/completions`` would prompt with (a list)."""

    name = "tokenize"

    def path(self, request) -> str:
        return "/tokenize"

    def body(self, request) -> dict:
        return chat.tokenize_body(request.messages, request.tools, self.model)

    def decode(self, content: bytes, media_type: str, request, info: ServedModel, where: str, headers=None):
        return chat.parse_tokenize_response(content, info.vocab_size, where)

    @staticmethod
    def route_bytes(content: bytes, media_type: str) -> int:
        return 0


PROTOCOLS = {"r3jax": R3jax, "skyrl": SkyRL, "vllm": VLLM, "sglang": SGLang}


def make(name: str, *, binary_routes: bool = True, model: str | None = None):
    """The dialect ``name`` (one of :data:`PROTOCOLS`), or ValueError naming the choices."""
    if name not in PROTOCOLS:
        raise ValueError(f"protocol={name!r}: expected one of {sorted(PROTOCOLS)}")
    return PROTOCOLS[name](binary_routes, model)
