"""What a caller asks the engine for and what it gets back, plus the host-side validation of a request
(and of a batch of them, before any is queued).

Validation runs on the host before anything is compiled or run; every error is a
:class:`r3jax.checks.FieldError` (a ValueError carrying ``field``/``value``/``expected`` as data) built by
the shared rules of :mod:`r3jax.checks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from r3jax.checks import (DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES, FieldError, check_int, check_logprobs_mode,
                          check_prompt_start, check_real, check_seed, check_top_k, is_int)

__all__ = ["DEFAULT_LOGPROBS_MODE", "LOGPROBS_MODES", "GenerateOutput", "GenerateRequest", "check_logprobs_mode"]


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM's _SAMPLING_EPS)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One prompt to continue.

    ``temperature`` below :data:`GREEDY_BELOW` (1e-5, vLLM's rule; 0 included) is greedy: a smaller
    one would overflow the scaled logits; ``top_k=0`` and ``top_p=1`` switch those filters off. ``seed`` fixes
    the request's random draws whatever the batch (the logits themselves can differ in their last bits
    with the shape of the step the token ran in: docs/models.md, "What a seed fixes"). A sampled stop
    token is included in ``output_ids`` and ends the request with finish_reason "stop".
    ``routed_experts_prompt_start`` = s: the route rows returned are those of absolute positions
    ``[s, P + G - 1)``. ``session_id`` is carried for callers (the prefix cache is keyed by tokens).

    ``logprobs_mode`` (vLLM's ``--logprobs-mode`` names and meaning) picks which distribution the
    returned logprobs are taken under:

    - ``"raw_logprobs"`` (default, as in vLLM): log_softmax of the model's logits, before
      temperature, top-k and top-p.
    - ``"processed_logprobs"``: log_softmax of the logits after temperature scaling and top-k/top-p
      masking, i.e. the renormalised distribution the token was actually sampled from (the sampled
      token is always inside the kept set, so its logprob is finite). Greedy rows
      (``temperature`` < 1e-5) are untempered and unfiltered, as in vLLM, so there processed equals raw.

    A trainer taking importance ratios against processed logprobs must process its logits the same
    way (``r3jax.train.LossConfig(temperature=T, top_k=k, top_p=p)`` with the request's values).
    """

    prompt_ids: Sequence[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    return_logprobs: bool = True
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0
    session_id: str | None = None
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE

    def validate(self, *, vocab_size: int, max_seq_len: int, max_stop_tokens: int | None = None) -> np.ndarray:
        """Check every field; return the prompt as an int32 array ``[P]``. Raises
        :class:`r3jax.checks.FieldError` (a ValueError) naming the field, the value and the expectation."""
        prompt = _token_array("prompt_ids", self.prompt_ids, vocab_size)
        if prompt.size == 0:
            raise FieldError("prompt_ids", [], "at least one token id",
                             "prompt_ids=[]: expected at least one token id")
        p = int(prompt.size)
        check_int("max_tokens", self.max_tokens, lo=1)
        if p + self.max_tokens > max_seq_len:
            raise FieldError("max_tokens", self.max_tokens, f"prompt length + max_tokens <= max_seq_len={max_seq_len}",
                             f"max_tokens={self.max_tokens}: prompt length {p} + max_tokens = "
                             f"{p + self.max_tokens}, expected <= max_seq_len={max_seq_len}")
        # every number below lands in an int32 / float32 device array shared by the whole decode batch:
        # one that does not fit must be refused here, or it fails every request decoding beside it
        check_real("temperature", self.temperature, 0.0, math.inf)
        check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_top_k("top_k", self.top_k, vocab_size)
        if self.seed is not None:
            check_seed("seed", self.seed)
        stops = _token_array("stop_token_ids", self.stop_token_ids, vocab_size)
        if max_stop_tokens is not None and stops.size > max_stop_tokens:
            raise FieldError("stop_token_ids", list(self.stop_token_ids), f"at most {max_stop_tokens} ids",
                             f"stop_token_ids has {stops.size} ids: expected at most {max_stop_tokens}")
        for name in ("return_logprobs", "return_routed_experts"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise FieldError(name, value, "a bool")
        check_prompt_start(self.routed_experts_prompt_start, p)
        if self.session_id is not None and not isinstance(self.session_id, str):
            raise FieldError("session_id", self.session_id, "a str or None")
        check_logprobs_mode(self.logprobs_mode)
        return prompt


@dataclasses.dataclass(frozen=True, eq=False)
class GenerateOutput:
    """The continuation of one request.

    output_ids: the G sampled tokens (a stop token included). logprobs: log-probability of each under
    the distribution the request's ``logprobs_mode`` names (raw: log_softmax of the model's logits;
    processed: after temperature and top-k/top-p), or None if not asked for.
    routed_experts: ``[P - s + G - 1, L, K]`` in ``r3jax.routes.route_dtype(E)``, the rows of absolute
    positions ``[s, P + G - 1)`` (rows of prefix-cached positions are the ones recorded when those
    tokens were first processed), or None. cached_tokens: prompt tokens whose KV came from the prefix
    cache; None when a remote generator did not report it (SkyRL's answer has no such field; vLLM's
    only with ``--enable-prompt-tokens-details``): unknown, never read as 0. routed_experts_start: s.
    finish_reason: "stop", "length", or "abort" (a weight update with ``mode="abort"`` returned what the
    request had: resubmit prompt + output_ids to go on). weight_version: the version when the request
    was admitted; weight_versions: ``((first token index, version), ...)`` spans of the versions that
    sampled its tokens (several only when a weight update with ``mode="keep"`` came mid-request;
    empty when the generator does not say).
    """

    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    routed_experts: np.ndarray | None
    prompt_tokens: int
    cached_tokens: int | None
    weight_version: int
    routed_experts_start: int
    weight_versions: tuple = ()


def _token_array(name, value, vocab_size) -> np.ndarray:
    """A 1-D sequence of int token ids in [0, vocab_size) as int32 ``[N]``."""
    if not isinstance(value, (list, tuple, range, np.ndarray)) and hasattr(value, "__array__"):
        value = np.asarray(value)  # e.g. a jax.Array
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not (value.size == 0 or np.issubdtype(value.dtype, np.integer)):
            raise FieldError(name, value, "a 1-D integer array",
                             f"{name}: array of dtype {value.dtype} and shape {value.shape}, "
                             "expected a 1-D integer array")
        arr = value.astype(np.int64)
    else:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise FieldError(name, value, "a sequence of int token ids")
        for i, t in enumerate(value):
            if not is_int(t):
                raise FieldError(f"{name}[{i}]", t, "an int token id")
            if not 0 <= t < vocab_size:
                raise FieldError(f"{name}[{i}]", int(t), f"token ids in [0, vocab_size={vocab_size})")
        return np.asarray(value, dtype=np.int32).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise FieldError(f"{name}[{i}]", int(arr[i]), f"token ids in [0, vocab_size={vocab_size})")
    return arr.astype(np.int32)


def each_checked(requests: Sequence[GenerateRequest], on_tokens, check) -> list:
    """``check(request, on_token)`` of every request, in order, before anything is queued; a FieldError
    names ``requests[i].field``. ``on_tokens``: None or one callback (or None) per request."""
    on_tokens = [None] * len(requests) if on_tokens is None else list(on_tokens)
    if len(on_tokens) != len(requests):
        raise FieldError("on_tokens", len(on_tokens), f"one per request ({len(requests)})")
    out = []
    for i, (req, on_token) in enumerate(zip(requests, on_tokens)):
        try:
            out.append(check(req, on_token))
        except FieldError as e:
            raise e.within(f"requests[{i}]") from None
    return out


def generate_all(requests: Sequence[GenerateRequest], validate, submit) -> list[GenerateOutput]:
    """``generate`` of an engine or a group of engines: every request checked by ``validate`` before
    ``submit(requests)`` queues them (a list of futures back), then the outputs in request order; if
    waiting is interrupted (or one fails), the others are cancelled."""
    if isinstance(requests, GenerateRequest) or not isinstance(requests, Sequence):
        raise FieldError("requests", type(requests).__name__, "a list of GenerateRequest",
                         f"requests={type(requests).__name__}: expected a list of GenerateRequest")
    for i, req in enumerate(requests):
        if not isinstance(req, GenerateRequest):
            raise FieldError(f"requests[{i}]", type(req).__name__, "a GenerateRequest",
                             f"requests[{i}]={type(req).__name__}: expected a GenerateRequest")
        try:
            validate(req)
        except FieldError as e:
            raise e.within(f"requests[{i}]") from None
    futures = submit(list(requests))
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise
