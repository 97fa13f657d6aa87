"""Hugging Face Qwen3-MoE checkpoints: ``config.json`` + ``*.safetensors`` to and from our model.

HF Linear weights are ``[out, in]``; ours are ``[in, out]``, so every projection is transposed on
the way in and out. Experts are written per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``,
what transformers 5.x ``save_pretrained`` writes and vLLM/SGLang read); the fused in-memory form of
transformers 5.x (``mlp.experts.gate_up_proj [E, 2I, D]``, ``mlp.experts.down_proj [E, D, I]``) is
accepted on load too. ``config.json`` is written with the spellings of the hub checkpoints
(``num_experts``, top-level ``rope_theta``, ``torch_dtype``), which every reader understands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import MoeConfig
from models.transformer import MoeTransformer
from r3jax.checks import is_int

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_FLOAT_TENSOR_DTYPES = ("F64", "F32", "BF16", "F16")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _safetensors():
    try:
        import safetensors.numpy  # noqa: F401  (lazy: the core package imports without it)
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("models.hf needs the 'safetensors' package: pip install 'r3jax[parity]'") from e
    return safetensors.numpy, safe_open


# ---- config.json <-> MoeConfig --------------------------------------------------------------

def _dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r}: expected one of {sorted(_DTYPES)} for a Hugging Face checkpoint")
    return name


def config_to_hf(cfg: MoeConfig, *, max_position_embeddings: int = 32768, torch_dtype=None) -> dict:
    """The ``config.json`` dict of a ``Qwen3MoeForCausalLM`` with ``cfg``'s hyper-parameters.

    Dense layers are written as ``mlp_only_layers = [0 .. first_dense_layers - 1]``. torch_dtype
    defaults to ``cfg.param_dtype``. Raises ValueError for what Qwen3-MoE cannot express.
    """
    if not cfg.qk_norm:
        raise ValueError("MoeConfig.qk_norm=False: expected True (Qwen3-MoE always applies q/k RMSNorm)")
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings, "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.first_dense_layers)),
        "intermediate_size": cfg.dense_intermediate_size, "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": _dtype_name(cfg.param_dtype if torch_dtype is None else torch_dtype),
    }


def _require(hf: Mapping, key: str):
    if key not in hf:
        raise ValueError(f"config.json is missing {key!r}: expected it in a {ARCHITECTURE} config")
    return hf[key]


def _rope_theta(hf: Mapping) -> float:
    """rope_theta at the top level (hub checkpoints) or inside rope_parameters (transformers 5.x)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, rope in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"config.json {field}.rope_type={kind!r}: expected 'default' (no RoPE scaling)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def _first_dense_layers(hf: Mapping, num_layers: int) -> int:
    """HF makes layer i dense when ``i in mlp_only_layers or (i + 1) % decoder_sparse_step != 0``;
    ours supports exactly a leading prefix of dense layers."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step}: expected >= 1")
    only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(num_layers) if i in only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        raise ValueError(
            f"config.json mlp_only_layers={sorted(only)}, decoder_sparse_step={step} make layers {dense} "
            f"dense: expected the dense layers to be a leading prefix 0..n-1 (MoeConfig.first_dense_layers)")
    return len(dense)


def config_from_hf(hf: Mapping, *, dtype=None, param_dtype=None, moe_impl: str = "ragged") -> MoeConfig:
    """MoeConfig from a Qwen3-MoE ``config.json`` dict (hub and transformers 5.x spellings).

    param_dtype defaults to the checkpoint's ``torch_dtype``/``dtype`` (float32 if absent) and
    dtype (compute) to param_dtype, as transformers' ``dtype="auto"`` does. Raises ValueError
    naming the field for another architecture or a feature our model does not implement.
    """
    archs = list(hf.get("architectures") or [])
    if ARCHITECTURE not in archs and hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json architectures={archs}, model_type={hf.get('model_type')!r}: "
                         f"expected {ARCHITECTURE!r} (model_type {MODEL_TYPE!r})")
    if hf.get("quantization_config"):
        raise ValueError("config.json quantization_config is set: expected an unquantized checkpoint")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        if hf.get(key, want) != want:
            raise ValueError(f"config.json {key}={hf[key]!r}: expected {want!r}")
    experts = {k: hf[k] for k in ("num_experts", "num_local_experts") if k in hf}
    if not experts:
        raise ValueError("config.json is missing 'num_experts' (or 'num_local_experts')")
    if len(set(experts.values())) > 1:
        raise ValueError(f"config.json num_experts={experts['num_experts']} and num_local_experts="
                         f"{experts['num_local_experts']} disagree: expected equal values")
    num_experts = int(next(iter(experts.values())))
    if num_experts < 1:
        raise ValueError(f"config.json num_experts={num_experts}: expected >= 1 (an MoE model)")
    num_layers = int(_require(hf, "num_hidden_layers"))
    hidden, heads = int(_require(hf, "hidden_size")), int(_require(hf, "num_attention_heads"))
    first_dense = _first_dense_layers(hf, num_layers)
    if param_dtype is None:
        name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if name not in _DTYPES:
            raise ValueError(f"config.json torch_dtype={name!r}: expected one of {sorted(_DTYPES)}")
        param_dtype = _DTYPES[name]
    return MoeConfig(
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(_require(hf, "num_key_value_heads")),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        qk_norm=True,
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        num_experts=num_experts,
        top_k=int(_require(hf, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        first_dense_layers=first_dense,
        dense_intermediate_size=int(_require(hf, "intermediate_size") if first_dense
                                    else hf.get("intermediate_size", 4 * hidden)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=param_dtype if dtype is None else dtype,
        param_dtype=param_dtype,
        moe_impl=moe_impl,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


# ---- tensor names -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor and where it lives in our state: ``path`` into the pure param dict."""

    path: tuple
    name: str
    shape: tuple  # the HF shape
    linear: bool  # HF Linear [out, in]: transposed to our [in, out]


def _tensors(cfg: MoeConfig) -> list[_Tensor]:
    """Every non-expert tensor in model order (embedding, layers, final norm, head)."""
    d, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = [_Tensor(("embed",), "model.embed_tokens.weight", (v, d), False)]
    for i in range(cfg.num_layers):
        p, lay = f"model.layers.{i}.", ("layers", i)
        out += [
            _Tensor(lay + ("input_norm", "scale"), p + "input_layernorm.weight", (d,), False),
            _Tensor(lay + ("attn", "q_proj"), p + "self_attn.q_proj.weight", (q, d), True),
            _Tensor(lay + ("attn", "k_proj"), p + "self_attn.k_proj.weight", (kv, d), True),
            _Tensor(lay + ("attn", "v_proj"), p + "self_attn.v_proj.weight", (kv, d), True),
            _Tensor(lay + ("attn", "o_proj"), p + "self_attn.o_proj.weight", (d, q), True),
            _Tensor(lay + ("attn", "q_norm", "scale"), p + "self_attn.q_norm.weight", (hd,), False),
            _Tensor(lay + ("attn", "k_norm", "scale"), p + "self_attn.k_norm.weight", (hd,), False),
            _Tensor(lay + ("post_attn_norm", "scale"), p + "post_attention_layernorm.weight", (d,), False),
        ]
        if i < cfg.first_dense_layers:
            di = cfg.dense_intermediate_size
            out += [_Tensor(lay + ("mlp", "gate_proj"), p + "mlp.gate_proj.weight", (di, d), True),
                    _Tensor(lay + ("mlp", "up_proj"), p + "mlp.up_proj.weight", (di, d), True),
                    _Tensor(lay + ("mlp", "down_proj"), p + "mlp.down_proj.weight", (d, di), True)]
        else:
            out.append(_Tensor(lay + ("mlp", "router"), p + "mlp.gate.weight", (cfg.num_experts, d), True))
    out.append(_Tensor(("final_norm", "scale"), "model.norm.weight", (d,), False))
    if not cfg.tie_embeddings:
        out.append(_Tensor(("lm_head",), "lm_head.weight", (v, d), True))
    return out


def _expert_names(layer: int, expert: int) -> dict[str, tuple[str, bool]]:
    """Our expert param -> (HF per-expert tensor name, is it [D, I] (down) rather than [I, D])."""
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return {"gate_proj": (p + "gate_proj.weight", False), "up_proj": (p + "up_proj.weight", False),
            "down_proj": (p + "down_proj.weight", True)}


def _fused_names(layer: int) -> tuple[str, str]:
    p = f"model.layers.{layer}.mlp.experts."
    return p + "gate_up_proj", p + "down_proj"


# ---- reading ------------------------------------------------------------------------------

class _Checkpoint(contextlib.ExitStack):
    """The tensors of a checkpoint directory, opened lazily (nothing is read until ``get``)."""

    def __init__(self, path: Path):
        super().__init__()
        _, safe_open = _safetensors()
        if (path / _INDEX).exists():
            files = sorted(set(json.loads((path / _INDEX).read_text())["weight_map"].values()))
        elif (path / _SINGLE).exists():
            files = [_SINGLE]
        else:
            files = sorted(f.name for f in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files: expected {_SINGLE} or shards with {_INDEX}")
        self._where = {}
        for f in files:
            if not (path / f).exists():
                raise FileNotFoundError(f"{path / f}: listed in {_INDEX} but not found")
            handle = self.enter_context(safe_open(str(path / f), framework="numpy"))
            self._where.update({name: handle for name in handle.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._where

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def check(self, name: str, shape: tuple) -> None:
        meta = self._where[name].get_slice(name)
        got, kind = tuple(meta.get_shape()), meta.get_dtype()
        if got != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {got}: expected {tuple(shape)}")
        if kind not in _FLOAT_TENSOR_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {kind}: expected one of {_FLOAT_TENSOR_DTYPES}")

    def get(self, name: str, dtype) -> np.ndarray:
        return self._where[name].get_tensor(name).astype(dtype, copy=False)


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _read_params(ckpt: _Checkpoint, cfg: MoeConfig) -> tuple[dict, set[str]]:
    """Our pure param dict from the checkpoint, after checking names and shapes of everything."""
    d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    plain = _tensors(cfg)
    wanted = {t.name: t.shape for t in plain}
    for layer in cfg.moe_layer_ids:
        gate_up, down = _fused_names(layer)
        if gate_up in ckpt:
            wanted.update({gate_up: (e, 2 * i, d), down: (e, d, i)})
        else:
            for ex in range(e):
                wanted.update({n: ((d, i) if is_down else (i, d))
                               for n, is_down in _expert_names(layer, ex).values()})
    missing = [n for n in wanted if n not in ckpt]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) the {ARCHITECTURE} config needs, "
                         f"e.g. {missing[:8]}")
    for name, shape in wanted.items():
        ckpt.check(name, shape)

    dt = np.dtype(cfg.param_dtype)
    params: dict = {}
    for t in plain:
        a = ckpt.get(t.name, dt)
        _set(params, t.path, jnp.asarray(a.T if t.linear else a))
    for layer in cfg.moe_layer_ids:
        gate_up, down = _fused_names(layer)
        if gate_up in ckpt:
            gu = ckpt.get(gate_up, dt)  # [E, 2I, D]: gate rows first, then up
            mats = {"gate_proj": gu[:, :i], "up_proj": gu[:, i:], "down_proj": ckpt.get(down, dt)}
        else:
            names = [_expert_names(layer, ex) for ex in range(e)]
            mats = {ours: np.stack([ckpt.get(n[ours][0], dt) for n in names]) for ours in names[0]}
        for ours, m in mats.items():  # HF [E, out, in] -> ours [E, in, out]
            _set(params, ("layers", layer, "mlp", ours), jnp.asarray(np.swapaxes(m, 1, 2)))
    return params, set(wanted)


def load_pretrained(path, *, dtype=None, param_dtype=None,
                    moe_impl: str = "ragged") -> tuple[MoeConfig, MoeTransformer]:
    """Load a Hugging Face Qwen3-MoE directory (``config.json`` + ``*.safetensors``, single or sharded).

    The model is built abstractly (no random init) and filled with the checkpoint's tensors cast to
    param_dtype. Raises ValueError for another architecture, missing tensors (naming some of them)
    or a tensor of the wrong shape (naming it, its shape and the expected one); warns about tensors
    the model does not use.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json: expected a Hugging Face model directory")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype=dtype,
                         param_dtype=param_dtype, moe_impl=moe_impl)
    with _Checkpoint(path) as ckpt:
        params, used = _read_params(ckpt, cfg)
        unused = sorted(ckpt.names - used - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if unused:
        warnings.warn(f"{path}: {len(unused)} checkpoint tensor(s) not used by the model, e.g. {unused[:8]}",
                      stacklevel=2)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0))))
    want = jax.tree.map(lambda s: (s.shape, np.dtype(s.dtype)), nnx.to_pure_dict(state))
    if want != jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), params):  # a bug here, not in the file
        raise RuntimeError("models.hf: the tensor map does not cover MoeTransformer's parameters exactly")
    nnx.replace_by_pure_dict(state, params)
    return cfg, nnx.merge(graphdef, state)


# ---- writing ------------------------------------------------------------------------------

def _parse_size(size) -> int:
    if is_int(size) and size > 0:
        return int(size)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r}: expected a positive byte count or a string like '5GB'")
    return int(float(m.group(1)) * _UNITS[unit])


def _hf_tensors(model: MoeTransformer, dtype) -> dict[str, np.ndarray]:
    """Our params as HF-named, HF-shaped, C-contiguous numpy arrays, in model order."""
    cfg = model.config
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    get = lambda path: np.asarray(jax.device_get(_get(params, path))).astype(dtype, copy=False)
    out = {}
    for t in _tensors(cfg):
        a = get(t.path)
        out[t.name] = a.T if t.linear else a
        if t.path[-1] == "router":  # experts follow their router, as in the HF module order
            layer = t.path[1]
            mats = {w: get(("layers", layer, "mlp", w)) for w in ("gate_proj", "up_proj", "down_proj")}
            for ex in range(cfg.num_experts):
                for ours, (name, _) in _expert_names(layer, ex).items():
                    out[name] = mats[ours][ex].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _get(tree: Mapping, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _shards(tensors: dict[str, np.ndarray], limit: int) -> list[list[str]]:
    """Greedy, in order; a tensor larger than the limit gets a shard of its own (as HF does)."""
    shards, size = [[]], 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += a.nbytes
    return shards


def save_pretrained(model: MoeTransformer, path, *, max_shard_size: int | str = "5GB", dtype=None,
                    max_position_embeddings: int = 32768) -> None:
    """Write ``config.json`` + safetensors in the HF Qwen3-MoE layout (loads in transformers/vLLM/SGLang).

    Tensors are cast to dtype (default: the config's param_dtype). Above max_shard_size (bytes, or
    '500MB' / '5GB' / '2GiB') the weights go to ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``. Previous weight files of that layout in ``path`` are removed.
    """
    numpy_st, _ = _safetensors()
    cfg = model.config
    dtype = cfg.param_dtype if dtype is None else dtype
    hf_config = config_to_hf(cfg, max_position_embeddings=max_position_embeddings, torch_dtype=dtype)
    limit = _parse_size(max_shard_size)
    tensors = _hf_tensors(model, np.dtype(dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model-*-of-*.safetensors"), path / _SINGLE, path / _INDEX]:
        old.unlink(missing_ok=True)  # stale shards of an earlier save would shadow or mix in
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    shards = _shards(tensors, limit)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        numpy_st.save_file(tensors, str(path / _SINGLE), metadata=meta)
        return
    weight_map = {}
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        numpy_st.save_file({n: tensors[n] for n in names}, str(path / fname), metadata=meta)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
