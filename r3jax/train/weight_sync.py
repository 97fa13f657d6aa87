"""Weight sync from the trainer to the rollout side.

In process: ``push_to_engine(engine, state)`` hands the params to ``Engine.set_weights`` and returns
the new ``weight_version``. Remote: ``push_to_server(url, path, state)`` writes a standalone orbax
params directory with :func:`r3jax.params_io.export_params` and calls ``POST {url}/v1/weights`` with
``{"path": dir, "format": "orbax"}``; the server reads it into host arrays with
:func:`r3jax.params_io.read_weights` (no model built) and places them on its engine.
"""

from __future__ import annotations

from typing import Any

import httpx

from r3jax.params_io import export_params, load_params, params_of, weights_of

__all__ = ["export_params", "load_params", "params_of", "push_to_engine", "push_to_server", "weights_of"]


def push_to_engine(engine: Any, model_or_state: Any, *, mode: str | None = None, version: int | None = None) -> int:
    """In-process sync: ``engine.set_weights(weights, mode=mode, version=version)`` (Params and router
    biases, :func:`r3jax.params_io.weights_of`; ``mode`` "wait" (None: the default), "keep" or "abort":
    what requests running meanwhile do; ``version``: the new weight version, e.g. the trainer's step,
    default the engine's + 1, ``Engine.set_weights``); returns the engine's new weight_version.

    Each array is handed over where it lives (sharded on the trainer's mesh, say): the engine copies
    it onto its own placement device to device (:func:`r3jax.sharding.place_copy`), never through the
    host or one gathering device, and its params keep the engine's shardings, so its step programs
    compile once whatever the trainer's layout.
    """
    kw = {} if version is None else {"version": int(version)}
    return int(engine.set_weights(weights_of(model_or_state), mode=mode, **kw))


def push_to_server(url: str, path, model_or_state: Any, *, api_key: str | None = None,
                   timeout: float = 120.0, client: httpx.Client | None = None, mode: str | None = None,
                   version: int | None = None) -> int:
    """Remote sync: export the params to ``path`` (a directory the server can read), then
    ``POST {url}/v1/weights`` (``?mode=`` when given; ``weight_version``: ``version`` when given) and
    return the server's new ``weight_version``.

    Raises ``httpx.HTTPStatusError`` for a non-2xx answer and ValueError for a body without an int
    ``weight_version``. ``client`` lets tests inject a transport.
    """
    return post_weights(url, export_params(path, model_or_state), api_key=api_key, timeout=timeout, client=client,
                        mode=mode, version=version)


def post_weights(url: str, path, *, api_key: str | None = None, timeout: float = 120.0,
                 client: httpx.Client | None = None, mode: str | None = None, version: int | None = None) -> int:
    """``POST {url}/v1/weights`` of params already exported to ``path`` (:func:`export_params`: one export
    serves several servers); the server's new ``weight_version``. Errors as :func:`push_to_server`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"path": str(path), "format": "orbax", **({} if version is None else {"weight_version": int(version)})}
    own = client is None
    client = httpx.Client(timeout=timeout) if own else client
    try:
        resp = client.post(url.rstrip("/") + "/v1/weights", json=body, headers=headers,
                           params={} if mode is None else {"mode": mode})
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
