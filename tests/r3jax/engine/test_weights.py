"""Weight updates while requests decode: drain ("wait") finishes in-flight requests on the old weights,
abort_in_flight fails them with the retryable EngineAborted, mode "abort" returns what they have,
mode "keep" lets them go on with the new weights (their version spans say where), and the prefix cache
never serves KV or routes of old weights after a change (compared with a fresh engine built on the new
weights)."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.engine import EngineAborted, GenerateRequest

V = MoeConfig.tiny().vocab_size


def _req(i, n=40, p=6):
    return GenerateRequest(prompt_ids=np.random.default_rng(70 + i).integers(0, V, p).tolist(), max_tokens=n,
                           temperature=0.0, return_routed_experts=True, routed_experts_prompt_start=2)


@pytest.fixture(scope="module")
def weights(tiny_model, make_engine):
    """(original params, scaled params, a fresh engine built on the scaled params)."""
    _, params, _ = nnx.split(tiny_model, nnx.Param, ...)
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    other = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
    nnx.update(other, scaled)
    return params, scaled, make_engine(other)


def _wait_live(engine, n, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s  # fail, never hang, if the requests ended first
    while engine.stats["live_slots"] < n:
        if time.monotonic() > deadline:
            pytest.fail(f"never saw {n} live slots (now {engine.stats['live_slots']})")
        time.sleep(0.001)


def _same(a, b):
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_drain_finishes_in_flight_on_the_old_weights_then_swaps(engine, weights):
    params, scaled, fresh = weights
    reqs = [_req(i) for i in range(4)]
    old = engine.generate(reqs)  # what the old weights give
    new = fresh.generate(reqs)
    assert any(a.output_ids != b.output_ids for a, b in zip(old, new))  # the change is visible
    v0 = engine.weight_version
    running = [engine.submit(r) for r in reqs]
    _wait_live(engine, 4)
    swap = threading.Thread(target=engine.set_weights, args=(scaled,))
    swap.start()
    while not engine._sched.controls:  # the swap is pending: admission has stopped
        time.sleep(0.001)
    later = [engine.submit(r) for r in reqs[:2]]
    swap.join(120)
    assert engine.weight_version == v0 + 1
    for fut, want in zip(running, old):
        out = fut.result(timeout=60)
        assert out.weight_version == v0
        _same(out, want)  # every token and route row from the old weights
    for fut, want in zip(later, new):
        out = fut.result(timeout=60)
        assert out.weight_version == v0 + 1
        _same(out, want)  # every token and route row from the new weights
    engine.set_weights(params)


def test_abort_fails_in_flight_with_a_retryable_error(engine, weights):
    params, scaled, fresh = weights
    reqs = [_req(i) for i in range(4)]
    running = [engine.submit(r) for r in reqs]
    _wait_live(engine, 4)
    aborted = engine.stats["aborted"]
    version = engine.set_weights(scaled, abort_in_flight=True)
    for fut in running:
        with pytest.raises(EngineAborted, match="weight update") as err:
            fut.result(timeout=60)
        assert err.value.retryable
    assert engine.stats["aborted"] == aborted + 4 and engine.stats["live_slots"] == 0
    retried = engine.generate(reqs)  # the retry runs wholly on the new weights
    for out, want in zip(retried, fresh.generate(reqs)):
        assert out.weight_version == version
        _same(out, want)
    engine.set_weights(params)


def test_prefix_cache_after_a_weight_change_serves_the_new_weights_routes(engine, weights):
    params, scaled, fresh = weights
    rng = np.random.default_rng(5)
    turn1 = rng.integers(0, V, 20).tolist()
    req = lambda prompt: GenerateRequest(prompt_ids=prompt, max_tokens=6, temperature=0.0,
                                         return_routed_experts=True)
    [first] = engine.generate([req(turn1)])  # its blocks are now cached (old weights)
    turn2 = turn1 + first.output_ids + rng.integers(0, V, 5).tolist()
    assert engine.generate([req(turn2)])[0].cached_tokens > 0  # same weights: a prefix hit
    engine.set_weights(scaled)
    [served] = engine.generate([req(turn2)])
    assert served.cached_tokens == 0  # the old blocks are gone with their version
    [want] = fresh.generate([req(turn2)])
    _same(served, want)
    [again] = engine.generate([req(turn2)])  # now a hit on blocks computed with the new weights
    assert again.cached_tokens > 0
    _same(again, want)
    engine.set_weights(params)


def test_keep_goes_on_with_the_new_weights_and_says_where(engine, weights, serve_helpers):
    """mode "keep": running requests continue on the new weights from the next device step; each output's
    weight_versions spans say which tokens which version sampled; tokens and route rows before the switch
    are the old weights' (greedy); a request that spans the swap indexes no page, and the old pages are
    gone, so its whole conversation is computed again on the new weights."""
    params, scaled, fresh = weights
    reqs = [_req(i, n=48) for i in range(3)]
    old = engine.generate(reqs)
    v0 = engine.weight_version
    futures, v1 = serve_helpers.update_mid_call(engine, reqs, scaled, "keep")
    assert v1 == v0 + 1
    outs = [f.result(timeout=60) for f in futures]
    switched = 0
    for out, want, req in zip(outs, old, reqs):
        assert out.finish_reason == "length" and len(out.output_ids) == 48 and out.weight_version == v0
        spans = out.weight_versions
        assert spans[0] == (0, v0) and [v for _, v in spans] in ([v0], [v0, v1]), spans
        k = spans[1][0] if len(spans) == 2 else 48
        p, s = len(req.prompt_ids), req.routed_experts_prompt_start
        assert out.output_ids[:k] == want.output_ids[:k]
        np.testing.assert_array_equal(out.routed_experts[:p - s + k - 1], want.routed_experts[:p - s + k - 1])
        if len(spans) == 2:
            switched += 1
            assert 1 <= k < 48 and out.output_ids[k:] != want.output_ids[k:]  # the new weights sampled these
    assert switched >= 1 and futures and outs[0].weight_versions[1][0] >= 3  # request 0 switched after token 3
    # nothing computed before the swap, nor by a request that spanned it, is a prefix hit now
    follow = GenerateRequest(prompt_ids=reqs[0].prompt_ids + outs[0].output_ids, max_tokens=4, temperature=0.0,
                             return_routed_experts=True)
    [a] = engine.generate([follow])
    assert a.cached_tokens == 0 and a.weight_versions == ((0, v1),)
    _same(a, fresh.generate([follow])[0])
    assert engine.generate([follow])[0].cached_tokens > 0  # computed on the new weights alone: shared
    engine.set_weights(params)


def test_abort_mode_returns_what_each_request_has_and_a_resubmission_goes_on(engine, weights, serve_helpers):
    """mode "abort": each running request that has a token returns it with finish_reason "abort": its
    tokens, logprobs and route rows [s, P + G - 1) are the old weights' (greedy); one without a token runs
    again on the new weights. Resubmitting prompt + tokens (rows from the trace's cursor) goes on there."""
    params, scaled, fresh = weights
    reqs = [_req(i, n=48) for i in range(3)]
    old = engine.generate(reqs)
    aborted = engine.stats["aborted"]
    futures, v1 = serve_helpers.update_mid_call(engine, reqs, scaled, "abort")
    outs = [f.result(timeout=60) for f in futures]
    assert outs[0].finish_reason == "abort"
    n_aborted = 0
    for out, want, req in zip(outs, old, reqs):
        if out.finish_reason != "abort":  # had no token yet: ran wholly on the new weights
            _same(out, fresh.generate([req])[0])
            continue
        n_aborted += 1
        g, p, s = len(out.output_ids), len(req.prompt_ids), req.routed_experts_prompt_start
        assert 1 <= g < 48 and out.output_ids == want.output_ids[:g]
        np.testing.assert_allclose(out.logprobs, want.logprobs[:g], atol=2e-5)
        assert out.routed_experts.shape[0] == p - s + g - 1
        np.testing.assert_array_equal(out.routed_experts, want.routed_experts[:p - s + g - 1])
        assert set(v for _, v in out.weight_versions) == {v1 - 1}
        rest = GenerateRequest(prompt_ids=req.prompt_ids + out.output_ids, max_tokens=48 - g, temperature=0.0,
                               return_routed_experts=True, routed_experts_prompt_start=p + g - 1)
        [more] = engine.generate([rest])
        assert more.weight_version == v1 and more.routed_experts.shape[0] == 1 + len(more.output_ids) - 1
        _same(more, fresh.generate([rest])[0])
    assert engine.stats["aborted"] == aborted + n_aborted and engine.stats["live_slots"] == 0
    engine.set_weights(params)


def test_set_weights_mode_is_checked(engine, weights):
    from r3jax.checks import FieldError

    with pytest.raises(FieldError, match="mode"):
        engine.set_weights(weights[0], mode="later")
    with pytest.raises(FieldError, match="abort_in_flight"):
        engine.set_weights(weights[0], abort_in_flight=True, mode="keep")


def test_set_weights_takes_the_callers_version_above_the_current_one(engine, weights):
    """A trainer numbers its pushes (its step): ``version`` sets the new weight_version, which must be
    above the current one; the version numbering goes on from it."""
    from r3jax.checks import FieldError

    now = engine.weight_version
    assert engine.set_weights(weights[0], version=now + 5) == now + 5 == engine.weight_version
    for bad in (now + 5, now, True, 1.5):
        with pytest.raises(FieldError, match="version") as e:
            engine.set_weights(weights[0], version=bad)
        assert e.value.field == "version"
    assert engine.weight_version == now + 5  # nothing swapped
    assert engine.set_weights(weights[0]) == now + 6


def test_set_weights_rejects_a_mismatched_tree(tiny_model, engine):
    _, params, _ = nnx.split(tiny_model, nnx.Param, ...)
    bad = jax.tree.map(lambda x: x, params)
    bad["embed"].set_value(jnp.zeros((3, 3)))
    version = engine.weight_version
    with pytest.raises(ValueError, match=r"params_state\['embed'\].*shape \(3, 3\).*expected shape \(272, 64\)"):
        engine.set_weights(bad)
    with pytest.raises(ValueError, match=r"params_state: tree structure"):
        engine.set_weights({"embed": params["embed"]})
    assert engine.weight_version == version


def test_router_biases_travel_with_weight_sync(tmp_path):
    """DeepSeek-style selection biases live outside the params; a sync that dropped them would leave
    the engine routing with stale biases. Here the trainer's biases force experts 6 and 7."""
    import optax

    from models import stacking
    from r3jax.engine import Engine
    from r3jax.params_io import export_params, load_params, weights_of
    from r3jax.train import init_train_state, push_to_engine

    cfg = MoeConfig.tiny().replace(router="sigmoid_bias_grouped", n_group=2, topk_group=1, moe_impl="dense")
    model = MoeTransformer(cfg, rngs=nnx.Rngs(3))
    engine = Engine(model, max_seq_len=32, max_batch_size=1, prefix_cache_bytes=0, block_size=8, prefill_chunk=16,
                    prefill_rows=1)
    try:
        req = GenerateRequest([5, 9, 2, 7], max_tokens=3, temperature=0.0, return_routed_experts=True)
        [before] = engine.generate([req])
        assert not np.isin(before.routed_experts, [6, 7]).all()
        state = init_train_state(model, optax.sgd(0.0))
        forced = jax.tree.map(lambda b: b.at[..., 6:].set(10.0), state.rest)  # every router_bias: favour 6, 7
        state = state.replace(rest=forced)
        version = push_to_engine(engine, state)
        [after] = engine.generate([req])
        assert version == engine.weight_version and np.isin(after.routed_experts, [6, 7]).all()
        reference = MoeTransformer(cfg, rngs=nnx.Rngs(3))
        nnx.update(reference, weights_of(state))
        ids = jnp.asarray([req.prompt_ids + after.output_ids[:-1]])
        full = reference(ids, jnp.arange(ids.shape[1])[None]).routes[0]
        np.testing.assert_array_equal(after.routed_experts, np.asarray(full))
        # the exported weights carry the biases too (what POST /v1/weights loads)
        fresh = load_params(export_params(tmp_path / "w", state), MoeTransformer(cfg, rngs=nnx.Rngs(0)))
        bias = lambda m: np.asarray(stacking.layer(nnx.state(m), cfg, 1)["mlp"]["router_bias"][...])
        np.testing.assert_array_equal(bias(fresh), bias(reference))
        assert bias(fresh)[6:].min() == 10.0
    finally:
        engine.close()


def test_a_weight_swap_frees_the_old_weights_as_the_new_ones_arrive(engine, weights, monkeypatch):
    """The engine never holds two copies of its weights: live device bytes during a swap stay within one
    chunk above what they were before it (a tenth of the weights, or the largest array if larger: here
    the stacked experts, 22%; a whole copy first would add all of it), and come back to where they
    were; the swapped-in weights are the ones given, placed like the old."""
    from r3jax import sharding as shard_lib
    from r3jax.engine import sharding as placement_lib

    def live() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    params, scaled, _ = weights
    copy_bytes = sum(x.nbytes for x in jax.tree.leaves(engine._params))
    chunk = max(0.1 * copy_bytes, max(x.nbytes for x in jax.tree.leaves(engine._params)))
    shardings = [x.sharding for x in jax.tree.leaves(engine._params)]
    host = jax.tree.map(np.asarray, scaled)  # host arrays: not live on the device
    base, peaks = live(), []
    real = shard_lib.place_copy

    def watched(tree, targets):
        out = real(tree, targets)
        peaks.append(live() - base)
        return out

    monkeypatch.setattr(placement_lib, "place_copy", watched)
    engine.set_weights(host)
    assert len(peaks) >= 5  # chunk by chunk
    assert max(peaks) <= chunk < 0.5 * copy_bytes, (max(peaks), chunk, copy_bytes)
    assert abs(live() - base) <= 0.01 * copy_bytes  # the old copy is gone
    assert [x.sharding for x in jax.tree.leaves(engine._params)] == shardings
    for got, want in zip(jax.tree.leaves(engine._params), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(got), want)
    engine.set_weights(params)
