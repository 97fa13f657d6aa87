"""An E = 384 (Kimi-K2-shaped, tiny dims) model end to end: its routes -> r3jax.routes wire forms
(JSON and binary) -> RoutedExpertTrace over two turns -> collate -> train_step with replay, int16
all the way and no id truncated.

The rollout stand-in is the model's own full-sequence forward (the engine/HTTP leg of this path is
wired in tests/r3jax once the rebuilt engine lands): row i is the route used when token i was fed.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import MoeConfig, MoeTransformer, stacking
from r3jax import routes as routes_lib
from r3jax import train
from r3jax.batch import collate
from r3jax.trace import RoutedExpertTrace

KIMI_TINY = dict(vocab_size=64, hidden_size=16, num_layers=2, first_dense_layers=1, num_heads=2, num_kv_heads=2,
                 head_dim=12, attention="mla", qk_rope_head_dim=4, q_lora_rank=0, kv_lora_rank=8, v_head_dim=6,
                 qk_norm=False, num_experts=384, top_k=8, moe_intermediate_size=4, dense_intermediate_size=16,
                 router="sigmoid_bias_grouped", routed_scaling_factor=2.827, num_shared_experts=1, moe_impl="dense")
TURNS = ((5, 4), (3, 4))  # (new prompt tokens, generated tokens) per turn


def _wire(rows, start, layers):
    """Both wire forms, decoded as a receiver would (JSON through a real dumps/loads)."""
    obj = json.loads(json.dumps(routes_lib.encode(rows, start, layers)))
    assert obj["dtype"] == "int16"
    a, a_start, a_layers = routes_lib.decode_payload(obj, num_experts=384)
    b, b_start, b_layers = routes_lib.decode_binary(routes_lib.encode_binary(rows, start, layers), num_experts=384)
    assert a.dtype == b.dtype == np.int16 and (a_start, a_layers) == (b_start, b_layers) == (start, list(layers))
    np.testing.assert_array_equal(a, b)
    return a


def test_e384_routes_stay_int16_from_model_to_train_step():
    cfg = MoeConfig(**KIMI_TINY)
    assert routes_lib.route_dtype(cfg.num_experts) == np.int16 and cfg.moe_layer_ids == (1,)
    model = MoeTransformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p))
    rng = np.random.default_rng(0)

    tokens, trace, loss_mask = [], RoutedExpertTrace(), []
    for new_prompt, gen in TURNS:  # each turn: the engine call contract with start = rows captured so far
        tokens += rng.integers(1, cfg.vocab_size, new_prompt + gen).tolist()
        p, n = len(tokens) - gen, len(tokens)
        padded = np.zeros((1, 16), np.int32)  # one compilation: right padding is invisible to real tokens
        padded[0, :n] = tokens
        out = fwd(state, jnp.asarray(padded), jnp.arange(16, dtype=jnp.int32)[None])
        full = np.asarray(out.routes[0, :n])  # [n, L, K] int32, the model's own routes
        s = trace.prompt_start
        rows = full[s:n - 1].astype(routes_lib.route_dtype(cfg.num_experts))  # P - s + G - 1 rows
        assert rows.shape[0] == p - s + gen - 1
        trace = trace.record(prompt_len=p, generated_len=gen, routes=_wire(rows, s, cfg.moe_layer_ids),
                             layers=cfg.moe_layer_ids)
        loss_mask += [0.0] * (p - len(loss_mask)) + [1.0] * gen
    logprobs = np.asarray(jax.nn.log_softmax(out.logits[0, :n]))[np.arange(n - 1), tokens[1:]]
    routes, captured = trace.finalize(token_count=n, loss_mask=np.asarray(loss_mask, np.float32))
    assert routes.dtype == np.int16 and captured.sum() == n - 1
    np.testing.assert_array_equal(routes[:n - 1], full[:n - 1])
    assert routes.max() > 255  # ids a uint8 would have truncated really occur

    traj = dict(tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(loss_mask, np.float32),
                rollout_logprobs=np.concatenate([[0.0], logprobs]).astype(np.float32) * np.asarray(loss_mask),
                advantage=1.0, routes=routes, captured=captured)
    batch = collate([traj], seq_len=32, num_experts=cfg.num_experts, top_k=cfg.top_k, num_layers=cfg.num_moe_layers)
    assert batch.routes.dtype == np.int16
    np.testing.assert_array_equal(batch.routes[0, :n - 1], full[:n - 1])
    assert batch.route_mask[0].tolist() == [True] * (n - 1) + [False] * (32 - n + 1)

    state = train.init_train_state(model, optax.sgd(0.1))
    before = jax.device_get(state.params)
    state, m = train.train_step(state, batch, replay="rollout", config=train.LossConfig(aux_coef=0.0))
    m = {k: np.asarray(v) for k, v in m.items()}
    assert int(state.step) == 1 and np.isfinite(m["loss"])
    assert m["routing_disagreement"] == 0.0 and m["live_routing_disagreement"] == 0.0  # same model, fp32
    assert m["fallback_fraction"] == 0.0 and m["mean_abs_delta"] < 1e-5
    after = jax.device_get(state.params)
    router = lambda params: np.asarray(stacking.layer(params, cfg, 1)["mlp"]["router"][...])
    moved = np.abs(router(after) - router(before)).max()
    assert moved > 0  # the sigmoid router learns through the replayed gates
