"""Parameter files: a model's weights as a standalone orbax directory, written and read back.

The *weights* are what defines the policy a rollout engine must run: every ``nnx.Param`` plus the
non-trainable router biases (:class:`models.routers.RouterBias`, DeepSeek's
``e_score_correction_bias``), which live outside the optimizer's params but change expert selection.
Weight sync, export and load all move both (:data:`models.weights.WEIGHTS`, :func:`weights_of`).

The one home of params file I/O, used by the trainer (``r3jax.train.export_params``, weight sync)
and by the server (``--model DIR``, ``POST /v1/weights``) without either importing the other.
The on-disk form is the params ``nnx.State`` as nested string-keyed dicts (:mod:`r3jax.tree_io`),
readable by any orbax user.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from models.stacking import GROUPS as STACKED
from models.routers import RouterBias
from models.weights import WEIGHTS
from r3jax import tree_io


def params_of(model_or_state: Any) -> nnx.State:
    """The ``nnx.State`` of Params of a module, an ``nnx.State`` itself, or an object holding one as
    ``.params`` (the trainer's ``TrainState``)."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    if isinstance(getattr(model_or_state, "params", None), nnx.State):
        return model_or_state.params
    raise ValueError(f"model_or_state={type(model_or_state).__name__}: expected an nnx.Module, a "
                     "TrainState or an nnx.State of Params")


def weights_of(model_or_state: Any) -> nnx.State:
    """The weights (:data:`models.weights.WEIGHTS`: Params and router biases) of a module, of the trainer's
    ``TrainState`` (``params`` plus the biases in ``rest``), or an ``nnx.State`` itself."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, WEIGHTS)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    params, rest = getattr(model_or_state, "params", None), getattr(model_or_state, "rest", None)
    if isinstance(params, nnx.State):
        if isinstance(rest, nnx.State):
            biases, _ = nnx.split_state(rest, RouterBias, ...)
            return nnx.merge_state(params, biases)
        return params
    raise ValueError(f"model_or_state={type(model_or_state).__name__}: expected an nnx.Module, a "
                     "TrainState or an nnx.State of weights")


def export_params(path, model_or_state: Any) -> pathlib.Path:
    """Write the weights (Params and router biases) as a standalone orbax checkpoint directory at
    ``path`` (replaced if it exists); blocks until it is complete. Returns the absolute path."""
    path = pathlib.Path(path).absolute()
    item = tree_io.to_nested(weights_of(model_or_state))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, item, force=True)
        ckpt.wait_until_finished()
    return path


def load_params(path, model: nnx.Module) -> nnx.Module:
    """Load a directory written by :func:`export_params` into ``model`` (in place) and return it.

    Arrays are restored with the shapes, dtypes and shardings of the model's current params (a
    checkpoint saved from an fp32 trainer loads into a bf16 model as bf16). Raises ValueError,
    before any array is read, for a path that is not a directory, a directory without readable
    orbax item metadata (orbax logs a warning and reports none for a missing or unparsable
    ``_METADATA``), or params whose structure or shapes differ from the model's (naming the first
    offending parameter). Errors reading the arrays themselves (I/O, corrupt data) propagate.
    """
    path = pathlib.Path(path).absolute()
    current = nnx.state(model, WEIGHTS)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), current)
    target = tree_io.to_nested(abstract)
    with ocp.StandardCheckpointer() as ckpt:
        _check_stored(ckpt, path, target)
        nested = ckpt.restore(path, target)
    nnx.update(model, tree_io.from_nested(nested, current))
    return model


def read_weights(path, abstract: nnx.State) -> nnx.State:
    """The weights in a directory written by :func:`export_params`, as host numpy arrays in the
    structure of ``abstract`` (an ``nnx.State`` of ``jax.ShapeDtypeStruct``, e.g. from
    ``nnx.eval_shape``: nothing is allocated for it) and cast to its dtypes. Nothing is put on a
    device: the caller places them (``Engine.set_weights``). Raises ValueError like
    :func:`load_params`, before any array is read."""
    path = pathlib.Path(path).absolute()
    target = tree_io.to_nested(abstract)
    with ocp.StandardCheckpointer() as ckpt:
        _check_stored(ckpt, path, target)
    args = jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), target)
    with ocp.PyTreeCheckpointer() as ckpt:  # per-leaf restore args: numpy, no sharding to give
        nested = ckpt.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=args))
    return tree_io.from_nested(nested, abstract)


def _check_stored(ckpt: ocp.StandardCheckpointer, path: pathlib.Path, target: dict) -> None:
    """Host-side, before any array is read: ``path`` is a params directory holding exactly
    ``target``'s params, with the same shapes."""
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r}: expected an orbax params directory written by export_params")
    item = ckpt.metadata(path).item_metadata
    stored = None if item is None else getattr(item, "tree", None)
    if not isinstance(stored, dict):
        raise ValueError(f"path={str(path)!r}: expected an orbax params directory written by "
                         "export_params (no readable orbax item metadata there)")
    _check_same_params(path, _shapes(target), _shapes(stored))


def _shapes(nested, prefix=()) -> dict[tuple[str, ...], tuple[int, ...] | None]:
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(_shapes(v, prefix + (str(k),)))
        else:  # an array (or its metadata); None for a leaf that is not an array at all
            shape = getattr(v, "shape", None)
            out[prefix + (str(k),)] = None if shape is None else tuple(shape)
    return out


def _check_same_params(path, want: dict, have: dict) -> None:
    """Host-side: the checkpoint holds exactly the model's params, with the same shapes."""
    where = f"path={str(path)!r} does not hold this model's params"
    scanned = lambda keys: any(k[0] in STACKED for k in keys)  # models/stacking.py layouts
    hint = ""
    if scanned(have) != scanned(want):
        hint = (f" (the file holds {'scanned' if scanned(have) else 'unrolled'} layers; the model has "
                f"scan_layers={scanned(want)})")
    for key in sorted(set(want) | set(have)):
        name = "/".join(key)
        if key not in have:
            raise ValueError(f"{where}: {name} is missing (expected shape {want[key]}){hint}")
        if key not in want:
            raise ValueError(f"{where}: {name} (shape {have[key]}) is not a parameter of the model{hint}")
        if want[key] != have[key]:
            raise ValueError(f"{where}: {name} has shape {have[key]}, expected {want[key]}")
