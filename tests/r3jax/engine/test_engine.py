"""Engine behaviour against a full-sequence forward of the same model: greedy tokens, logprobs,
routes past the prompt start, capture on/off, batching, seeds, stop tokens, weights."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateOutput, GenerateRequest
from r3jax.routes import route_dtype

MAX_SEQ, MAX_BATCH = 64, 4
L, K = MoeConfig.tiny().num_moe_layers, MoeConfig.tiny().top_k


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, MoeConfig.tiny().vocab_size, n).tolist()


# (P, max_tokens, s): s = 0, 0 < s < P and s = P all appear
GREEDY_CASES = [(3, 8, 0), (17, 8, 5), (30, 6, 30), (45, 10, 44)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, max_seq_len=MAX_SEQ, max_batch_size=MAX_BATCH, prefill_chunk=32)


@pytest.fixture(scope="module")
def nocache(tiny_model):
    # 16-token prefill chunks: long prompts take several prefill calls
    return Engine(tiny_model, max_seq_len=MAX_SEQ, max_batch_size=MAX_BATCH, prefix_cache_bytes=0,
                  prefill_chunk=16)


@pytest.fixture(scope="module")
def greedy(engine):
    reqs = [GenerateRequest(prompt_ids=_prompt(i, p), max_tokens=g, temperature=0.0,
                            return_routed_experts=True, routed_experts_prompt_start=s)
            for i, (p, g, s) in enumerate(GREEDY_CASES)]
    return reqs, engine.generate(reqs)


def test_greedy_equals_stepwise_argmax_of_full_forward(greedy, reference):
    reqs, outs = greedy
    seqs = [list(r.prompt_ids) for r in reqs]
    want_lp = [[] for _ in reqs]
    for g in range(max(r.max_tokens for r in reqs)):
        live = [i for i, r in enumerate(reqs) if g < r.max_tokens]
        for i, (logits, _) in zip(live, reference([seqs[i] for i in live])):
            tok = int(np.argmax(logits[-1]))
            want_lp[i].append(float(jax.nn.log_softmax(logits[-1])[tok]))
            seqs[i].append(tok)
    for req, out, seq, lp in zip(reqs, outs, seqs, want_lp):
        assert out.output_ids == seq[len(req.prompt_ids):]
        assert out.finish_reason == "length" and out.prompt_tokens == len(req.prompt_ids)
        np.testing.assert_allclose(out.logprobs, lp, atol=2e-5)


def test_routes_equal_live_routes_of_full_forward_sliced_at_s(greedy, reference):
    reqs, outs = greedy
    full = reference([list(r.prompt_ids) + o.output_ids[:-1] for r, o in zip(reqs, outs)])
    for req, out, (_, live) in zip(reqs, outs, full):
        s = req.routed_experts_prompt_start
        assert out.routed_experts.dtype == route_dtype(8) == np.uint8
        assert out.routed_experts_start == s
        np.testing.assert_array_equal(out.routed_experts, live[s:])


def test_row_count_is_P_minus_s_plus_G_minus_1(greedy, engine):
    reqs, outs = greedy
    for (p, g, s), out in zip(GREEDY_CASES, outs):
        assert len(out.output_ids) == g
        assert out.routed_experts.shape == (p - s + g - 1, L, K)
    # s = P with a single generated token: no row at all
    [out] = engine.generate([GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=1, temperature=0.0,
                                             return_routed_experts=True, routed_experts_prompt_start=3)])
    assert len(out.output_ids) == 1 and out.routed_experts.shape == (0, L, K)


def test_capture_on_and_off_give_identical_tokens_and_logprobs(nocache):
    def run(capture):
        reqs = [GenerateRequest(prompt_ids=_prompt(10 + i, 5 + 9 * i), max_tokens=12, temperature=t, seed=i,
                                return_routed_experts=capture) for i, t in enumerate([0.0, 1.0, 0.7])]
        return nocache.generate(reqs)

    on, off = run(True), run(False)
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.routed_experts.shape[0] == len(a.output_ids) + a.prompt_tokens - 1 and b.routed_experts is None


MIXED = [dict(temperature=0.0), dict(temperature=0.9, seed=11), dict(temperature=1.3, top_k=5, seed=12),
         dict(temperature=0.7, top_p=0.8, seed=13), dict(temperature=1.0, top_k=3, top_p=0.9, seed=14)]


def test_mixed_batch_rows_equal_running_each_alone(nocache):
    reqs = [GenerateRequest(prompt_ids=_prompt(20 + i, p), max_tokens=g, return_routed_experts=True,
                            routed_experts_prompt_start=p // 2, **kw)
            for i, ((p, g), kw) in enumerate(zip([(9, 7), (33, 12), (2, 15), (20, 4), (40, 9)], MIXED))]
    together = nocache.generate(reqs)  # 5 requests > max_batch_size: two batches
    for req, out in zip(reqs, together):
        [alone] = nocache.generate([req])
        assert out.output_ids == alone.output_ids and out.finish_reason == alone.finish_reason
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=2e-5)
        np.testing.assert_array_equal(out.routed_experts, alone.routed_experts)


def test_same_seed_same_output_and_unseeded_requests_differ(nocache):
    req = GenerateRequest(prompt_ids=_prompt(30, 6), max_tokens=10, seed=1234, return_routed_experts=True)
    others = [GenerateRequest(prompt_ids=[i + 1], max_tokens=3, return_routed_experts=True) for i in range(3)]
    a, again, b = nocache.generate([req]), nocache.generate([req]), nocache.generate(others + [req])
    assert a[0].output_ids == again[0].output_ids and a[0].logprobs == again[0].logprobs
    assert a[0].output_ids == b[3].output_ids  # another batch: same tokens (float sums may differ in ulps)
    np.testing.assert_allclose(a[0].logprobs, b[3].logprobs, atol=2e-5)
    free = GenerateRequest(prompt_ids=_prompt(30, 6), max_tokens=10, return_routed_experts=True)
    assert nocache.generate([free])[0].output_ids != nocache.generate([free])[0].output_ids


def test_stop_token_is_included_and_ends_the_request(greedy, engine):
    reqs, outs = greedy
    req, ids = reqs[1], outs[1].output_ids
    stop = ids[2]
    first = ids.index(stop)
    [out] = engine.generate([GenerateRequest(
        prompt_ids=req.prompt_ids, max_tokens=req.max_tokens, temperature=0.0, stop_token_ids=[271, stop],
        return_routed_experts=True, routed_experts_prompt_start=req.routed_experts_prompt_start)])
    assert out.output_ids == ids[:first + 1] and out.finish_reason == "stop"
    np.testing.assert_array_equal(out.routed_experts, outs[1].routed_experts[:len(req.prompt_ids) - 5 + first])


def test_logprobs_off_returns_none(nocache):
    [out] = nocache.generate([GenerateRequest(prompt_ids=[1, 2], max_tokens=3, return_logprobs=False,
                                              return_routed_experts=True)])
    assert isinstance(out, GenerateOutput) and out.logprobs is None and len(out.output_ids) == 3


def test_set_weights_changes_the_model_and_bumps_the_version(tiny_model, nocache):
    _, params, _ = nnx.split(tiny_model, nnx.Param, ...)
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    other = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
    nnx.update(other, scaled)
    fresh = Engine(other, max_seq_len=MAX_SEQ, max_batch_size=MAX_BATCH, prefix_cache_bytes=0, prefill_chunk=16)
    req = GenerateRequest(prompt_ids=_prompt(40, 12), max_tokens=6, temperature=0.0, return_routed_experts=True)
    before = nocache.generate([req])[0]
    version = nocache.weight_version
    assert nocache.set_weights(scaled) == version + 1 == nocache.weight_version
    after, want = nocache.generate([req])[0], fresh.generate([req])[0]
    assert after.weight_version == version + 1 and before.weight_version == version
    assert after.output_ids == want.output_ids and after.logprobs == want.logprobs
    assert after.logprobs != before.logprobs
    np.testing.assert_array_equal(after.routed_experts, want.routed_experts)
    nocache.set_weights(params)  # restore for the other tests
    assert nocache.generate([req])[0].logprobs == before.logprobs


def test_set_weights_rejects_a_mismatched_tree(tiny_model, nocache):
    _, params, _ = nnx.split(tiny_model, nnx.Param, ...)
    bad = jax.tree.map(lambda x: x, params)
    bad["embed"].set_value(jnp.zeros((3, 3)))
    version = nocache.weight_version
    with pytest.raises(ValueError,
                       match=r"params_state\['embed'\].*shape \(3, 3\).*expected shape \(272, 64\)"):
        nocache.set_weights(bad)
    with pytest.raises(ValueError, match=r"params_state: tree structure"):
        nocache.set_weights({"embed": params["embed"]})
    assert nocache.weight_version == version  # unchanged by the failed calls


def test_concurrent_generate_calls_are_serialised(nocache):
    reqs = [GenerateRequest(prompt_ids=_prompt(50 + i, 4), max_tokens=5, seed=i, return_routed_experts=True)
            for i in range(4)]
    want = [o.output_ids for o in nocache.generate(reqs)]
    got = {}

    def run(i):
        got[i] = nocache.generate([reqs[i]])[0].output_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(4)] == want


def test_bf16_compute_override(tiny_model, nocache):
    bf16 = Engine(tiny_model, max_seq_len=MAX_SEQ, max_batch_size=MAX_BATCH, prefix_cache_bytes=0,
                  prefill_chunk=16, dtype=jnp.bfloat16)
    assert bf16.config.dtype == jnp.bfloat16 and tiny_model.config.dtype == jnp.float32
    req = GenerateRequest(prompt_ids=_prompt(60, 10), max_tokens=6, temperature=0.0, return_routed_experts=True)
    [lo], [hi] = bf16.generate([req]), nocache.generate([req])
    assert lo.routed_experts.shape == hi.routed_experts.shape == (15, L, K)
    assert lo.routed_experts.max() < 8
    np.testing.assert_allclose(lo.logprobs, hi.logprobs, atol=0.1)  # same model, coarser arithmetic


def test_expert_kernel_choice(tiny_model):
    # on CPU the engine runs the per-expert loop kernel (fastest decode there); the model is untouched
    assert Engine(tiny_model, max_seq_len=MAX_SEQ, max_batch_size=1).config.moe_impl == "loop"
    explicit = Engine(tiny_model, max_seq_len=MAX_SEQ, max_batch_size=1, moe_impl="ragged")
    assert explicit.config.moe_impl == "ragged"
    assert tiny_model.config.moe_impl == "ragged"
