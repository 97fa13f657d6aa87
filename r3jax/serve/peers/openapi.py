"""OpenAPI request-body schemas of the peer endpoints, built from the field lists the parsers read
(so the published schema and the parser cannot drift apart). Bodies are parsed by hand, so these
document; they do not validate. Fields a peer defines but r3jax accepts only at their default are
listed with that default."""

from __future__ import annotations

from typing import Iterable, Mapping

from r3jax.serve.peers import sglang, skyrl, vllm

_DOC = {
    "token_ids": "prompt token ids, each in [0, vocab_size)",
    "input_ids": "prompt token ids (or one-element batch), each in [0, vocab_size)",
    "prompt": "token ids (list of ints), or text when the server has a tokenizer",
    "text": "prompt text (needs the server's tokenizer; else send input_ids)",
    "model": "model name (vLLM: must be the served model)",
    "max_tokens": "new tokens to sample (vLLM default 16; SkyRL sends 1024)",
    "max_new_tokens": "new tokens to sample (SGLang default 128)",
    "temperature": "0 is greedy",
    "top_k": "-1 or 0: off",
    "seed": "sampling seed; -1 or null: none",
    "sampling_seed": "sampling seed",
    "logprobs": "0/1/null: the sampled token's logprob is returned when not null",
    "return_logprob": "return meta_info.output_token_logprobs",
    "routed_experts_prompt_start": "s in [0, P]: routes come back for positions [s, P + G - 1)",
    "routed_experts_start_len": "s in [0, P]: meta_info.routed_experts covers [s, P + G - 1)",
    "return_routed_experts": "return the experts used per token and MoE layer",
    "session_id": "sticky-routing key (the X-Session-ID header also works)",
    "logprobs_mode": "r3jax extension, vLLM's --logprobs-mode names: raw_logprobs (default, null) = log_softmax of "
                     "the model's logits; processed_logprobs = after temperature and top-k/top-p",
}


def _object(fields: Iterable[str], defaults: Mapping[str, tuple] = {}, *, required: Iterable[str] = (),
            nested: Mapping[str, dict] | None = None, doc: str = "") -> dict:
    props: dict = {}
    for name in fields:
        props[name] = {"description": _DOC.get(name, "read by r3jax")}
    for name, allowed in defaults.items():
        props[name] = {"description": f"accepted only as {', '.join(map(repr, allowed))}"}
    for name, schema in (nested or {}).items():
        props[name] = schema
    out = {"type": "object", "properties": props, "description": doc}
    if required:
        out["required"] = list(required)
    return out


def _body(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _vllm_sampling() -> dict:
    return _object((*vllm.SAMPLING_READ, *vllm.SAMPLING_FREE), vllm.SAMPLING_DEFAULTS,
                   doc="vLLM SamplingParams names")


def skyrl_body(routes: bool) -> dict:
    doc = ("SkyRL 0.4.0 RemoteGenerateClient body; routes are asked for by this path. Header X-Session-ID: "
           "sticky session. Answer: {choices: [{token_ids, finish_reason, logprobs: {content: [{logprob}]}, "
           "routed_experts: {data, shape, dtype} (value-canonical dtype), rollout_sample_support: null}]}"
           if routes else
           "vLLM GenerateRequest (tokens in, tokens out). Answer: {request_id, choices: [{index, logprobs, "
           "finish_reason, token_ids}], prompt_logprobs, kv_transfer_params}")
    return _body(_object(skyrl.BODY_READ, skyrl.BODY_DEFAULTS, required=("token_ids",),
                         nested={"sampling_params": _vllm_sampling()}, doc=doc))


def vllm_completions_body() -> dict:
    doc = ("vLLM CompletionRequest with a token-id prompt; sampling fields at the top level; n samples "
           f"(1..{vllm.MAX_N}) share one prefill, seeded seed + i. Answer: CompletionResponse; "
           "choices[i].routed_experts is base64 of .npy bytes [rows, L, K] "
           "(uint8/uint16/int32 by E), rows [s, P + G - 1); token_ids with return_token_ids")
    fields = (*vllm.COMPLETION_READ, *vllm.SAMPLING_READ, *vllm.SAMPLING_FREE, "n")
    defaults = {k: v for k, v in {**vllm.COMPLETION_DEFAULTS, **vllm.SAMPLING_DEFAULTS}.items() if k != "n"}
    return _body(_object(dict.fromkeys(fields), defaults, required=("prompt",), doc=doc))


def vllm_chat_body() -> dict:
    from r3jax.serve.peers import vllm_chat

    doc = ("vLLM ChatCompletionRequest: messages (system / user / assistant / tool; string or text-part content) "
           "rendered by the server's chat tokenizer; sampling fields, n, return_token_ids, return_routed_experts "
           "and routed_experts_prompt_start as on /v1/completions. Answer: ChatCompletionResponse with "
           "prompt_token_ids, choices[i].message.content (the decoded token_ids), token_ids, routed_experts")
    fields, defaults = vllm_chat.chat_body_fields()
    return _body(_object(dict.fromkeys(fields), defaults, required=("messages",), doc=doc))


def sglang_body() -> dict:
    doc = ("SGLang GenerateReqInput (non-streaming). Answer: {text, output_ids, meta_info: {id, finish_reason, "
           "prompt_tokens, completion_tokens, cached_tokens, weight_version, output_token_logprobs, "
           "routed_experts: base64 int32 [rows, L, K]}}; with sampling_params.n > 1 (1.."
           f"{sglang.MAX_N}) a list of n such objects from one prefill, seeded sampling_seed + i")
    sampling = _object((*sglang.SAMPLING_READ, *sglang.SAMPLING_FREE, "n"),
                       {k: v for k, v in sglang.SAMPLING_DEFAULTS.items() if k != "n"}, doc="SGLang sampling_params")
    return _body(_object(sglang.BODY_READ, sglang.BODY_DEFAULTS, nested={"sampling_params": sampling}, doc=doc))


def tokenize_body() -> dict:
    return _body(_object(("model", "prompt", "messages", "tools", "add_generation_prompt", "add_special_tokens"),
                         doc="vLLM /tokenize: a text 'prompt', or chat 'messages' (and 'tools') rendered as "
                             "/v1/chat/completions renders them. Answer: {count, max_model_len, tokens, token_strs}"))


def detokenize_body() -> dict:
    return _body(_object(("model", "tokens"), required=("tokens",), doc="vLLM /detokenize. Answer: {prompt}"))
