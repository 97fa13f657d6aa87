"""Safetensors I/O shared by every architecture: lazy reading of single or sharded checkpoints, and
writing with Hugging Face's shard naming and index file."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import numpy as np

from models.fields import is_int

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_TENSOR_DTYPES = ("F64", "F32", "BF16", "F16")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def safetensors_modules():
    try:
        import safetensors.numpy  # noqa: F401  (lazy: the core package imports without it)
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("models.hf needs the 'safetensors' package: pip install 'r3jax[parity]'") from e
    return safetensors.numpy, safe_open


class Checkpoint(contextlib.ExitStack):
    """The tensors of a checkpoint directory, opened lazily (nothing is read until ``get``)."""

    def __init__(self, path: Path):
        super().__init__()
        _, safe_open = safetensors_modules()
        if (path / INDEX).exists():
            files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        elif (path / SINGLE).exists():
            files = [SINGLE]
        else:
            files = sorted(f.name for f in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files: expected {SINGLE} or shards with {INDEX}")
        self._where = {}
        for f in files:
            if not (path / f).exists():
                raise FileNotFoundError(f"{path / f}: listed in {INDEX} but not found")
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
        if kind not in FLOAT_TENSOR_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {kind}: expected one of {FLOAT_TENSOR_DTYPES}")

    def get(self, name: str, dtype) -> np.ndarray:
        return self._where[name].get_tensor(name).astype(dtype, copy=False)


def parse_size(size) -> int:
    if is_int(size) and size > 0:
        return int(size)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r}: expected a positive byte count or a string like '5GB'")
    return int(float(m.group(1)) * _UNITS[unit])


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


def write(path: Path, config: dict, tensors: dict[str, np.ndarray], limit: int) -> None:
    """``config.json`` + one ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards with
    an index. Previous weight files of that layout in ``path`` are removed first."""
    numpy_st, _ = safetensors_modules()
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model-*-of-*.safetensors"), path / SINGLE, path / INDEX]:
        old.unlink(missing_ok=True)  # stale shards of an earlier save would shadow or mix in
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = _shards(tensors, limit)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        numpy_st.save_file(tensors, str(path / SINGLE), metadata=meta)
        return
    weight_map = {}
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        numpy_st.save_file({n: tensors[n] for n in names}, str(path / fname), metadata=meta)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
