"""Replay against an independent reference: the logprobs the trainer computes with forced experts
equal a plain NumPy (float64) forward of the tiny model that takes the expert ids per (token, MoE
layer) explicitly, routes live where no id is forced, and takes the gate weights from its own live
router scores at those ids. The reference shares nothing with models/ but the parameter values.

The reference is sharp enough to tell ids apart: with the ids swapped between the two MoE layers, or
with replay ignored, its logprobs are far from the trainer's; so the equality cannot hold by
construction.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import MoeConfig, MoeTransformer, Replay
from r3jax.batch import collate
from r3jax.train import eval_step, init_train_state
from r3jax.train.loss import token_logprobs

CFG = MoeConfig.tiny()
LENGTHS = (13, 9)  # two trajectories, right-padded to S = 16
S = 16
PROMPT = 4  # loss-active targets: every token after the prompt
SCALE = 25.0  # router and expert outputs scaled up, so the chosen experts move the logprobs visibly


def _model():
    model = MoeTransformer(CFG, rngs=nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in ("router", "down_proj"):
        params["moe_layers"]["mlp"][name] = params["moe_layers"]["mlp"][name] * SCALE
    nnx.update(model, params)
    return model


# ---- the reference forward (NumPy, float64, one row at a time) -----------------------------------

def _rms(x, scale):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CFG.rms_norm_eps) * scale


def _rope(x, pos):  # x [S, H, Dh]: rotate_half convention over the whole head
    half = x.shape[-1] // 2
    inv = 1.0 / CFG.rope_theta ** (np.arange(half) * 2.0 / x.shape[-1])
    ang = pos[:, None, None] * inv  # [S, 1, Dh/2]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _attention(p, x, pos, seg):
    s, h, hkv, dh = x.shape[0], CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    q = _rms((x @ p["q_proj"]).reshape(s, h, dh), p["q_norm"]["scale"])
    k = _rms((x @ p["k_proj"]).reshape(s, hkv, dh), p["k_norm"]["scale"])
    v = (x @ p["v_proj"]).reshape(s, hkv, dh)
    q, k = _rope(q, pos), _rope(k, pos)
    allowed = (np.arange(s)[None, :] <= np.arange(s)[:, None]) & (seg[None, :] == seg[:, None])  # [S, S]
    out = np.zeros((s, h, dh))
    for head in range(h):
        kv = head // (h // hkv)
        logits = np.where(allowed, q[:, head] @ k[:, kv].T / np.sqrt(dh), -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    return out.reshape(s, h * dh) @ p["o_proj"]


def _moe(p, x, forced, forced_mask):
    """x [S, D]; forced [S, K] ids, forced_mask [S] bool. Live top-k where not forced; gates are the
    live softmax scores at the used ids, renormalised (norm_topk_prob)."""
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        ids = forced[t] if forced_mask[t] else np.argsort(-probs[t], kind="stable")[:CFG.top_k]
        gates = probs[t, ids] / probs[t, ids].sum()
        for e, g in zip(ids, gates):
            h = _silu(x[t] @ p["gate_proj"][e]) * (x[t] @ p["up_proj"][e])
            y[t] += g * (h @ p["down_proj"][e])
    return y


def reference_logprobs(params, tokens, positions, segment_ids, forced, forced_mask):
    """[B, S] float64: row i = log p(tokens[i] | tokens before i) with experts ``forced [B, S, L, K]``
    where ``forced_mask [B, S]`` and live top-k elsewhere; row 0 is 0."""
    p = {k: np.asarray(v, np.float64) if not isinstance(v, dict) else v for k, v in params.items()}
    as64 = lambda tree, j: {k: as64(v, j) if isinstance(v, dict) else np.asarray(v[j], np.float64)
                            for k, v in tree.items()}
    layers = [as64(params["dense_layers"], j) for j in range(CFG.first_dense_layers)]
    layers += [as64(params["moe_layers"], j) for j in range(CFG.num_moe_layers)]
    out = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        x = p["embed"][tokens[b]]
        for i, lp in enumerate(layers):
            x = x + _attention(lp["attn"], _rms(x, lp["input_norm"]["scale"]), positions[b].astype(np.float64),
                               segment_ids[b])
            h = _rms(x, lp["post_attn_norm"]["scale"])
            if i < CFG.first_dense_layers:
                m = lp["mlp"]
                x = x + (_silu(h @ m["gate_proj"]) * (h @ m["up_proj"])) @ m["down_proj"]
            else:
                x = x + _moe(lp["mlp"], h, forced[b, :, i - CFG.first_dense_layers], forced_mask[b])
        logits = _rms(x, np.asarray(params["final_norm"]["scale"], np.float64)) @ p["lm_head"]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        out[b, 1:] = logp[np.arange(tokens.shape[1] - 1), tokens[b, 1:]]
    return out


# ---- the test -------------------------------------------------------------------------------------

def _setup():
    """(model, batch, ref): a [2, 16] batch with random forced ids and two uncaptured predicting rows
    per trajectory; ``ref(routes, route_mask)`` is the reference's logprobs for those forced ids."""
    model = _model()
    rng = np.random.default_rng(0)
    trajs = []
    for n in LENGTHS:
        # a random pair of distinct experts per (token, MoE layer), so the forced ids mostly differ
        # from the router's own choice and from the other layer's
        routes = np.stack([np.stack([rng.permutation(CFG.num_experts)[:CFG.top_k] for _ in range(CFG.num_moe_layers)])
                           for _ in range(n)]).astype(np.uint8)
        captured = np.ones(n, bool)
        captured[[5, 7]] = False  # two predicting positions without a row: routed live
        captured[-1] = False
        trajs.append(dict(tokens=rng.integers(1, CFG.vocab_size, n).astype(np.int32),
                          loss_mask=np.array([0.0] * PROMPT + [1.0] * (n - PROMPT), np.float32),
                          rollout_logprobs=np.zeros(n, np.float32), advantage=1.0, routes=routes, captured=captured))
    batch = collate(trajs, seq_len=S, num_experts=CFG.num_experts, top_k=CFG.top_k, num_layers=CFG.num_moe_layers)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ref = lambda routes, mask: reference_logprobs(params, np.asarray(batch.tokens), np.asarray(batch.positions),
                                                  np.asarray(batch.segment_ids), np.asarray(routes, np.int64),
                                                  np.asarray(mask))
    return model, batch, ref


@pytest.fixture(scope="module")
def setup():
    return _setup()


def test_replayed_logprobs_equal_an_independent_forward_with_the_same_experts(setup):
    model, batch, ref = setup
    target = np.asarray(batch.loss_mask) > 0
    want = ref(batch.routes, batch.route_mask)

    # the model with the batch's routes forced where captured, scored against the reference per token
    out = model(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                replay=Replay(jnp.asarray(batch.routes), jnp.asarray(batch.route_mask)),
                segment_ids=jnp.asarray(batch.segment_ids))
    got = np.asarray(token_logprobs(out.logits, jnp.asarray(batch.tokens)))
    np.testing.assert_allclose(got[target], want[target], atol=1e-5, rtol=0)  # f32 vs f64: ~5e-7
    live = np.asarray(out.live_routes)
    forced_rows = np.asarray(batch.route_mask) & (np.asarray(batch.segment_ids) > 0)
    assert (np.sort(live, -1) != np.sort(np.asarray(batch.routes), -1)).any(-1)[forced_rows].mean() > 0.5

    # the trainer's step, whose rollout logprobs are now the reference's: Δ is the trainer-vs-reference gap
    scored = batch.replace(rollout_logprobs=np.where(target, want, 0.0).astype(np.float32))
    state = init_train_state(model, optax.sgd(0.1))
    replayed = {k: float(v) for k, v in eval_step(state, scored, replay="rollout").items() if np.ndim(v) == 0}
    assert replayed["mean_abs_delta"] < 2e-5, replayed
    assert replayed["fallback_fraction"] == pytest.approx(4 / (sum(LENGTHS) - 2 * PROMPT))  # rows 5, 7 of each
    ignored = {k: float(v) for k, v in eval_step(state, scored, replay="none").items() if np.ndim(v) == 0}
    assert ignored["mean_abs_delta"] > 100 * replayed["mean_abs_delta"] + 1e-2, ignored  # replay ignored: far off


def test_the_reference_tells_forced_ids_apart(setup):
    """The equality above is no accident: other forced ids give other reference logprobs, far beyond
    the tolerance: the two MoE layers' ids swapped (replay wired to the wrong layer), no ids forced
    (replay ignored), or ids forced on the uncaptured rows too (the route mask ignored)."""
    _, batch, ref = setup
    target = np.asarray(batch.loss_mask) > 0
    want = ref(batch.routes, batch.route_mask)
    swapped = ref(np.asarray(batch.routes)[:, :, ::-1], batch.route_mask)
    live = ref(batch.routes, np.zeros_like(np.asarray(batch.route_mask)))
    unmasked = ref(batch.routes, np.asarray(batch.segment_ids) > 0)
    for other in (swapped, live, unmasked):
        assert np.abs(other - want)[target].mean() > 1e-2
