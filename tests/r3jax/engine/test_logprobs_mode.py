"""``logprobs_mode``: raw logprobs are log_softmax of the untempered logits, processed ones are those of
the distribution that sampled the token (temperature, then top-k/top-p, renormalised), both checked
against an independent NumPy computation from a full-sequence fp32 forward."""

import numpy as np
import pytest

from r3jax.checks import FieldError
from r3jax.engine import GenerateRequest

PROMPTS = [[3, 17, 29, 5, 8], [40, 2, 11], [7, 7, 1, 60, 33, 9, 21], [12, 50]]


def _requests(mode, *, temperature=0.7, top_k=0, top_p=1.0, max_tokens=8):
    return [GenerateRequest(prompt_ids=p, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=100 + i, logprobs_mode=mode) for i, p in enumerate(PROMPTS)]


def _logits_at_outputs(reference, reqs, outs):
    """The full forward's logits that predicted each output token: ``[G, V]`` f64 per request."""
    full = reference([list(r.prompt_ids) + o.output_ids[:-1] for r, o in zip(reqs, outs)])
    return [logits[len(r.prompt_ids) - 1:].astype(np.float64) for r, (logits, _) in zip(reqs, full)]


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kept(scaled_row, top_k, top_p):
    """NumPy top-k then top-p (nucleus) set of one row: a bool mask over V. The nucleus is the shortest
    prefix of the probability-sorted top-k tokens whose (renormalised) mass reaches top_p; ties with
    the last kept value are kept."""
    order = np.argsort(-scaled_row, kind="stable")
    k = top_k if top_k > 0 else scaled_row.size
    top = order[:k]
    probs = np.exp(_log_softmax(scaled_row[top]))
    n = 1
    while n < k and probs[:n].sum() < top_p:
        n += 1
    return scaled_row >= scaled_row[top[n - 1]]


def _picked(logp, tokens):
    return logp[np.arange(len(tokens)), tokens]


def test_processed_logprobs_are_the_tempered_distributions(engine, reference):
    reqs = _requests("processed_logprobs")
    outs = engine.generate(reqs)
    for logits, out in zip(_logits_at_outputs(reference, reqs, outs), outs):
        want = _picked(_log_softmax(logits / 0.7), out.output_ids)
        np.testing.assert_allclose(out.logprobs, want, atol=1e-5)
        # and not the temperature-1 ones (what every mode returned before)
        assert np.abs(np.asarray(out.logprobs) - _picked(_log_softmax(logits), out.output_ids)).max() > 1e-3


def test_raw_logprobs_are_the_untempered_log_softmax_and_the_default(engine, reference):
    raw = engine.generate(_requests("raw_logprobs"))
    default = engine.generate([GenerateRequest(prompt_ids=p, max_tokens=8, temperature=0.7, seed=100 + i)
                               for i, p in enumerate(PROMPTS)])
    processed = engine.generate(_requests("processed_logprobs"))
    reqs = _requests("raw_logprobs")
    for logits, out, d, pr in zip(_logits_at_outputs(reference, reqs, raw), raw, default, processed):
        np.testing.assert_allclose(out.logprobs, _picked(_log_softmax(logits), out.output_ids), atol=1e-5)
        assert d.output_ids == out.output_ids and d.logprobs == out.logprobs
        assert pr.output_ids == out.output_ids  # the mode changes what is reported, never what is sampled


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6), (8, 0.8)])
def test_processed_logprobs_renormalise_the_truncated_distribution(engine, reference, top_k, top_p):
    reqs = _requests("processed_logprobs", temperature=0.9, top_k=top_k, top_p=top_p)
    outs = engine.generate(reqs)
    for logits, out in zip(_logits_at_outputs(reference, reqs, outs), outs):
        scaled = logits / 0.9
        for g, tok in enumerate(out.output_ids):
            keep = _kept(scaled[g], top_k, top_p)
            assert keep[tok], f"token {tok} sampled outside the kept set"
            want = _log_softmax(np.where(keep, scaled[g], -np.inf))[tok]
            np.testing.assert_allclose(out.logprobs[g], want, atol=1e-5)


def test_greedy_processed_logprobs_equal_raw(engine):
    raw = engine.generate(_requests("raw_logprobs", temperature=0.0, top_k=3))
    processed = engine.generate(_requests("processed_logprobs", temperature=0.0, top_k=3))
    for r, p in zip(raw, processed):
        assert r.output_ids == p.output_ids
        np.testing.assert_allclose(p.logprobs, r.logprobs, atol=1e-6)
        assert max(r.logprobs) < 0  # untruncated: the greedy token is not given all the mass


@pytest.mark.parametrize("bad", ["processed", "raw_logits", "", None, 1, True])
def test_bad_logprobs_mode_is_refused_naming_the_field(engine, bad):
    req = GenerateRequest(prompt_ids=[1, 2], logprobs_mode=bad)
    with pytest.raises(FieldError, match="logprobs_mode") as err:
        req.validate(vocab_size=64, max_seq_len=64)
    assert err.value.field == "logprobs_mode" and err.value.value == bad
    assert "'raw_logprobs' or 'processed_logprobs'" in err.value.expected
    with pytest.raises(FieldError) as err:
        engine.generate([GenerateRequest(prompt_ids=[1, 2]), req])
    assert err.value.field == "requests[1].logprobs_mode"
