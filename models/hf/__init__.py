"""Hugging Face checkpoints (``config.json`` + ``*.safetensors``) to and from our model.

Architectures: Qwen3-MoE, OLMoE, Mixtral, GLM-4.5 (Glm4Moe) and DeepSeek-V3 / Kimi-K2 (one module
each in this package; the safetensors I/O and the tensor map are shared). ``config.json`` is
written with the spellings of the hub checkpoints (top-level ``rope_theta``, ``torch_dtype``), which
every reader understands.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import MoeConfig
from models.hf import deepseek_v3, glm4_moe, mixtral, olmoe, qwen3_moe
from models.hf.common import Family, dtype_name
from models.hf.io import Checkpoint, parse_size, write
from models.hf.tensors import hf_tensors, read_state
from models.transformer import MoeTransformer

FAMILIES: tuple[Family, ...] = (qwen3_moe.FAMILY, olmoe.FAMILY, mixtral.FAMILY, glm4_moe.FAMILY,
                                deepseek_v3.FAMILY)
ARCHITECTURES = tuple(f.architecture for f in FAMILIES)

__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "family_of", "load_pretrained", "read_pretrained",
           "save_pretrained"]


def _family_of_hf(hf: Mapping) -> Family:
    if not isinstance(hf, Mapping):  # e.g. a config.json holding [] or a string
        raise ValueError(f"config.json is a JSON {type(hf).__name__}: expected an object")
    archs = hf.get("architectures") or []
    if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json architectures={archs!r}: expected a list of names")
    archs = list(archs)
    for f in FAMILIES:
        if f.architecture in archs:
            return f
    if not archs:
        for f in FAMILIES:
            if hf.get("model_type") in f.model_types:
                return f
    raise ValueError(f"config.json architectures={archs}, model_type={hf.get('model_type')!r}: "
                     f"expected one of {list(ARCHITECTURES)}")


def family_of(cfg: MoeConfig, architecture: str | None = None) -> Family:
    """The family that writes cfg: ``architecture`` when given, else the first that can express cfg
    (MLA: DeepSeek-V3; sigmoid router: Glm4Moe; full q/k norm: OLMoE; no q/k norm: Mixtral; else
    Qwen3-MoE)."""
    if architecture is not None:
        for f in FAMILIES:
            if f.architecture == architecture:
                return f
        raise ValueError(f"architecture={architecture!r}: expected one of {list(ARCHITECTURES)}")
    for f in FAMILIES:
        if f.fits(cfg):
            return f
    return qwen3_moe.FAMILY  # its to_hf names the field it cannot express


def config_from_hf(hf: Mapping, *, dtype=None, param_dtype=None, moe_impl: str = "ragged") -> MoeConfig:
    """MoeConfig from a ``config.json`` dict of a supported architecture (hub and transformers 5.x
    spellings).

    param_dtype defaults to the checkpoint's ``torch_dtype``/``dtype`` (float32 if absent) and
    dtype (compute) to param_dtype, as transformers' ``dtype="auto"`` does. Raises ValueError
    naming the field for another architecture or a feature our model does not implement.
    """
    return _family_of_hf(hf).to_config(hf, dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl)


def config_to_hf(cfg: MoeConfig, *, architecture: str | None = None, max_position_embeddings: int = 32768,
                 torch_dtype=None) -> dict:
    """The ``config.json`` dict for cfg (see :func:`family_of`). torch_dtype defaults to
    ``cfg.param_dtype``. Raises ValueError naming a field the architecture cannot express."""
    out = family_of(cfg, architecture).to_hf(cfg)
    out.update(max_position_embeddings=max_position_embeddings,
               torch_dtype=dtype_name(cfg.param_dtype if torch_dtype is None else torch_dtype))
    return out


def load_pretrained(path, *, dtype=None, param_dtype=None, moe_impl: str = "ragged",
                    scan_layers: bool = True) -> tuple[MoeConfig, MoeTransformer]:
    """Load a Hugging Face directory (``config.json`` + ``*.safetensors``, single or sharded).

    scan_layers: the layer layout of the model built (``MoeConfig.scan_layers``; default scanned: the
    per-layer tensors are stacked per run of identical layers, see models/stacking.py).

    The model is built abstractly (no random init) and filled with the checkpoint's tensors cast to
    param_dtype (router biases stay float32), one device copy each (:func:`read_pretrained`). Raises
    ValueError for an unsupported architecture, missing tensors (naming some of them) or a tensor of
    the wrong shape (naming it, its shape and the expected one); warns about tensors the model does
    not use (e.g. DeepSeek's MTP layers).
    """
    cfg, graphdef, state = read_pretrained(path, dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl,
                                           scan_layers=scan_layers)
    return cfg, nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))


def read_pretrained(path, *, dtype=None, param_dtype=None, moe_impl: str = "ragged",
                    scan_layers: bool = True) -> tuple[MoeConfig, nnx.GraphDef, nnx.State]:
    """``(cfg, graphdef, state)`` of a Hugging Face directory without building a model: ``state`` is
    the model's whole ``nnx.State`` holding the checkpoint's tensors as host numpy arrays (nothing on
    a device; ``nnx.merge(graphdef, state)`` is the model). Same arguments, checks and warnings as
    :func:`load_pretrained`."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json: expected a Hugging Face model directory")
    hf = json.loads((path / "config.json").read_text())
    family = _family_of_hf(hf)
    cfg = family.to_config(hf, dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl)
    if not isinstance(scan_layers, bool):
        raise ValueError(f"scan_layers={scan_layers!r}: expected a bool")
    cfg = cfg.replace(scan_layers=scan_layers)
    with Checkpoint(path) as ckpt:
        pure, used = read_state(ckpt, cfg, family)
        unused = sorted(ckpt.names - used - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if unused:
        warnings.warn(f"{path}: {len(unused)} checkpoint tensor(s) not used by the model, e.g. {unused[:8]}",
                      stacklevel=3)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0))))
    want = jax.tree.map(lambda s: (s.shape, np.dtype(s.dtype)), nnx.to_pure_dict(state))
    if want != jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), pure):  # a bug here, not in the file
        raise RuntimeError("models.hf: the tensor map does not cover MoeTransformer's state exactly")
    nnx.replace_by_pure_dict(state, pure)
    return cfg, graphdef, state


def save_pretrained(model: MoeTransformer, path, *, max_shard_size: int | str = "5GB", dtype=None,
                    max_position_embeddings: int = 32768, architecture: str | None = None) -> None:
    """Write ``config.json`` + safetensors in the HF layout of cfg's architecture (see
    :func:`family_of`); transformers, vLLM and SGLang load it.

    Tensors are cast to dtype (default: the config's param_dtype; router biases stay float32).
    Above max_shard_size (bytes, or '500MB' / '5GB' / '2GiB') the weights go to
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``. Previous weight
    files of that layout in ``path`` are removed.
    """
    cfg = model.config
    dtype = cfg.param_dtype if dtype is None else dtype
    family = family_of(cfg, architecture)
    hf_config = config_to_hf(cfg, architecture=family.architecture,
                             max_position_embeddings=max_position_embeddings, torch_dtype=dtype)
    limit = parse_size(max_shard_size)
    write(Path(path), hf_config, hf_tensors(model, family, np.dtype(dtype)), limit)
