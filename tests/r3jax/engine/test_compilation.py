"""Every device program is compiled by warmup(); a thousand varied requests afterwards (lengths,
max_tokens, stop tokens, sampling parameters, routes on/off, prefix hits, evictions, admission waits
for pages, cancellations) compile nothing more."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from models import MoeConfig

from r3jax.engine import GenerateRequest

V = MoeConfig.tiny().vocab_size


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.compiled = []

    def emit(self, record):
        if record.getMessage().startswith("Finished XLA compilation of"):
            self.compiled.append(record.getMessage())


def _varied(rng, prompts):
    p_ids = prompts[int(rng.integers(len(prompts)))] if rng.random() < 0.3 else \
        rng.integers(0, V, int(rng.integers(1, 56))).tolist()  # repeats hit the prefix cache
    p = len(p_ids)
    new = 1 + int(rng.exponential(6)) if rng.random() < 0.9 else int(rng.integers(1, 64 - p + 1))  # long-tailed
    return GenerateRequest(
        prompt_ids=p_ids, max_tokens=min(new, 64 - p),
        temperature=float(rng.choice([0.0, 0.6, 1.0])), top_k=int(rng.choice([0, 3])),
        top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(0, 2**40)) if rng.random() < 0.5 else None,
        stop_token_ids=rng.integers(0, V, int(rng.integers(0, 5))).tolist(),
        return_logprobs=bool(rng.random() < 0.8), return_routed_experts=bool(rng.random() < 0.8),
        routed_experts_prompt_start=int(rng.integers(0, p + 1)))


def test_no_program_compiles_after_warmup_over_1000_varied_requests(engine):
    assert engine.warmed_up
    programs = engine.stats["compiled_programs"]
    assert engine.warmup()["new"] == 0  # warming up again finds nothing to compile
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, n).tolist() for n in (9, 17, 30, 41)]
    cached_before, evictions_before = engine.stats["cached_tokens"], engine.stats["prefix_cache_evictions"]
    log, logger = _CompileLog(), logging.getLogger("jax")
    logger.addHandler(log)
    try:
        with jax.log_compiles(True):
            total, wave = 0, 0
            while total < 1000:  # waves of 1..80 concurrent requests: 1,000 in all
                n = min(40 if wave == 0 else int(rng.integers(1, 81)), 1000 - total)
                reqs = [_varied(rng, prompts) for _ in range(n)]
                total, wave = total + n, wave + 1
                futures = [engine.submit(r) for r in reqs]
                if wave % 3 == 1:
                    futures[-1].cancel()
                for req, fut in zip(reqs, futures):
                    if fut.cancelled():
                        continue
                    out = fut.result(timeout=120)
                    g, p, s = len(out.output_ids), len(req.prompt_ids), req.routed_experts_prompt_start
                    assert 1 <= g <= req.max_tokens
                    assert (out.finish_reason == "stop") == (out.output_ids[-1] in req.stop_token_ids)
                    if req.return_routed_experts:
                        assert out.routed_experts.shape == (p - s + g - 1, 2, 2)
                    else:
                        assert out.routed_experts is None
    finally:
        logger.removeHandler(log)
    assert total == 1000
    assert engine.stats["cached_tokens"] > cached_before  # prefix hits were part of the mix
    assert engine.stats["prefix_cache_evictions"] > evictions_before  # and evictions
    assert log.compiled == []
    assert engine.stats["compiled_programs"] == programs


def test_decode_buckets_and_mixed_decode_buckets_set_the_program_set(tiny_model):
    """Decode programs at B, B/2, B/4 (decode_buckets=3); steps that prefill only at the largest
    mixed_decode_buckets of them (default 1: B), each with prefill rows 4 and 16, so 5 programs, or 9
    with all three; decode_buckets=1 gives 3. A step that prefills pads its decode rows up to a mixed
    size and its prefill rows up to 4 or 16. 0 is refused by name."""
    from r3jax.engine import Engine
    from r3jax.checks import FieldError

    kw = dict(max_seq_len=64, max_batch_size=16, num_pages=25, prefix_cache_bytes=0)
    three, every, one = (Engine(tiny_model, **kw), Engine(tiny_model, mixed_decode_buckets=3, **kw),
                         Engine(tiny_model, decode_buckets=1, **kw))
    try:
        rows = lambda e: [(lay.decode_rows, lay.prefill_rows) for lay in e.layouts()]  # noqa: E731
        assert rows(three) == [(4, 0), (8, 0), (16, 0), (16, 4), (16, 16)]
        assert rows(every) == [(d, p) for d in (4, 8, 16) for p in (0, 4, 16)]
        assert rows(one) == [(16, 0), (16, 4), (16, 16)]
        assert (three.layout(1, 0).decode_rows, three.layout(1, 1).decode_rows) == (4, 16)
        assert (every.layout(1, 1).decode_rows, every.layout(5, 4).decode_rows) == (4, 8)
        assert (three.layout(1, 1).prefill_rows, three.layout(1, 5).prefill_rows) == (4, 16)
        assert one.layout(1, 0).decode_rows == 16
    finally:
        three.close(), every.close(), one.close()
    for name in ("decode_buckets", "mixed_decode_buckets"):
        with pytest.raises(FieldError, match=name) as e:
            Engine(tiny_model, **{name: 0}, **kw)
        assert e.value.field == name and e.value.value == 0


def test_close_frees_programs_no_other_live_engine_holds(tiny_model, make_engine):
    """Engines of one configuration share compiled programs; closing one keeps them for the other,
    closing the last frees them from the process-wide cache (a live executable keeps its code mapped)."""
    from r3jax.engine.programs import shared_programs

    kw = dict(num_pages=27, decode_buckets=1, prefill_rows=1)  # a configuration no other test uses
    base = shared_programs()
    a, b = make_engine(tiny_model, **kw), make_engine(tiny_model, **kw)
    a.step_program(prefill_rows=0)
    assert shared_programs() == base + 1 and a.programs.compiles == 1
    b.step_program(prefill_rows=0)  # shared: nothing compiled
    assert shared_programs() == base + 1 and b.programs.compiles == 0
    a.close()
    assert shared_programs() == base + 1  # b still holds it
    assert len(a.programs) == 1  # what the closed engine needed is still counted
    b.close()
    assert shared_programs() == base
    with pytest.raises(Exception, match="closed"):
        b.step_program(prefill_rows=0)


_STARTS = """
import json, sys
from flax import nnx
from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateRequest
model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
req = GenerateRequest(prompt_ids=list(range(1, 12)), max_tokens=9, temperature=0.0, return_routed_experts=True)
out = []
for program_cache in [None if a == "-" else a for a in sys.argv[1:]]:  # each engine builds its programs again
    eng = Engine(model, max_seq_len=32, max_batch_size=2, decode_buckets=1, prefill_rows=1, prefix_cache_bytes=0,
                 moe_impl="dense", program_cache=program_cache)
    w = eng.warmup()
    [o] = eng.generate([req])
    out.append({**w, "tokens": o.output_ids, "routes": o.routed_experts.tolist()})
    eng.close()
print(json.dumps(out))
"""


def test_warmup_says_which_programs_came_from_a_cache_and_loaded_ones_run_the_same(tmp_path):
    """A fresh process on empty caches: the first engine compiles its 2 programs (and stores them), a
    second one with the same program cache loads both without tracing, a third without it gets both
    from JAX's persistent cache. A second process with a new program cache (its key missed: another
    r3jax version) gets its programs from JAX's cache and stores none of them (such an executable used to
    be stored without its compiled functions and fail at its first run in a third process); the third
    process runs. Every engine decodes the same tokens and route rows."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["R3JAX_TEST_XLA_FLAGS"],
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}

    def starts(*caches):
        p = subprocess.run([sys.executable, "-c", _STARTS, *caches], env=env,
                           cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first, again, jax_cache = starts(str(tmp_path / "programs"), str(tmp_path / "programs"), "-")
    assert [(w["programs"], w["new"], w["compiled"], w["loaded"]) for w in (first, again, jax_cache)] == \
        [(2, 2, 2, 0), (2, 2, 0, 2), (2, 2, 0, 2)]
    assert len(list((tmp_path / "programs").glob("*.bin"))) == 2
    [stored] = starts(str(tmp_path / "other"))
    [loaded] = starts(str(tmp_path / "other"))
    assert (stored["compiled"], stored["loaded"], loaded["compiled"], loaded["loaded"]) == (0, 2, 0, 2)
    assert not list((tmp_path / "other").glob("*.bin"))
    for w in (again, jax_cache, stored, loaded):
        assert w["tokens"] == first["tokens"] and w["routes"] == first["routes"]
    assert len(first["tokens"]) == 9


def test_a_program_cache_entry_that_cannot_be_read_is_compiled_over(tmp_path, caplog):
    from r3jax.engine.program_cache import ProgramCache

    cache = ProgramCache(tmp_path, "f" * 64)
    args = (np.zeros(3, np.int32),)
    path = cache._path("step", ("layout", 1), args)
    path.write_bytes(b"not a program")
    with caplog.at_level(logging.WARNING, logger="r3jax.engine"):
        assert cache.load("step", ("layout", 1), args) is None
    assert f"{path.name} not loaded" in caplog.text and cache.loaded == 0
    assert cache.load("step", ("layout", 2), args) is None  # another key: nothing stored, nothing said
