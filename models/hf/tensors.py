"""The map between Hugging Face tensor names and our state, for every family, and reading/writing it.

HF Linear weights are ``[out, in]``; ours are ``[in, out]``, so every projection is transposed on
the way in and out. Experts are written per expert (what transformers 5.x ``save_pretrained``
writes and vLLM/SGLang read); the fused in-memory form of transformers 5.x
(``mlp.experts.gate_up_proj [E, 2I, D]``, ``mlp.experts.down_proj [E, D, I]``) is accepted on load.
The map is written per layer (``layers/{i}``); a scanned model's state (``cfg.scan_layers``) is
stacked from it on load and unstacked to it on save (models/stacking.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

from models import stacking
from models.config import MoeConfig
from models.hf.common import Family
from models.hf.io import Checkpoint
from models.transformer import MoeTransformer


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor and where it lives in our state: ``path`` into the pure state dict."""

    path: tuple
    name: str
    shape: tuple  # the HF shape
    linear: bool  # HF Linear [out, in]: transposed to our [in, out]


def _attention(cfg: MoeConfig, lay: tuple, p: str) -> list[Tensor]:
    d, hd, h = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    a, s = lay + ("attn",), p + "self_attn."
    if cfg.attention == "mla":
        ql, kvl, nope, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
        q = ([Tensor(a + ("q_a_proj",), s + "q_a_proj.weight", (ql, d), True),
              Tensor(a + ("q_a_norm", "scale"), s + "q_a_layernorm.weight", (ql,), False),
              Tensor(a + ("q_b_proj",), s + "q_b_proj.weight", (h * hd, ql), True)] if ql else
             [Tensor(a + ("q_proj",), s + "q_proj.weight", (h * hd, d), True)])
        return q + [
            Tensor(a + ("kv_a_proj",), s + "kv_a_proj_with_mqa.weight", (kvl + cfg.qk_rope_head_dim, d), True),
            Tensor(a + ("kv_a_norm", "scale"), s + "kv_a_layernorm.weight", (kvl,), False),
            Tensor(a + ("kv_b_proj",), s + "kv_b_proj.weight", (h * (nope + v), kvl), True),
            Tensor(a + ("o_proj",), s + "o_proj.weight", (d, h * v), True)]
    q, kv = h * hd, cfg.num_kv_heads * hd
    out = [Tensor(a + ("q_proj",), s + "q_proj.weight", (q, d), True),
           Tensor(a + ("k_proj",), s + "k_proj.weight", (kv, d), True),
           Tensor(a + ("v_proj",), s + "v_proj.weight", (kv, d), True),
           Tensor(a + ("o_proj",), s + "o_proj.weight", (d, q), True)]
    if cfg.attention_bias:
        out += [Tensor(a + (f"{x}_bias",), s + f"{x}_proj.bias", (n,), False) for x, n in (("q", q), ("k", kv), ("v", kv))]
    if cfg.qk_norm:
        full = cfg.qk_norm_scope == "full"
        out += [Tensor(a + ("q_norm", "scale"), s + "q_norm.weight", (q if full else hd,), False),
                Tensor(a + ("k_norm", "scale"), s + "k_norm.weight", (kv if full else hd,), False)]
    return out


def _mlp(cfg: MoeConfig, family: Family, layer: int, lay: tuple, p: str) -> list[Tensor]:
    d = cfg.hidden_size
    m = lay + ("mlp",)
    if layer < cfg.first_dense_layers:
        di = cfg.dense_intermediate_size
        return [Tensor(m + ("gate_proj",), p + "mlp.gate_proj.weight", (di, d), True),
                Tensor(m + ("up_proj",), p + "mlp.up_proj.weight", (di, d), True),
                Tensor(m + ("down_proj",), p + "mlp.down_proj.weight", (d, di), True)]
    g = f"{p}{family.moe_prefix}."
    out = [Tensor(m + ("router",), g + "gate.weight", (cfg.num_experts, d), True)]
    if cfg.router == "sigmoid_bias_grouped":
        out.append(Tensor(m + ("router_bias",), g + "gate.e_score_correction_bias", (cfg.num_experts,), False))
    if cfg.num_shared_experts:
        si = cfg.num_shared_experts * cfg.moe_intermediate_size
        out += [Tensor(m + ("shared", "gate_proj"), g + "shared_experts.gate_proj.weight", (si, d), True),
                Tensor(m + ("shared", "up_proj"), g + "shared_experts.up_proj.weight", (si, d), True),
                Tensor(m + ("shared", "down_proj"), g + "shared_experts.down_proj.weight", (d, si), True)]
    return out


def tensors(cfg: MoeConfig, family: Family) -> list[Tensor]:
    """Every non-expert tensor in model order (embedding, layers, final norm, head)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [Tensor(("embed",), "model.embed_tokens.weight", (v, d), False)]
    for i in range(cfg.num_layers):
        p, lay = f"model.layers.{i}.", ("layers", i)
        out.append(Tensor(lay + ("input_norm", "scale"), p + "input_layernorm.weight", (d,), False))
        out += _attention(cfg, lay, p)
        out.append(Tensor(lay + ("post_attn_norm", "scale"), p + "post_attention_layernorm.weight", (d,), False))
        out += _mlp(cfg, family, i, lay, p)
    out.append(Tensor(("final_norm", "scale"), "model.norm.weight", (d,), False))
    if not cfg.tie_embeddings:
        out.append(Tensor(("lm_head",), "lm_head.weight", (v, d), True))
    return out


def expert_names(family: Family, layer: int, expert: int) -> dict[str, tuple[str, bool]]:
    """Our expert param -> (HF per-expert tensor name, is it [D, I] (down) rather than [I, D])."""
    p = f"model.layers.{layer}.{family.moe_prefix}.experts.{expert}."
    return {ours: (f"{p}{leaf}.weight", ours == "down_proj") for ours, leaf in family.expert_leaf}


def fused_names(layer: int) -> tuple[str, str]:
    p = f"model.layers.{layer}.mlp.experts."
    return p + "gate_up_proj", p + "down_proj"


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def read_state(ckpt: Checkpoint, cfg: MoeConfig, family: Family) -> tuple[dict, set[str]]:
    """Our pure state dict from the checkpoint, as host numpy arrays, after checking names and shapes
    of everything.

    The router bias is kept in float32 (transformers keeps ``e_score_correction_bias`` in fp32)."""
    d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    plain = tensors(cfg, family)
    wanted = {t.name: t.shape for t in plain}
    for layer in cfg.moe_layer_ids:
        gate_up, down = fused_names(layer)
        if gate_up in ckpt:
            wanted.update({gate_up: (e, 2 * i, d), down: (e, d, i)})
        else:
            for ex in range(e):
                wanted.update({n: ((d, i) if is_down else (i, d))
                               for n, is_down in expert_names(family, layer, ex).values()})
    missing = [n for n in wanted if n not in ckpt]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) the {family.architecture} config needs, "
                         f"e.g. {missing[:8]}")
    for name, shape in wanted.items():
        ckpt.check(name, shape)

    dt = np.dtype(cfg.param_dtype)
    state: dict = {}
    for t in plain:
        a = ckpt.get(t.name, np.float32 if t.path[-1] == "router_bias" else dt)
        _set(state, t.path, a.T if t.linear else a)
    for layer in cfg.moe_layer_ids:
        gate_up, down = fused_names(layer)
        if gate_up in ckpt:
            gu = ckpt.get(gate_up, dt)  # [E, 2I, D]: gate rows first, then up
            mats = {"gate_proj": gu[:, :i], "up_proj": gu[:, i:], "down_proj": ckpt.get(down, dt)}
        else:
            names = [expert_names(family, layer, ex) for ex in range(e)]
            mats = {ours: np.stack([ckpt.get(n[ours][0], dt) for n in names]) for ours in names[0]}
        for ours, m in mats.items():  # HF [E, out, in] -> ours [E, in, out]
            _set(state, ("layers", layer, "mlp", ours), np.swapaxes(m, 1, 2))
    state = stacking.stack_layers(state, cfg, stack=np.stack) if cfg.scan_layers else state
    return state, set(wanted)


def hf_tensors(model: MoeTransformer, family: Family, dtype) -> dict[str, np.ndarray]:
    """Our state (params and router biases, the latter in float32) as HF-named, HF-shaped,
    C-contiguous numpy arrays, in model order."""
    cfg = model.config
    state = stacking.to_layout(nnx.to_pure_dict(nnx.state(model)), cfg, scan_layers=False)
    get = lambda path, dt=dtype: np.asarray(jax.device_get(_get(state, path))).astype(dt, copy=False)
    out = {}
    for t in tensors(cfg, family):
        a = get(t.path, np.float32) if t.path[-1] == "router_bias" else get(t.path)
        out[t.name] = a.T if t.linear else a
        if t.path[-1] == "router":  # experts follow their router, as in the HF module order
            layer = t.path[1]
            mats = {w: get(("layers", layer, "mlp", w)) for w in ("gate_proj", "up_proj", "down_proj")}
            for ex in range(cfg.num_experts):
                for ours, (name, _) in expert_names(family, layer, ex).items():
                    out[name] = mats[ours][ex].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
