"""AgentLoop against the real tiny engine in process and over HTTP (greedy, fp32; the same engine behind
uvicorn): incremental routes equal a full re-gather and one full forward over the final sequence, row
for row."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine
from r3jax.rollout import AgentLoop, ArithmeticEnv, GuessNumberEnv

MAX_SEQ = 128
SAMPLING = {"max_tokens": 6, "temperature": 0.0}


def _loop(gen, **kw):
    return AgentLoop(gen, lambda: ArithmeticEnv(num_turns=3), max_turns=3, max_seq_len=MAX_SEQ,
                     sampling=SAMPLING, **kw)


@pytest.fixture(scope="module")
def model():
    return MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))  # what `serve --model tiny` builds


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, max_seq_len=MAX_SEQ, max_batch_size=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine, serve_helpers):
    """The same engine behind a real uvicorn server in a thread (no warm-up: it compiles what the
    in-process runs compile, once); ``python -m r3jax serve`` processes are tested in tests/r3jax/serve."""
    from r3jax.serve import create_app

    with serve_helpers.thread_server(create_app(engine, warmup=False)) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def engine_runs(engine):
    inc = _loop(engine).run(2, 2, env_seeds=[11, 12])
    full = _loop(engine, full_regather=True).run(2, 2, env_seeds=[11, 12])
    return inc, full


def _forward_routes(model, trajs) -> list[np.ndarray]:
    """Routes of one full forward over each final sequence (one padded batch, one compile)."""
    n = max(t.num_tokens for t in trajs)
    tokens = np.zeros((len(trajs), n), np.int32)
    for i, t in enumerate(trajs):
        tokens[i, :t.num_tokens] = t.tokens
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x, p: nnx.merge(graphdef, s)(x, p).routes)
    routes = np.asarray(fwd(state, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(n), tokens.shape)))
    return [routes[i, :t.num_tokens] for i, t in enumerate(trajs)]


def _check_rollouts(inc, full, model):
    assert len(inc) == len(full) == 4
    for a, b, fwd in zip(inc, full, _forward_routes(model, inc)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.captured, b.captured)
        # logprobs: same tokens, but prefix-cache hits change the prefill chunking (float rounding)
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)
        assert a.captured.sum() > 0
        np.testing.assert_array_equal(a.routes[a.captured], fwd[a.captured])  # exact ids, same order
        # starts [0, P1 + G1 - 1, ...]; every token's row crossed the wire once
        want = [0] + [t.prompt_tokens + t.generated_tokens - 1 for t in a.turns[:-1]]
        assert a.starts == want and b.starts == [0] * b.num_turns
        trailing = int(a.turns[-1].synthetic_eos)  # a turn cut by max_tokens ends with a synthetic EOS
        assert a.route_rows == a.captured.sum() == a.num_tokens - 1 - trailing
        assert b.route_rows == sum(t.prompt_tokens + t.generated_tokens - 1 for t in b.turns)
        assert a.routes.dtype == np.uint8 and a.routes.shape == (a.num_tokens, 2, 2)


def test_engine_incremental_equals_full_regather_and_full_forward(engine_runs, model):
    inc, full = engine_runs
    _check_rollouts(inc, full, model)
    assert [t.num_turns for t in inc] == [3] * 4
    # later turns hit the engine's prefix cache
    assert all(t.turns[-1].cached_tokens > 0 for t in inc)


def test_engine_truncation_at_max_seq_len(engine):
    # 4 rollouts so every call reuses the batch-4 programs compiled above
    loop = AgentLoop(engine, lambda: GuessNumberEnv(max_guesses=50), max_turns=50, max_seq_len=40,
                     sampling=SAMPLING)
    trajs = loop.run(2, 2, env_seeds=[3, 4])
    assert [t.finish_reason for t in trajs] == ["max_seq_len"] * 4  # the random model never finds it
    for t in trajs:
        assert t.truncated and t.num_tokens <= 40
        assert t.loss_mask.shape == t.rollout_logprobs.shape == t.captured.shape == (t.num_tokens,)
        assert t.loss_mask[t.route_rows + 1:].sum() == 0 and t.captured.sum() == t.route_rows


def test_http_client_incremental_equals_full_regather_and_engine(server, engine_runs, model):
    from r3jax.serve.client import RemoteInferenceClient

    with RemoteInferenceClient(server) as client:
        with _loop(client, max_concurrency=4) as inc_loop:
            assert inc_loop.mode == "async"
            inc = inc_loop.run(2, 2, env_seeds=[11, 12])
        with _loop(client, full_regather=True) as full_loop:
            full = full_loop.run(1, 2, env_seeds=[11]) + full_loop.run(1, 2, env_seeds=[12])  # loop reused
    _check_rollouts(inc, full, model)
    for a, e in zip(inc, engine_runs[0]):  # same weights, greedy: same as in process
        np.testing.assert_array_equal(a.tokens, e.tokens)
        np.testing.assert_array_equal(a.routes, e.routes)
        assert a.starts == e.starts and a.route_bytes == e.route_bytes
