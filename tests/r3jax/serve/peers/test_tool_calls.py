"""The Hermes tool-call parser (vLLM's ``--tool-call-parser hermes``) and chat replies that call tools."""

import json

from r3jax.engine import GenerateOutput, GenerateRequest
from r3jax.serve.peers.tool_calls import parse_hermes
from r3jax.serve.peers.vllm_chat import render_chat


def _call(name, args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_one_call_and_no_text():
    content, calls = parse_hermes(_call("add", {"a": 1, "b": 2}))
    assert content is None
    assert calls == [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]


def test_several_calls_keep_the_text_around_them():
    text = "Let me check.\n" + _call("weather", {"city": "Zürich"}) + "\n" + _call("time", {}) + " done"
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n\n done"
    assert [c["function"]["name"] for c in calls] == ["weather", "time"] and [c["id"] for c in calls] == ["call_0", "call_1"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich"}


def test_arguments_given_as_a_json_string_are_read():
    _, calls = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 3}"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 3}


def test_malformed_or_unfinished_calls_stay_text():
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', _call("f", {}) + "<tool_call>{\"name\"",
                 "<tool_call>", "plain text"):
        assert parse_hermes(text) == (text, []), text


def test_a_chat_reply_with_calls_finishes_with_tool_calls_only_under_the_parser():
    req = GenerateRequest([1, 2, 3], max_tokens=4)
    out = GenerateOutput([5, 6], None, "stop", None, 3, 0, 0, 0)
    text = "ok " + _call("add", {"a": 1})
    kw = dict(texts=[text], model="m", request_id="r", created=0, num_experts=8, return_token_ids=True)
    parsed = render_chat([out], req, tool_call_parser="hermes", **kw)["choices"][0]
    assert parsed["finish_reason"] == "tool_calls" and parsed["message"]["content"] == "ok "
    assert parsed["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    plain = render_chat([out], req, **kw)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": text,
                                                                     "tool_calls": []}
