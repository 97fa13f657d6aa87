"""Every peer parser, every field it reads, odd JSON values: the answer is a request or a FieldError
(a 4xx), never another exception (a 5xx). Deterministic; pure Python."""

import json

import pytest

from r3jax.checks import FieldError
from r3jax.serve.peers import sglang, skyrl, vllm

ODD = [None, True, False, 0, -1, 1, 2**70, -(2**70), 10**400, 1.5, -0.0, float("nan"), float("inf"), "", "x",
       [], [[]], [1.5], ["a"], [None], [True], [[1], [2]], [2**70], {}, {"a": 1}, [{"a": 1}]]

BASE = {
    "skyrl": {"token_ids": [1, 2, 3], "model": "m",
              "sampling_params": {"max_tokens": 4, "logprobs": 1, "routed_experts_prompt_start": 1}},
    "vllm": {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 0, "routed_experts_prompt_start": 1},
    "sglang": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True,
               "routed_experts_start_len": 1},
}
PARSE = {
    "skyrl": lambda b: skyrl.parse_generate(b, return_routed_experts=True, vocab_size=50, max_seq_len=32),
    "vllm": lambda b: vllm.parse_completion(b, served_model="m", vocab_size=50, max_seq_len=32),
    "sglang": lambda b: sglang.parse_generate(b, vocab_size=50, max_seq_len=32),
}
FIELDS = {
    "skyrl": [("token_ids",), ("model",), ("cache_salt",), ("return_sample_support",), ("sampling_params",)]
    + [("sampling_params", k) for k in (*vllm.SAMPLING_READ, *vllm.SAMPLING_FREE, *vllm.SAMPLING_DEFAULTS)],
    "vllm": [(k,) for k in (*vllm.COMPLETION_READ, *vllm.COMPLETION_DEFAULTS, *vllm.SAMPLING_READ,
                            *vllm.SAMPLING_FREE, *vllm.SAMPLING_DEFAULTS)],
    "sglang": [(k,) for k in (*sglang.BODY_READ, *sglang.BODY_DEFAULTS)]
    + [("sampling_params", k) for k in (*sglang.SAMPLING_READ, *sglang.SAMPLING_FREE, *sglang.SAMPLING_DEFAULTS)],
}


def _with(body, path, value):
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return body


@pytest.mark.parametrize("peer", sorted(PARSE))
def test_odd_values_give_a_request_or_a_field_error(peer):
    parse = PARSE[peer]
    parse(BASE[peer])  # the base body is valid
    seen = 0
    for path in FIELDS[peer]:
        for value in ODD:
            try:
                parse(_with(BASE[peer], path, value))
            except FieldError as e:
                assert e.field and e.message
                seen += 1
    assert seen > len(FIELDS[peer]) * 5  # most odd values are refused


@pytest.mark.parametrize("peer", sorted(PARSE))
@pytest.mark.parametrize("body", [None, [], "x", 3, {"": 1}])
def test_non_objects_and_empty_keys(peer, body):
    with pytest.raises(FieldError):
        PARSE[peer](body)
