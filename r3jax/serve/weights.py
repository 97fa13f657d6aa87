"""Models and weights for the server: build the served model from ``--model``, and load new params
for ``POST /v1/weights``.

``--model`` accepts a preset name (``tiny``, ``small_100m``; random init from ``--seed``), a Hugging
Face directory (``config.json`` + ``*.safetensors``, read by ``models.hf.load_pretrained``) or an orbax
params directory written by ``r3jax.params_io.export_params`` (also ``r3jax.train.export_params``).
An orbax params directory holds no config: it is taken from ``--config`` (a preset name or a Hugging
Face directory), else from a ``config.json`` (Hugging Face form, ``models.hf.config_to_hf``) inside
the orbax directory. Params files are read by :mod:`r3jax.params_io`: the server never imports the
trainer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from r3jax.serve.schema import InputError

# Fields that do not change the parameters or the forward pass a client sees.
_FREE_FIELDS = {"dtype", "param_dtype", "moe_impl", "router_aux_loss_coef"}


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_config(spec: str, *, dtype=None):
    """A ``MoeConfig`` from a preset name or a Hugging Face directory's ``config.json``."""
    from models import MoeConfig
    from models.hf import config_from_hf

    path = Path(spec)
    if (path / "config.json").is_file():
        return config_from_hf(json.loads((path / "config.json").read_text()), dtype=dtype, param_dtype=dtype)
    extra = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
    return MoeConfig.preset(spec, **extra)


def build_model(spec: str, *, config: str | None = None, seed: int = 0, dtype=None):
    """The served ``MoeTransformer`` for ``--model spec`` (see the module docstring)."""
    from flax import nnx

    from models import MoeTransformer
    from models.hf import load_pretrained
    from r3jax.params_io import load_params

    path = Path(spec)
    if not path.exists():
        return MoeTransformer(resolve_config(spec, dtype=dtype), rngs=nnx.Rngs(seed))
    if not path.is_dir():
        raise ValueError(f"--model {spec!r}: expected a preset name, a Hugging Face directory or an "
                         "orbax params directory")
    if is_hf_dir(path):
        return load_pretrained(path, dtype=dtype, param_dtype=dtype)[1]
    if config is None and not (path / "config.json").is_file():
        raise ValueError(f"--model {spec!r} is an orbax params directory without config.json: pass "
                         "--config PRESET|HF_DIR so the model's shapes are known")
    cfg = resolve_config(config if config is not None else str(path), dtype=dtype)
    return load_params(path, template(cfg))


def template(cfg):
    """A ``MoeTransformer`` of ``cfg`` with zero params, built without running the random init
    (params come from host zeros; restore targets need only shapes, dtypes and placement)."""
    import jax
    import numpy as np
    from flax import nnx

    from models import MoeTransformer

    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), state))


def config_mismatch(got, want) -> list[str]:
    """Fields (other than dtypes and kernels) where config ``got`` differs from ``want``."""
    return [f"{f.name}: {getattr(got, f.name)!r} != served {getattr(want, f.name)!r}"
            for f in dataclasses.fields(want)
            if f.name not in _FREE_FIELDS and getattr(got, f.name) != getattr(want, f.name)]


def load_state(path: str, fmt: str, engine: Any):
    """``POST /v1/weights``: the params (``nnx.State``) at ``path`` for the engine's model config.

    Raises :class:`InputError` (field ``path``) for a missing directory or a checkpoint of another
    shape; other load errors propagate and the app reports them as 422 too.
    """
    import jax
    import numpy as np
    from flax import nnx

    from models.hf import load_pretrained
    from models.weights import WEIGHTS
    from r3jax.params_io import load_params

    cfg, p = engine.config, Path(path)
    if not p.is_dir():
        raise InputError("path", f"path={path!r}: not a directory on the server")
    if fmt == "safetensors":
        if not is_hf_dir(p):
            raise InputError("path", f"path={path!r}: expected config.json and *.safetensors (format "
                             "'safetensors')")
        got, model = load_pretrained(p, dtype=cfg.dtype, param_dtype=cfg.param_dtype, moe_impl=cfg.moe_impl)
        diff = config_mismatch(got, cfg)
        if diff:
            raise InputError("path", f"path={path!r}: the checkpoint's config differs from the served "
                             f"model ({'; '.join(diff)}); restart the server with --model {path}")
    elif fmt == "orbax":
        model = load_params(p, template(cfg))  # raises ValueError on a structure or shape mismatch
    else:
        raise InputError("format", f"format={fmt!r}: expected 'orbax' or 'safetensors'")
    # Host arrays: the engine places them like its current params. (orbax hands back committed device
    # arrays; swapping those for the engine's uncommitted ones would recompile every program once.)
    return jax.tree.map(np.asarray, nnx.state(model, WEIGHTS))  # Params and router biases
