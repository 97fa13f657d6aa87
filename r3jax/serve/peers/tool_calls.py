"""Tool calls in a chat reply: the Hermes format (Qwen2.5 / Qwen3, NousResearch Hermes), as vLLM's
``--tool-call-parser hermes`` reads it.

A reply calls tools with blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text
outside them stays ``content`` (None when only whitespace is left). Every block must be a JSON object
with a string ``name`` and an object (or JSON string) ``arguments``; when any block is malformed, or a
block is left open, the whole reply stays text, as vLLM's parser does: a reply is never lost and never
a 5xx.
"""

from __future__ import annotations

import json
import re
from typing import Any

PARSERS = ("hermes",)
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a reply; ``tool_calls`` in OpenAI's form (``id``, ``type``,
    ``function: {name, arguments}`` with ``arguments`` a JSON string), or ``(text, [])``."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for i, m in enumerate(_BLOCK.finditer(text)):
        call = _call(m.group(1))
        if call is None:
            return text, []
        calls.append({"id": f"call_{i}", "type": "function", "function": call})
    rest = _BLOCK.sub("", text)
    if "<tool_call>" in rest or not calls:  # a block left open: the model stopped mid-call
        return text, []
    return (rest if rest.strip() else None), calls


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}
