"""The prefill applies the LM head only at each row's last prompt token, so the vocabulary no longer
caps the prefill chunk: a prompt longer than the old logits-bound cap is prefilled in one call, and
its tokens, logprobs and routes still equal the full-sequence forward."""

import jax
import numpy as np

from models import MoeConfig
from r3jax.engine import GenerateRequest
from r3jax.engine import engine as engine_mod


def test_vocab_does_not_cap_the_prefill_chunk(tiny_model, make_engine, reference, monkeypatch):
    cfg = MoeConfig.tiny()
    rows = 4
    # a logits budget so small that the old rule caps the chunk at 16 tokens
    monkeypatch.setattr(engine_mod, "_LOGITS_BYTES", 4 * rows * cfg.vocab_size * 16)
    assert engine_mod.prefill_chunk_limit(cfg, rows, 64, 64, head_only=False) == 16
    assert engine_mod.prefill_chunk_limit(cfg, rows, 64, 64, head_only=True) == 64
    eng = make_engine(tiny_model, prefill_chunk=64, min_prefill_chunk=64)
    assert eng._chunk_buckets == [64]
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, 50).tolist()
    req = GenerateRequest(prompt_ids=prompt, max_tokens=4, temperature=0.0, return_routed_experts=True)
    [out] = eng.generate([req])
    assert eng.stats["prefill_calls"] == 1  # 50 tokens > 16: the old cap needed 4 calls
    [(logits, live)] = reference([prompt + out.output_ids[:-1]])
    p = len(prompt)
    assert out.output_ids == np.argmax(logits[p - 1:], axis=-1).tolist()
    want = np.take_along_axis(jax.nn.log_softmax(logits[p - 1:]), np.array(out.output_ids)[:, None], 1)[:, 0]
    np.testing.assert_allclose(out.logprobs, want, atol=2e-5)
    np.testing.assert_array_equal(out.routed_experts, live)
