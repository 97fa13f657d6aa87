"""AgentLoop against the real tiny engine in process and over HTTP (greedy, fp32; the same engine behind
uvicorn): incremental routes equal a full re-gather and one full forward over the final sequence, row
for row."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax.batch import collate
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


# ---- chat: the server renders the conversation ---------------------------------------------------

class IdChat:
    """A test chat tokenizer whose text round-trips every id (id i is the character U+E000 + i; plain
    Latin-1 text encodes to its bytes), so a reply's ``content`` re-encodes to the ids the model sampled:
    the template below is prefix-stable. ``drop_history``: earlier assistant replies render empty (as
    Qwen3's template drops earlier reasoning): not prefix-stable."""

    BOS, END, ROLES = 256, 257, {"system": 258, "user": 259, "assistant": 260, "tool": 261}
    vocab_size = 272

    def __init__(self, drop_history: bool = False):
        self.drop_history = drop_history

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0xE000 if 0xE000 <= ord(c) < 0xE000 + self.vocab_size else ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0xE000 + int(i)) for i in ids if not (skip_special_tokens and int(i) == self.END))

    def chat_ids(self, messages) -> list[int]:
        ids = [self.BOS]
        for m in messages:
            text = "" if self.drop_history and m["role"] == "assistant" else m["content"]
            ids += [self.ROLES[m["role"]]] + self.encode(text) + [self.END]
        return ids + [self.ROLES["assistant"]]


class CountingChat:
    """Three user turns; the reward counts the reply's characters (any reply is fine here)."""

    stop_token_ids = (IdChat.END,)

    def reset(self, seed):
        self.turn = 0
        return [{"role": "system", "content": "count"}, {"role": "user", "content": f"q{seed}"}]

    def step(self, message):
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        self.turn += 1
        return [{"role": "user", "content": f"t{self.turn}"}], len(message["content"]) / 10, self.turn >= 3


@pytest.fixture(scope="module")
def chat_server(engine, serve_helpers):
    """``chat_server(tokenizer)``: a server of the module's engine rendering chats with ``tokenizer``."""
    from r3jax.serve import create_app

    return lambda tokenizer: serve_helpers.thread_server(create_app(engine, warmup=False, tokenizer=tokenizer,
                                                                    served_model_name="tiny"))


def _chat_runs(url, **kw):
    from r3jax.serve.client import RemoteInferenceClient

    def loop(client, **more):
        return AgentLoop(client, CountingChat, max_turns=3, max_seq_len=MAX_SEQ, seed=5, chat=True,
                         sampling={"max_tokens": 5, "temperature": 1.0}, max_concurrency=4, **more, **kw)

    with RemoteInferenceClient(url) as client:
        with loop(client) as inc_loop:
            inc = inc_loop.run(2, 2, env_seeds=[1, 2])
        with loop(client, full_regather=True) as full_loop:
            full = full_loop.run(2, 2, env_seeds=[1, 2])
    return inc, full


def _check_chat(inc, full, model):
    assert len(inc) == len(full) == 4
    for a, b, fwd in zip(inc, full, _forward_routes(model, inc)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.captured, b.captured)
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)
        assert a.captured.sum() == a.num_tokens - 1  # the last token's row is never computed
        np.testing.assert_array_equal(a.routes[a.captured], fwd[a.captured])  # every row where its token is
        assert b.starts == [0] * b.num_turns and a.num_turns == 3


def test_chat_loop_through_a_prefix_stable_template(chat_server, model):
    """A template that keeps earlier tokens: each turn asks only for new rows, every row crosses the wire
    once, and the trajectory equals a full re-gather and one full forward."""
    with chat_server(IdChat()) as srv:
        inc, full = _chat_runs(srv.url)
    _check_chat(inc, full, model)
    for a in inc:
        assert a.rerendered_turns == 0
        assert a.starts == [0] + [t.prompt_tokens + t.generated_tokens - 1 for t in a.turns[:-1]]
        assert a.route_rows == a.num_tokens - 1
        first = IdChat().chat_ids([{"role": "system", "content": "count"},
                                   {"role": "user", "content": f"q{a.env_seed}"}])
        assert list(a.prompt_ids) == first and a.loss_mask[:len(first)].sum() == 0


def test_chat_loop_detects_a_template_that_is_not_prefix_stable(chat_server, model):
    """A template that rewrites earlier replies: the turn after a reply finds the rendering changed at
    that reply's first token, drops what follows and asks for its rows again; nothing is misaligned
    (the rows equal a full forward of the final tokens); ``on_prefix_break="raise"`` raises."""
    from r3jax.rollout import PrefixMismatchError

    with chat_server(IdChat(drop_history=True)) as srv:
        inc, full = _chat_runs(srv.url)
        with pytest.raises(PrefixMismatchError, match="prefix invariant broken at token"):
            _chat_runs(srv.url, on_prefix_break="raise")
    _check_chat(inc, full, model)
    broken = 0
    for a in inc:
        for prev, t in zip(a.turns, a.turns[1:]):
            empty = prev.generated_tokens == 1 and prev.finish_reason == "stop"  # only the END token
            want = None if empty else prev.prompt_tokens  # the reply's first token is the first rewritten
            assert t.rerendered_from == want
            if want is not None:
                assert t.routes_start == want and t.route_rows == t.prompt_tokens - want + t.generated_tokens - 1
                broken += 1
        assert a.route_rows >= a.num_tokens - 1
    assert broken >= 4  # rows were re-sent in most turns (random replies are rarely empty)


# ---- a turn across weight updates ----------------------------------------------------------------

def test_a_turn_aborted_by_two_weight_updates_keeps_each_segments_routes(engine, model, serve_helpers):
    """A partial rollout: a turn is aborted twice mid-call by weight updates (``set_weights(mode="abort")``
    held until the call has 3 tokens), and the loop resubmits prompt + tokens from the trace's cursor each
    time. The trajectory's route rows equal, segment by segment, what that segment's weights produce at
    those positions (a full forward with them), never recomputed by a later version; the environment
    sees the whole turn once."""
    update_mid_call = serve_helpers.update_mid_call
    _, params, _ = nnx.split(model, nnx.Param, ...)
    versions = [params, jax.tree.map(lambda x: x * 1.5, params), jax.tree.map(lambda x: x * 0.6, params)]

    class Updating:
        """The engine; its first two calls are aborted by an update to the next weights."""
        config, moe_layer_ids, max_seq_len = engine.config, engine.moe_layer_ids, engine.max_seq_len
        calls = 0

        def generate(self, requests):
            [req] = requests
            if self.calls < 2:
                [fut], _ = update_mid_call(engine, [req], versions[self.calls + 1], "abort")
                out = fut.result(timeout=60)
                assert out.finish_reason == "abort"
            else:
                [out] = engine.generate([req])
            self.calls += 1
            return [out]

    steps = []

    class OneTurn(ArithmeticEnv):
        def step(self, action):
            steps.append(list(action))
            return super().step(action)

    v0 = engine.set_weights(versions[0])
    try:
        loop = AgentLoop(Updating(), lambda: OneTurn(num_turns=1), max_turns=1, max_seq_len=MAX_SEQ,
                         sampling={"max_tokens": 40, "temperature": 0.0, "stop_token_ids": ()})
        [traj] = loop.run(1, 1, env_seeds=[3])
    finally:
        engine.set_weights(params)
    assert [t.finish_reason for t in traj.turns] == ["abort", "abort", "length"] and traj.num_turns == 3
    assert sum(t.generated_tokens for t in traj.turns) == 40 and traj.weight_version_changed
    assert len(steps) == 1 and steps[0] == list(traj.response_ids[:40])  # the whole turn, once
    assert traj.captured.sum() == traj.num_tokens - 1 - int(traj.turns[-1].synthetic_eos)
    fwds = []
    for weights in versions:
        other = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
        nnx.update(other, weights)
        fwds += _forward_routes(other, [traj])
    for t, fwd, j in zip(traj.turns, fwds, range(3)):
        lo, hi = t.routes_start, t.prompt_tokens + t.generated_tokens - 1
        assert hi - lo == t.route_rows and (lo == 0) == (j == 0)
        np.testing.assert_array_equal(traj.routes[lo:hi], fwd[lo:hi])
        if j:  # the versions route these positions differently: the check tells them apart
            assert not np.array_equal(fwds[j - 1][lo:hi], fwd[lo:hi])
    starts = traj.starts
    assert starts[1] == traj.turns[0].prompt_tokens + traj.turns[0].generated_tokens - 1  # from the cursor
    # each generated token carries the version that sampled it; the prompt none
    want = np.full(traj.num_tokens, -1)
    for j, t in enumerate(traj.turns):
        want[t.prompt_tokens:t.prompt_tokens + t.generated_tokens] = v0 + j
    np.testing.assert_array_equal(traj.token_versions, want)
    # each segment's route rows keep the version that produced them (the trace's own record, never
    # re-stamped by a later call), and collate carries them into the batch
    rows = np.full(traj.num_tokens, -1)
    for j, t in enumerate(traj.turns):
        rows[t.routes_start:t.prompt_tokens + t.generated_tokens - 1] = v0 + j
    np.testing.assert_array_equal(traj.route_versions, rows)
    cfg = engine.config
    batch = collate([traj], seq_len=MAX_SEQ, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    num_layers=cfg.num_moe_layers)
    np.testing.assert_array_equal(np.asarray(batch.route_versions)[0, :traj.num_tokens], rows)
    assert (np.asarray(batch.route_versions)[0, traj.num_tokens:] == -1).all()
