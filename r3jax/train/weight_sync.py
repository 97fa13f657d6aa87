"""Weight sync from the trainer to the rollout side.

In process: ``push_to_engine(engine, state)`` hands the params to ``Engine.set_weights`` and returns
the new ``weight_version``. Remote: ``push_to_server(url, path, state)`` writes a standalone orbax
params checkpoint with :func:`export_params` and calls ``POST {url}/v1/weights`` with
``{"path": dir, "format": "orbax"}``; the server loads it with :func:`load_params`.
"""

from __future__ import annotations

import pathlib
from typing import Any

import httpx
import jax
import orbax.checkpoint as ocp
from flax import nnx

from r3jax.train import tree_io
from r3jax.train.state import TrainState


def params_of(model_or_state: Any) -> nnx.State:
    """The ``nnx.State`` of Params of a module, a TrainState, or an ``nnx.State`` itself."""
    if isinstance(model_or_state, TrainState):
        return model_or_state.params
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    raise ValueError(f"model_or_state={type(model_or_state).__name__}: expected an nnx.Module, a "
                     "TrainState or an nnx.State of Params")


def export_params(path, model_or_state: Any) -> pathlib.Path:
    """Write the params as a standalone orbax checkpoint directory at ``path`` (replaced if it
    exists); blocks until it is complete. Returns the absolute path."""
    path = pathlib.Path(path).absolute()
    item = tree_io.to_nested(params_of(model_or_state))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, item, force=True)
        ckpt.wait_until_finished()
    return path


def load_params(path, model: nnx.Module) -> nnx.Module:
    """Load a directory written by :func:`export_params` into ``model`` (in place) and return it.

    Arrays are restored with the shapes, dtypes and shardings of the model's current params (a
    checkpoint saved from an fp32 trainer loads into a bf16 model as bf16). A directory whose
    params do not match the model's structure or shapes raises ValueError naming the first
    offending parameter, checked from orbax metadata before any array is read.
    """
    path = pathlib.Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r}: expected an orbax params directory written by export_params")
    current = nnx.state(model, nnx.Param)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), current)
    target = tree_io.to_nested(abstract)
    with ocp.StandardCheckpointer() as ckpt:
        try:
            stored = ckpt.metadata(path).item_metadata.tree
        except Exception as e:  # noqa: BLE001 - not an orbax directory at all
            raise ValueError(f"path={str(path)!r}: expected an orbax params directory written by "
                             f"export_params ({type(e).__name__}: {str(e)[:200]})") from e
        _check_same_params(path, _shapes(target), _shapes(stored))
        nested = ckpt.restore(path, target)
    nnx.update(model, tree_io.from_nested(nested, current))
    return model


def _shapes(nested, prefix=()) -> dict[tuple[str, ...], tuple[int, ...]]:
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(_shapes(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = tuple(v.shape)
    return out


def _check_same_params(path, want: dict, have: dict) -> None:
    """Host-side: the checkpoint holds exactly the model's params, with the same shapes."""
    where = f"path={str(path)!r} does not hold this model's params"
    for key in sorted(set(want) | set(have)):
        name = "/".join(key)
        if key not in have:
            raise ValueError(f"{where}: {name} is missing (expected shape {want[key]})")
        if key not in want:
            raise ValueError(f"{where}: {name} (shape {have[key]}) is not a parameter of the model")
        if want[key] != have[key]:
            raise ValueError(f"{where}: {name} has shape {have[key]}, expected {want[key]}")


def push_to_engine(engine: Any, model_or_state: Any) -> int:
    """In-process sync: ``engine.set_weights(params)``; returns the engine's new weight_version.

    Leaves are handed over on one device (the default device, where an ``Engine`` lives), gathered
    if sharded on a trainer mesh, so every sync presents the same placement: the engine compiles
    its programs for trainer weights once (its first sync), not again on later syncs.
    """
    device = jax.devices()[0]
    single = lambda x: x if isinstance(getattr(x, "sharding", None), jax.sharding.SingleDeviceSharding) \
        else jax.device_put(x, device)
    return int(engine.set_weights(jax.tree.map(single, params_of(model_or_state))))


def push_to_server(url: str, path, model_or_state: Any, *, api_key: str | None = None,
                   timeout: float = 120.0, client: httpx.Client | None = None) -> int:
    """Remote sync: export the params to ``path`` (a directory the server can read), then
    ``POST {url}/v1/weights`` and return the server's new ``weight_version``.

    Raises ``httpx.HTTPStatusError`` for a non-2xx answer and ValueError for a body without an int
    ``weight_version``. ``client`` lets tests inject a transport.
    """
    path = export_params(path, model_or_state)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"path": str(path), "format": "orbax"}
    own = client is None
    client = httpx.Client(timeout=timeout) if own else client
    try:
        resp = client.post(url.rstrip("/") + "/v1/weights", json=body, headers=headers)
    finally:
        if own:
            client.close()
    resp.raise_for_status()
    version = resp.json().get("weight_version") if resp.headers.get("content-type", "").startswith(
        "application/json") else None
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"POST {url}/v1/weights answered {resp.text[:200]!r}: expected JSON "
                         '{"weight_version": int}')
    return version
