"""Engine cores for data parallelism: two cores on their own simulated devices answer as one engine
does, share the load, send one prompt's samples (and its next turn) to one core, and take weights
together."""

import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.checks import FieldError
from r3jax.engine import EngineFailedError, GenerateRequest
from r3jax.engine.group import EngineGroup

from .conftest import ENGINE_KW

V = MoeConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def group(tiny_model):
    g = EngineGroup(tiny_model, data=2, seed=5, **ENGINE_KW)
    g.warmup()
    yield g
    g.close()


def _requests(seed: int, n: int, **kw) -> list[GenerateRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(1, 40))
        out.append(GenerateRequest(prompt_ids=rng.integers(0, V, p).tolist(), max_tokens=int(rng.integers(1, 20)),
                                   return_routed_experts=True, routed_experts_prompt_start=[0, p, p // 2][i % 3],
                                   **kw))
    return out


def _same(a, b):
    assert a.output_ids == b.output_ids
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_cores_live_on_their_own_devices(group):
    devices = [{d for x in _leaves(core._params) for d in x.devices()} for core in group.cores]
    assert all(len(d) == 1 for d in devices) and devices[0] != devices[1]
    assert {d for x in group.cores[1]._k for d in x.devices()} == devices[1]


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_the_group_answers_as_one_engine_and_spreads_the_load(engine, group):
    before = group.stats["routed"]
    reqs = _requests(3, 8, temperature=0.0) + [
        GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=12, temperature=1.0, seed=s) for s in range(4)]
    for a, b in zip(engine.generate(reqs), group.generate(reqs)):
        _same(a, b)
    routed = np.subtract(group.stats["routed"], before)
    assert routed.sum() == len(reqs) and routed.min() >= 2  # both cores served (3-token prompts: no page key)


def test_a_prompts_samples_and_its_next_turn_go_to_one_core(engine, group):
    prompt = np.random.default_rng(8).integers(0, V, 33).tolist()  # 4 whole pages of 8 tokens and one more
    reqs = [GenerateRequest(prompt_ids=prompt, max_tokens=6, temperature=1.0, seed=s, return_routed_experts=True)
            for s in range(4)]
    before = [core.stats for core in group.cores]
    outs = group.generate(reqs)
    for a, b in zip(engine.generate(reqs), outs):
        _same(a, b)
    after = [core.stats for core in group.cores]
    served = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    assert sorted(served) == [0, 4]
    home = served.index(4)
    fed = after[home]["prefill_tokens"] - before[home]["prefill_tokens"]
    assert fed <= 1.5 * len(prompt)  # the samples share the prompt's pages
    turn2 = GenerateRequest(prompt_ids=prompt + outs[0].output_ids + [1, 2], max_tokens=4, temperature=0.0)
    cached = group.cores[home].stats["cached_tokens"]
    out = group.generate([turn2])[0]
    assert group.cores[home].stats["cached_tokens"] - cached == out.cached_tokens == 32
    _same(engine.generate([turn2])[0], out)


def test_a_batch_is_split_by_the_load_it_adds(group):
    group.generate([GenerateRequest(prompt_ids=[1], max_tokens=1)])  # both cores idle after this
    before = group.stats["routed"]
    reqs = [GenerateRequest(prompt_ids=[i + 1, 2, 3], max_tokens=2, temperature=0.0) for i in range(8)]
    futures = group.submit_many(reqs)
    assert [f.result(timeout=60).output_ids for f in futures] == [o.output_ids for o in group.generate(reqs)]
    assert np.subtract(group.stats["routed"], before).tolist() == [8, 8]  # 4 + 4 of each batch


def test_a_batch_a_core_refuses_runs_nowhere(group, monkeypatch):
    """A core that fails between routing and queuing: the shares the other cores queued are cancelled
    (none of the batch runs) and the core's error is raised."""
    group.generate([GenerateRequest(prompt_ids=[1], max_tokens=1)])  # both cores idle: the batch goes to both
    queued = []
    first = group.cores[0].submit_many
    monkeypatch.setattr(group.cores[0], "submit_many", lambda *a: queued.extend(first(*a)) or queued)

    def refuse(*a):
        raise EngineFailedError("a stand-in failure")

    monkeypatch.setattr(group.cores[1], "submit_many", refuse)
    reqs = [GenerateRequest(prompt_ids=[i + 1, 2, 3], max_tokens=30, temperature=0.0) for i in range(4)]
    routed = group.stats["routed"]
    with pytest.raises(EngineFailedError, match="a stand-in failure"):
        group.submit_many(reqs)
    assert len(queued) == 2 and all(f.cancelled() for f in queued)
    assert group.stats["routed"] == routed  # routed: requests sent to a core that ran them
    monkeypatch.undo()
    assert [o.output_ids for o in group.generate(reqs[:1])] == [o.output_ids for o in group.generate(reqs[:1])]


def test_affinity_yields_to_a_much_less_loaded_core():
    g = EngineGroup.__new__(EngineGroup)  # routing alone: stand-in cores with set loads
    cores = [_StandIn(live=0), _StandIn(live=9)]
    g.cores, g.block_size, g._routed, g._affine = cores, 8, [0, 0], 0
    g._lock, g._affinity = __import__("threading").Lock(), __import__("collections").OrderedDict()
    prompt = np.arange(16, dtype=np.int32)
    g._affinity.update({k: 1 for k in g._keys(prompt)})
    assert g._route(prompt) == 0  # core 1 holds 9 > 0 + max_batch_size 4: the prefix is not worth the wait
    cores[1].live = 4
    g._affinity.update({k: 1 for k in g._keys(prompt)})
    assert g._route(prompt) == 1 and g._affine == 1
    assert g._route(prompt, added=[0, 1]) == 0  # a batch's own earlier requests count: 5 > 0 + 4
    assert g._route(np.arange(3, dtype=np.int32), added=[5, 0]) == 1  # no page key: the least loaded
    cores[1].failure = "failed"
    assert g._route(prompt) == 0  # a failed core gets nothing
    cores[0].failure = "failed too"
    assert g.failure == "core 0: failed too; core 1: failed"


class _StandIn:
    max_batch_size = 4

    def __init__(self, live):
        self.live, self.failure = live, None

    @property
    def _sched(self):
        return type("S", (), {"live": self.live, "queued": 0})()


def test_seedless_requests_draw_seeds_in_the_group(engine, group):
    """A request without a seed gets one drawn by the group, so its answer is that of the same request
    with that seed on any engine, whichever core ran it."""
    reqs = [GenerateRequest(prompt_ids=[3 + i, 4, 5], max_tokens=8, temperature=1.0) for i in range(4)]
    group._rng = np.random.default_rng(11)  # the draws from here on are known
    outs = group.generate(reqs)
    rng = np.random.default_rng(11)
    seeded = [GenerateRequest(prompt_ids=r.prompt_ids, max_tokens=8, temperature=1.0,
                              seed=int(rng.integers(1 << 63))) for r in reqs]
    for a, b in zip(engine.generate(seeded), outs):
        assert a.output_ids == b.output_ids


def test_weights_reach_every_core_under_one_version(group, make_engine):
    other = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(1))
    state = nnx.state(other, nnx.Param)
    version = group.set_weights(state, version=group.weight_version + 3, mode="keep")
    assert [core.weight_version for core in group.cores] == [version] * 2 == [group.weight_version] * 2
    reqs = _requests(4, 6, temperature=0.0)
    fresh = make_engine(other)
    for a, b in zip(fresh.generate(reqs), group.generate(reqs)):
        _same(a, b)
    with pytest.raises(FieldError, match="version"):
        group.set_weights(state, version=version)


def test_bad_arguments(tiny_model):
    with pytest.raises(FieldError, match="data"):
        EngineGroup(tiny_model, data=0, **ENGINE_KW)
    with pytest.raises(FieldError, match=r"data \* tensor \* expert = 16 devices, only 8 given"):
        EngineGroup(tiny_model, data=4, tensor=2, expert=2, **ENGINE_KW)
    with pytest.raises(FieldError, match="mesh"):
        EngineGroup(tiny_model, data=2, mesh=None, **ENGINE_KW)


def test_stats_add_the_cores_up(group):
    s = group.stats
    assert s["data"] == 2 and len(s["cores"]) == 2 and s["failed_cores"] == 0 and s["failure"] is None
    for key in ("requests", "generated_tokens", "prefill_tokens", "compiled_programs"):
        assert s[key] == sum(c[key] for c in s["cores"])
    assert s["requests"] == sum(s["routed"]) > 0


def test_a_failed_core_keeps_its_weights_and_the_others_update(group, tiny_model):
    core = group.cores[1]
    core._sched.failure = "a stand-in failure"
    try:
        version = group.set_weights(nnx.state(tiny_model, nnx.Param), mode="keep")
        assert group.cores[0].weight_version == version > core.weight_version
        core._sched.failure = "again"
        group.cores[0]._sched.failure = "and again"
        with pytest.raises(Exception, match="core 0: and again; core 1: again"):
            group.set_weights(nnx.state(tiny_model, nnx.Param))
    finally:
        group.cores[0]._sched.failure = core._sched.failure = None


def test_cores_of_two_devices_each(engine, tiny_model):
    """data 2 x tensor 2: each core splits its heads and MLP over its own 2 devices."""
    kw = {**ENGINE_KW, "prefill_rows": 1, "prefix_cache_bytes": 0}  # fewer programs to compile
    g = EngineGroup(tiny_model, data=2, tensor=2, **kw)
    try:
        assert [len(core.placement.mesh.devices.flat) for core in g.cores] == [2, 2]
        assert not set(g.cores[0].placement.mesh.devices.flat) & set(g.cores[1].placement.mesh.devices.flat)
        reqs = _requests(6, 6, temperature=0.0)
        for a, b in zip(engine.generate(reqs), g.generate(reqs)):
            _same(a, b)
    finally:
        g.close()
