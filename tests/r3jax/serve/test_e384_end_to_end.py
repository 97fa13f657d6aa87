"""An E = 384 (Kimi-K2-shaped, tiny dims) model end to end: engine -> HTTP in every wire form (r3jax
binary and JSON, SkyRL, vLLM, SGLang) -> RoutedExpertTrace over two turns -> collate -> train_step with
replay, int16 all the way and no id truncated. The independent reference for every route row is the
model's own full-sequence forward (row i: the experts used when token i was fed)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer
from r3jax import routes as routes_lib
from r3jax import train
from r3jax.batch import collate
from r3jax.engine import Engine, GenerateRequest
from r3jax.serve import RemoteInferenceClient, create_app
from r3jax.trace import RoutedExpertTrace

KIMI_TINY = dict(vocab_size=64, hidden_size=16, num_layers=2, first_dense_layers=1, num_heads=2, num_kv_heads=2,
                 head_dim=12, attention="mla", qk_rope_head_dim=4, q_lora_rank=0, kv_lora_rank=8, v_head_dim=6,
                 qk_norm=False, num_experts=384, top_k=8, moe_intermediate_size=4, dense_intermediate_size=16,
                 router="sigmoid_bias_grouped", routed_scaling_factor=2.827, num_shared_experts=1, moe_impl="dense")
TURNS = ((5, 4), (3, 4))  # (new prompt tokens, generated tokens) per turn
WIRES = [("r3jax", True), ("r3jax", False), ("skyrl", False), ("vllm", False), ("sglang", False)]


@pytest.fixture(scope="module")
def kimi(serve_helpers):
    cfg = MoeConfig(**KIMI_TINY)
    assert routes_lib.route_dtype(cfg.num_experts) == np.int16 and cfg.moe_layer_ids == (1,)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, max_seq_len=32, max_batch_size=1, prefix_cache_bytes=0, block_size=8, prefill_chunk=16,
                    prefill_rows=1, moe_impl="dense")
    # no warm-up: this test needs a handful of the engine's programs, compiled as they are first used
    with serve_helpers.thread_server(create_app(engine, warmup=False, served_model_name="kimi")) as srv:
        yield model, engine, srv.url
    engine.close()


def test_e384_routes_stay_int16_from_engine_over_every_wire_to_train_step(kimi):
    model, engine, url = kimi
    cfg = model.config
    clients = {(p, b): RemoteInferenceClient(url, protocol=p, binary_routes=b, model="kimi") for p, b in WIRES}
    rng = np.random.default_rng(0)
    tokens, trace, loss_mask, logprobs = [], RoutedExpertTrace(), [], []
    try:
        for new_prompt, gen in TURNS:
            tokens += rng.integers(1, cfg.vocab_size, new_prompt).tolist()
            req = GenerateRequest(list(tokens), max_tokens=gen, temperature=0.0, return_routed_experts=True,
                                  routed_experts_prompt_start=trace.prompt_start)
            outs = {wire: c.generate([req])[0] for wire, c in clients.items()}
            first = outs[WIRES[0]]
            for wire, out in outs.items():
                assert out.routed_experts.dtype == np.int16, wire
                assert out.output_ids == first.output_ids and out.logprobs == first.logprobs, wire
                np.testing.assert_array_equal(out.routed_experts, first.routed_experts, err_msg=str(wire))
            p, g, s = len(tokens), len(first.output_ids), trace.prompt_start
            assert first.routed_experts.shape == (p - s + g - 1, 1, 8)
            trace = trace.record(prompt_len=p, generated_len=g, routes=first.routed_experts, layers=cfg.moe_layer_ids)
            loss_mask += [0.0] * (p - len(loss_mask)) + [1.0] * g
            logprobs += [0.0] * (p - len(logprobs)) + list(first.logprobs)
            tokens += first.output_ids
    finally:
        for c in clients.values():
            c.close()
    n = len(tokens)
    routes, captured = trace.finalize(token_count=n, loss_mask=np.asarray(loss_mask, np.float32))
    assert routes.dtype == np.int16 and captured.sum() == n - 1

    graphdef, state = nnx.split(model)
    padded = np.zeros((1, 32), np.int32)
    padded[0, :n] = tokens
    full = nnx.merge(graphdef, state)(jnp.asarray(padded), jnp.arange(32, dtype=jnp.int32)[None])
    np.testing.assert_array_equal(routes[:n - 1], np.asarray(full.routes[0, :n - 1]))  # the model's own routes
    assert routes.max() > 255  # ids a uint8 would have truncated really occur

    traj = dict(tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(loss_mask, np.float32),
                rollout_logprobs=np.asarray(logprobs, np.float32) * np.asarray(loss_mask, np.float32),
                advantage=1.0, routes=routes, captured=captured)
    batch = collate([traj], seq_len=32, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers)
    assert batch.routes.dtype == np.int16
    np.testing.assert_array_equal(batch.routes[0, :n - 1], routes[:n - 1])
    assert batch.route_mask[0].tolist() == [True] * (n - 1) + [False] * (32 - n + 1)

    state = train.init_train_state(model, optax.sgd(0.1))
    before = jax.device_get(state.params)
    state, m = train.train_step(state, batch, replay="rollout", config=train.LossConfig(aux_coef=0.0))
    m = {k: np.asarray(v) for k, v in m.items()}
    assert int(state.step) == 1 and np.isfinite(m["loss"])
    assert m["fallback_fraction"] == 0.0
    assert m["mean_abs_delta"] < 1e-4  # the engine's logprobs are the trainer's (fp32 both)
    after = jax.device_get(state.params)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), after, before)
    router = [v for path, v in jax.tree_util.tree_leaves_with_path(moved) if "router" in jax.tree_util.keystr(path)]
    assert router and max(router) > 0  # the sigmoid router learns through the replayed gates
