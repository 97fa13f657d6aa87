"""Models and weights for the server: build the served model from ``--model``, and load new params
for ``POST /v1/weights``.

``--model`` accepts a preset name (``tiny``, ``small_100m``; random init from ``--seed``), a Hugging
Face directory (``config.json`` + ``*.safetensors``, read by ``models.hf.read_pretrained``) or an orbax
params directory written by ``r3jax.params_io.export_params`` (also ``r3jax.train.export_params``).
An orbax params directory holds no config: it is taken from ``--config`` (a preset name or a Hugging
Face directory), else from a ``config.json`` (Hugging Face form, ``models.hf.config_to_hf``) inside
the orbax directory. Params files are read by :mod:`r3jax.params_io`: the server never imports the
trainer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from r3jax.checks import is_int
from r3jax.serve.schema import InputError

# Fields that do not change the parameters or the forward pass a client sees (logits_dot_in_fp32: the
# engine's own precision choice for its head); and router_noise, the engine-side mismatch knob: the
# trainer's checkpoint (saved without either) must still load into the engine.
_FREE_FIELDS = {"dtype", "param_dtype", "moe_impl", "router_aux_loss_coef", "router_noise", "logits_dot_in_fp32"}


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
    """The served ``MoeTransformer`` for ``--model spec`` (see the module docstring), its state held in
    host numpy arrays: nothing of it is on an accelerator. The engine then places each array by its
    sharding (:meth:`r3jax.engine.sharding.Placement.params`: each device receives only its own
    shards), so no device ever holds the whole model, however large, and the only device copy is the
    engine's. A checkpoint's tensors are read straight into host arrays; a preset's random init runs
    on the host's CPU device and is copied out."""
    import jax
    import numpy as np
    from flax import nnx

    from models import MoeTransformer
    from models.hf import read_pretrained
    from r3jax.params_io import read_weights

    path = Path(spec)
    if not path.exists():
        cfg = resolve_config(spec, dtype=dtype)
        with jax.default_device(_host_device()):
            graphdef, state = nnx.split(MoeTransformer(cfg, rngs=nnx.Rngs(seed)))
            state = jax.tree.map(np.array, state)  # own host copies; the CPU buffers are freed
        return nnx.merge(graphdef, state)
    if not path.is_dir():
        raise ValueError(f"--model {spec!r}: expected a preset name, a Hugging Face directory or an "
                         "orbax params directory")
    if is_hf_dir(path):
        _, graphdef, state = read_pretrained(path, dtype=dtype, param_dtype=dtype)
        return nnx.merge(graphdef, state)
    if config is None and not (path / "config.json").is_file():
        raise ValueError(f"--model {spec!r} is an orbax params directory without config.json: pass "
                         "--config PRESET|HF_DIR so the model's shapes are known")
    cfg = resolve_config(config if config is not None else str(path), dtype=dtype)
    graphdef, weights, rest = abstract_model(cfg)
    rest = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), rest)  # not in params files
    return nnx.merge(graphdef, read_weights(path, weights), rest)


def _host_device():
    """Where a preset's random init runs: the host's CPU device (on a TPU or GPU host too: host memory),
    or the default device where ``JAX_PLATFORMS`` leaves the CPU backend out (a preset built to be
    served is small)."""
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # "Unknown backend cpu": no CPU platform in this process
        return jax.devices()[0]


def abstract_model(cfg):
    """``(graphdef, weights, rest)`` of a ``MoeTransformer`` of ``cfg`` from ``nnx.eval_shape``: the
    weights (:data:`models.weights.WEIGHTS`) and any other state as ``jax.ShapeDtypeStruct`` trees,
    nothing allocated and no random init run (restore targets need only shapes and dtypes)."""
    from flax import nnx

    from models import MoeTransformer
    from models.weights import WEIGHTS

    return nnx.split(nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0))), WEIGHTS, ...)


# safetensors dtype names -> bytes per element (the sub-byte and exotic ones are left to the reader)
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100_000_000  # the safetensors reader's own limit


def check_hf_files(path: Path) -> None:
    """Refuse a Hugging Face directory whose files cannot be loaded, before anything is read in
    bulk or the engine is touched: ``config.json`` must be a JSON object, and each ``.safetensors``
    file the loader opens must have a well-formed header (8-byte length, a JSON object of tensors
    whose byte ranges lie inside the file and match their shape and dtype). Raises InputError
    (field ``path``) naming the file and what is wrong with it."""
    from models.hf.io import INDEX, SINGLE

    def bad(file: Path, why: str) -> InputError:
        return InputError("path", f"path={str(path)!r}: {file.name}: {why}")

    config = path / "config.json"
    try:
        obj = json.loads(config.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad(config, f"not valid JSON ({getattr(e, 'msg', None) or type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise bad(config, f"a JSON {type(obj).__name__}: expected an object")
    if (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_bytes())
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            raise bad(path / INDEX, "expected a JSON object with a weight_map of tensor name -> file") from None
        if not all(isinstance(f, str) for f in files):
            raise bad(path / INDEX, "weight_map values must be file names")
    elif (path / SINGLE).is_file():
        files = [SINGLE]
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
    for name in files:
        _check_safetensors_header(path / name, bad)


def _check_safetensors_header(file: Path, bad) -> None:
    if not file.is_file():
        raise bad(file, "listed in the index but not found")
    size = file.stat().st_size
    if size < 8:
        raise bad(file, f"{size} bytes: expected a safetensors file (an 8-byte header length first)")
    with file.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(size - 8, _MAX_HEADER):
            raise bad(file, f"header length {n} in a {size}-byte file: not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad(file, "header is not JSON: not a safetensors file") from None
    if not isinstance(header, dict):
        raise bad(file, "header is not a JSON object: not a safetensors file")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise bad(file, f"{where}: expected {{dtype, shape, data_offsets}}")
        shape, offsets, dtype = info.get("shape"), info.get("data_offsets"), info.get("dtype")
        if not (isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape)):
            raise bad(file, f"{where}: shape={shape!r}: expected a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise bad(file, f"{where}: data_offsets={offsets!r}: expected [begin, end] within the "
                            f"file's {data} data bytes (truncated file?)")
        if not isinstance(dtype, str):
            raise bad(file, f"{where}: dtype={dtype!r}: expected a safetensors dtype name")
        if dtype in _ITEM_BYTES and offsets[1] - offsets[0] != math.prod(shape) * _ITEM_BYTES[dtype]:
            raise bad(file, f"{where}: {offsets[1] - offsets[0]} bytes for {dtype}{shape}: expected "
                            f"{math.prod(shape) * _ITEM_BYTES[dtype]}")


def config_mismatch(got, want) -> list[str]:
    """Fields (other than dtypes and kernels) where config ``got`` differs from ``want``."""
    return [f"{f.name}: {getattr(got, f.name)!r} != served {getattr(want, f.name)!r}"
            for f in dataclasses.fields(want)
            if f.name not in _FREE_FIELDS and getattr(got, f.name) != getattr(want, f.name)]


def load_state(path: str, fmt: str, engine: Any):
    """``POST /v1/weights``: the weights (``nnx.State`` of Params and router biases, host numpy arrays)
    at ``path`` for the engine's model config. No model is built: an orbax directory is restored
    against ``nnx.eval_shape`` targets, a Hugging Face directory's tensors are read straight into the
    state tree; ``engine.set_weights`` then places them like its current weights (host to device,
    each device receiving its own shards), so the only device copy is the engine's own.

    Raises :class:`InputError` (field ``path``) for a missing directory, unreadable files (checked
    by :func:`check_hf_files` first), a config other than the served one or a checkpoint of another
    shape; other load errors (ValueError, OSError) propagate and the app reports them as 422 too.
    Nothing here touches the engine.
    """
    from flax import nnx

    from models.hf import config_from_hf, read_pretrained
    from models.weights import WEIGHTS
    from r3jax.params_io import read_weights

    cfg, p = engine.config, Path(path)
    if not p.is_dir():
        raise InputError("path", f"path={path!r}: not a directory on the server")
    if fmt == "safetensors":
        if not is_hf_dir(p):
            raise InputError("path", f"path={path!r}: expected config.json and *.safetensors (format "
                             "'safetensors')")
        check_hf_files(p)
        from safetensors import SafetensorError

        # the config first: a checkpoint of another model is refused before its tensors are read
        got = config_from_hf(json.loads((p / "config.json").read_bytes()), dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, moe_impl=cfg.moe_impl)
        diff = config_mismatch(got.replace(scan_layers=cfg.scan_layers), cfg)  # the layout is ours to pick
        if diff:
            raise InputError("path", f"path={path!r}: the checkpoint's config differs from the served "
                             f"model ({'; '.join(diff)}); restart the server with --model {path}")
        try:
            _, _, state = read_pretrained(p, dtype=cfg.dtype, param_dtype=cfg.param_dtype, moe_impl=cfg.moe_impl,
                                          scan_layers=cfg.scan_layers)
        except SafetensorError as e:  # a file damaged past what check_hf_files reads (tensor bytes)
            raise InputError("path", f"path={path!r}: unreadable safetensors file ({e})") from None
        weights, _ = nnx.split_state(state, WEIGHTS, ...)  # Params and router biases
        return weights
    if fmt == "orbax":
        _, weights, _ = abstract_model(cfg)
        return read_weights(p, weights)  # raises ValueError on a structure or shape mismatch
    raise InputError("format", f"format={fmt!r}: expected 'orbax' or 'safetensors'")
