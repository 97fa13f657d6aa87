"""What replay is for: on bf16 engine rollouts scored by an fp32 trainer, replaying the rollout's
routes lowers the train-inference mismatch (k3 KL and mean |Δ logprob|), and the trainer's own
router really disagrees with the rollout's, so there was something to fix.

Under replay the experts used are the replayed ids, so comparing them with the rollout's would hold
by construction; the routing metric asserted here is the router's own (live) disagreement.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
from r3jax.batch import collate
from r3jax.engine import Engine, GenerateRequest
from r3jax.trace import RoutedExpertTrace
from r3jax.train import eval_step, init_train_state

N, PROMPT_LEN, MAX_TOKENS, SEQ_LEN = 8, 8, 24, 32
SEED = 0

# MoeConfig.tiny() flips ~0.5% of (token, layer) routes between bf16 and fp32 and its 2 MoE layers'
# experts are a small part of the residual stream, so replay's effect is within noise of bf16's
# other rounding (k3 ratio ~0.5, |Δ| ratio ~0.9). Here: 4 MoE layers (no dense layer) so rounding
# compounds, E=64 so top-2 margins are narrow (~3% of routes flip), and expert outputs scaled x4 so
# a flipped expert moves the logprobs well above bf16's rounding elsewhere. Measured on seed 0:
# k3 KL 3.9e-5 -> 7.9e-7 (ratio 0.02), mean |Δ| 3.9e-3 -> 1.0e-3 (ratio 0.26), live disagreement 0.035.
CONFIG = models.MoeConfig.tiny(num_experts=64, top_k=2, num_layers=4, first_dense_layers=0,
                               moe_intermediate_size=32)
EXPERT_SCALE = 4.0


def _model():
    model = models.MoeTransformer(CONFIG, rngs=nnx.Rngs(SEED))
    params = nnx.state(model, nnx.Param)
    # every down_proj here is an expert bank (no dense layers): scaling it scales each expert's output
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, x: x * EXPERT_SCALE if "down_proj" in jax.tree_util.keystr(path) else x, params)
    nnx.update(model, scaled)
    return model


def _bf16_rollouts(model):
    """N sampled trajectories from a bf16 engine, routes assembled by the trace, collated [N, S]."""
    engine = Engine(model, max_seq_len=SEQ_LEN, max_batch_size=N, dtype=jnp.bfloat16)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, CONFIG.vocab_size, PROMPT_LEN).tolist() for _ in range(N)]
    outs = engine.generate([GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED + i,
                                            return_routed_experts=True) for i, p in enumerate(prompts)])
    trajs = []
    for p, out in zip(prompts, outs):
        g = len(out.output_ids)
        loss_mask = np.array([0.0] * len(p) + [1.0] * g, np.float32)
        trace = RoutedExpertTrace().record(prompt_len=len(p), generated_len=g, routes=out.routed_experts)
        routes, captured = trace.finalize(token_count=len(p) + g, loss_mask=loss_mask)
        trajs.append(dict(tokens=np.array(p + list(out.output_ids), np.int32), loss_mask=loss_mask,
                          rollout_logprobs=np.array([0.0] * len(p) + list(out.logprobs), np.float32),
                          advantage=0.0, routes=routes, captured=captured))
    return collate(trajs, seq_len=SEQ_LEN, num_experts=CONFIG.num_experts, top_k=CONFIG.top_k,
                   num_layers=CONFIG.num_moe_layers)


def test_replay_lowers_the_mismatch_of_bf16_rollouts():
    model = _model()
    batch = _bf16_rollouts(model)
    state = init_train_state(model, optax.sgd(0.1))  # fp32 trainer, same weights as the engine
    live = {k: float(v) for k, v in jax.device_get(eval_step(state, batch, replay="none")).items() if np.ndim(v) == 0}
    replay = {k: float(v) for k, v in jax.device_get(eval_step(state, batch, replay="rollout")).items()
              if np.ndim(v) == 0}
    assert live["num_targets"] == replay["num_targets"] == N * MAX_TOKENS

    # there was something to fix: the fp32 trainer's router picks other experts than the bf16 engine's
    assert live["live_routing_disagreement"] > 0.01, live
    assert replay["live_routing_disagreement"] > 0.0, replay  # the router still disagrees under replay

    # what replay is for: the trainer's logprobs move toward the rollout's
    assert replay["k3_kl"] < 0.25 * live["k3_kl"], (live["k3_kl"], replay["k3_kl"])
    assert replay["mean_abs_delta"] < 0.6 * live["mean_abs_delta"], (live["mean_abs_delta"], replay["mean_abs_delta"])
    assert replay["mean_abs_delta"] > 0.0  # bf16 rounding elsewhere remains: replay fixes routing only
