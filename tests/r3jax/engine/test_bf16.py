"""bf16 rollouts on CPU: the step program does per-token work, not per-pool work, and the pool's bit
storage changes no output.

XLA:CPU runs a 16-bit float pool's scatters and gathers by converting the whole pool to f32 on every
step (tens of ms a step on a small engine), so on CPU the engine stores 16-bit floats as their uint16
bits. The bf16 check once used ``np.issubdtype(bfloat16, np.floating)``, which is False, and every bf16
step paid that conversion: 17-27x an fp32 step. These tests read the compiled program instead of timing it.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from models import MoeConfig
from models.paged import PagedCache
from r3jax.engine import GenerateRequest

V = MoeConfig.tiny().vocab_size
# one decode bucket and one prefill row: two programs per engine. 29 pages: a dimension no other array of
# the step has, so a shape holding it is the pool's
KW = dict(decode_buckets=1, prefill_rows=1, num_pages=29)
_CONVERT = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* convert\(")


def pool_converts(hlo: str, num_pages: int) -> list[str]:
    """Element-type conversions in an optimized HLO module whose result has a pool-sized dimension."""
    return [f"{dt}[{dims}]" for dt, dims in _CONVERT.findall(hlo)
            if str(num_pages) in dims.split(",")]


@pytest.fixture(scope="module")
def engines(tiny_model, make_engine):
    return {dt: make_engine(tiny_model, dtype=getattr(jnp, dt), **KW) for dt in ("bfloat16", "float32")}


def test_the_pool_is_stored_as_bits_on_cpu(engines):
    assert engines["bfloat16"]._k[0].dtype == np.uint16 and engines["float32"]._k[0].dtype == np.uint32
    assert PagedCache.init_pool(MoeConfig.tiny(), 3, 8, bits=True, dtype=jnp.bfloat16)[0][0].dtype == np.uint16
    assert PagedCache.init_pool(MoeConfig.tiny(), 3, 8, bits=False, dtype=jnp.bfloat16)[0][0].dtype == jnp.bfloat16


@pytest.mark.parametrize("prefill_rows", [0, 1])
def test_no_step_converts_the_pool_and_bf16_moves_no_more_bytes_than_fp32(engines, prefill_rows):
    steps = {dt: e.step_program(prefill_rows=prefill_rows) for dt, e in engines.items()}
    for dt, exe in steps.items():
        assert pool_converts(exe.as_text(), KW["num_pages"]) == [], dt
    # the detector sees a pool conversion where there is one (what the bf16 step held before)
    assert pool_converts("%c = f32[1,29,8,2,16]{4,3,2,1,0} convert(bf16[1,29,8,2,16]{4,3,2,1,0} %p)", 29)
    cost = {dt: exe.cost_analysis() for dt, exe in steps.items()}
    cost = {dt: (c[0] if isinstance(c, list) else c)["bytes accessed"] for dt, c in cost.items()}
    # within 15%: the bf16 engine of an fp32 model casts the weights in its program (the decode loop,
    # once a call); per-step work over the pool or the batch in f32 would show as far more
    assert cost["bfloat16"] <= 1.15 * cost["float32"], cost


def test_bit_storage_changes_no_bf16_output(tiny_model, engines, make_engine, monkeypatch):
    """A pool stored as bf16 itself (what ran before) gives the same greedy tokens, logprobs and route
    rows as the uint16 bit pool, on a fixed prompt set."""
    import r3jax.engine.device as engine_module  # where the engine builds its pool

    init = PagedCache.init_pool

    class NativePool(PagedCache):
        init_pool = staticmethod(lambda *a, bits=False, **kw: init(*a, bits=False, **kw))

    monkeypatch.setattr(engine_module, "PagedCache", NativePool)
    # another page count: the process-wide program cache keys on it (not on the pool's dtype)
    native = make_engine(tiny_model, dtype=jnp.bfloat16, **{**KW, "num_pages": 31})
    assert native._k[0].dtype == jnp.bfloat16
    rng = np.random.default_rng(3)
    reqs = [GenerateRequest(prompt_ids=rng.integers(0, V, n).tolist(), max_tokens=8, temperature=0.0,
                            return_logprobs=True, return_routed_experts=True) for n in (5, 17, 30, 41)]
    got, want = engines["bfloat16"].generate(reqs), native.generate(reqs)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        np.testing.assert_array_equal(g.routed_experts, w.routed_experts)
        np.testing.assert_array_equal(np.asarray(g.logprobs, np.float32), np.asarray(w.logprobs, np.float32))


def test_the_engine_runs_the_head_in_fp32_unless_told_not_to(tiny_model, engines, make_engine):
    """By default a bf16 engine computes the LM head in fp32 (the model is not changed);
    ``logits_dot_in_fp32=False`` keeps it in bf16, and the logprobs of the same greedy tokens differ."""
    on = engines["bfloat16"]
    assert on.config.logits_dot_in_fp32 and not tiny_model.config.logits_dot_in_fp32
    off = make_engine(tiny_model, dtype=jnp.bfloat16, logits_dot_in_fp32=False, **{**KW, "num_pages": 33})
    assert not off.config.logits_dot_in_fp32
    rng = np.random.default_rng(5)
    reqs = [GenerateRequest(prompt_ids=rng.integers(0, V, n).tolist(), max_tokens=1, temperature=0.0)
            for n in (6, 13, 22, 35)]
    a, b = on.generate(reqs), off.generate(reqs)
    same = [(x.logprobs[0], y.logprobs[0]) for x, y in zip(a, b) if x.output_ids == y.output_ids]
    assert same and any(x != y for x, y in same), same


def test_a_batch_submitted_together_gives_the_same_bf16_outputs_every_time(tiny_model, engines, make_engine):
    """What a seed fixes (docs/models.md): the same requests submitted together to engines in the same
    state (a fresh one each) give bit-equal tokens, logprobs and route rows, seeded sampling included."""
    rng = np.random.default_rng(5)
    reqs = [GenerateRequest(prompt_ids=rng.integers(0, V, n).tolist(), max_tokens=10, temperature=1.0, seed=i,
                            return_logprobs=True, return_routed_experts=True) for i, n in enumerate((3, 12, 26, 40))]
    runs = [make_engine(tiny_model, dtype=jnp.bfloat16, **KW).generate(reqs) for _ in range(2)]
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids and a.cached_tokens == b.cached_tokens == 0
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_array_equal(np.asarray(a.logprobs, np.float32), np.asarray(b.logprobs, np.float32))
