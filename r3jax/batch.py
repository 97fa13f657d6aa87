"""Training batches: trajectories collated into a padded or packed ``[B, S]`` pytree.

Every field is indexed by the absolute token position i of its row, so row i of ``routes`` is the
route used when token i was fed as input (docs/design.md §3) and ``loss_mask[i]`` marks token i as a
target predicted from the logits at i - 1 of the same segment.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import struct

from r3jax import checks
from r3jax.checks import FieldError
from r3jax.routes import route_dtype, uncaptured_rows

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@struct.dataclass
class Batch:
    """tokens [B, S] int32; positions [B, S] int32 (restart at 0 per segment, 0 on padding);
    segment_ids [B, S] int32 (0 = padding, 1.. = trajectory index within the row);
    attention_mask [B, S] bool (segment_ids > 0); loss_mask [B, S] f32 (token i is a loss-active
    target; 0 at each segment's first token); advantages [B, S] f32 (the trajectory's advantage on
    its tokens, 0 on padding); rollout_logprobs [B, S] f32 (0 where not generated);
    routes [B, S, L, K] in ``route_dtype(E)``; route_mask [B, S] bool (True where a captured row
    exists; False rows hold ``0..K-1``); token_versions [B, S] int32 (the weight version that sampled
    each generated token, -1 where none did or the trajectory does not say; :func:`mask_stale` reads it),
    or None (a batch built without it); route_versions [B, S] int32 (the weight version whose forward
    produced each captured route row, -1 elsewhere: a trainer at version c replays rows ``c - v``
    versions old), or None."""

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    rollout_logprobs: jax.Array
    routes: jax.Array
    route_mask: jax.Array
    token_versions: jax.Array | None = None
    route_versions: jax.Array | None = None


def _get(traj: Any, i: int, name: str) -> Any:
    if isinstance(traj, Mapping):
        if name not in traj:
            raise ValueError(f"trajectories[{i}] has no field {name!r}")
        return traj[name]
    if not hasattr(traj, name):
        raise ValueError(f"trajectories[{i}] ({type(traj).__name__}) has no field {name!r}")
    return getattr(traj, name)


def _vector(i: int, name: str, value: Any, n: int | None, kind: str) -> np.ndarray:
    arr = np.asarray(value)
    field = f"trajectories[{i}].{name}"
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        want = "1 dim" if n is None else f"[N] = ({n},), N = len(tokens)"
        raise ValueError(f"{field} shape={arr.shape}: expected {want}")
    ok = {"int": np.issubdtype(arr.dtype, np.integer),  # np.bool_ is not an np.integer
          "bool": arr.dtype == np.bool_,
          # jnp.issubdtype: np.issubdtype calls bfloat16 (an ml_dtypes type) not a number
          "real": arr.dtype == np.bool_ or jax.numpy.issubdtype(arr.dtype, jax.numpy.number)}[kind]
    if not ok:
        raise ValueError(f"{field} dtype={arr.dtype}: expected {kind} values")
    if kind == "real" and not np.all(np.isfinite(arr)):
        raise ValueError(f"{field} contains a non-finite value at {int(np.argmin(np.isfinite(arr)))}")
    return arr


def _trajectory(i: int, traj: Any, num_layers: int, top_k: int, num_experts: int) -> dict:
    """Validated, host-side arrays of one trajectory."""
    tokens = _vector(i, "tokens", _get(traj, i, "tokens"), None, "int")
    n = tokens.shape[0]
    if n == 0:
        raise ValueError(f"trajectories[{i}].tokens is empty: expected at least one token")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= 2**31:
        raise ValueError(f"trajectories[{i}].tokens has id {lo if lo < 0 else hi}: expected ids "
                         f"in [0, 2**31)")
    loss_mask = _vector(i, "loss_mask", _get(traj, i, "loss_mask"), n, "real")
    if loss_mask[0] != 0:
        raise ValueError(f"trajectories[{i}].loss_mask[0]={loss_mask[0]}: expected 0 (the first "
                         f"token has no logits predicting it)")
    logprobs = _vector(i, "rollout_logprobs", _get(traj, i, "rollout_logprobs"), n, "real")
    adv = _get(traj, i, "advantage")
    if np.ndim(adv) != 0 or not jax.numpy.issubdtype(np.asarray(adv).dtype, jax.numpy.number) or not np.isfinite(adv):
        raise ValueError(f"trajectories[{i}].advantage={adv!r}: expected a finite float")
    routes = np.asarray(_get(traj, i, "routes"))
    if routes.shape != (n, num_layers, top_k):
        raise ValueError(f"trajectories[{i}].routes shape={routes.shape}: expected [N, L, K] = "
                         f"{(n, num_layers, top_k)}")
    captured = _vector(i, "captured", _get(traj, i, "captured"), n, "bool")
    # Uncaptured rows are ignored (docs/design.md §3), so only captured ones are checked; substituting
    # 0..K-1 for the others keeps the token index in the message. bool/float keep their dtype and
    # are refused by the check.
    ids = routes
    if np.issubdtype(routes.dtype, np.integer):
        ids = np.where(captured[:, None, None], routes, uncaptured_rows(n, num_layers, top_k, routes.dtype))
    checks.check_route_ids(ids, num_experts, f"trajectories[{i}].routes")
    stamps = {}
    for name in ("token_versions", "route_versions"):  # optional: -1 (unknown) when absent
        value = getattr(traj, name, None) if not isinstance(traj, Mapping) else traj.get(name)
        stamps[name] = np.full(n, -1, np.int32) if value is None else _vector(i, name, value, n, "int")
    return {"tokens": tokens, "loss_mask": loss_mask, "rollout_logprobs": logprobs,
            "advantage": float(adv), "routes": routes, "captured": captured, **stamps}


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket >= ``length`` (so S, and the compiled shapes, take few values)."""
    fits = [b for b in buckets if b >= length]
    if not fits:
        raise ValueError(f"longest trajectory has {length} tokens: expected <= the largest bucket "
                         f"{max(buckets)} (pass seq_len= or a larger bucket)")
    return min(fits)


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Greedy first-fit decreasing: rows of trajectory indices, each row's lengths summing to <= S.

    Trajectories are placed longest first (ties in input order) into the first row with room;
    segment id k of row r is trajectory ``rows[r][k - 1]``.
    """
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    rows: list[list[int]] = []
    room: list[int] = []
    for j in order:
        if lengths[j] > seq_len:
            raise ValueError(f"trajectories[{j}] has {lengths[j]} tokens: expected <= seq_len={seq_len}")
        r = next((r for r, free in enumerate(room) if free >= lengths[j]), None)
        if r is None:
            rows.append([]), room.append(seq_len)
            r = len(rows) - 1
        rows[r].append(j)
        room[r] -= lengths[j]
    return rows


def collate(trajectories: Sequence[Any], *, seq_len: int | None = None,
            buckets: Sequence[int] = DEFAULT_BUCKETS, packed: bool = False, num_experts: int,
            top_k: int, num_layers: int, batch_multiple: int = 1, pad_id: int = 0) -> Batch:
    """Collate trajectories into a :class:`Batch` of NumPy arrays (host memory).

    A trajectory is a mapping or object with ``tokens [N]``, ``loss_mask [N]``,
    ``rollout_logprobs [N]``, ``advantage`` (float), ``routes [N, L, K]`` and ``captured [N]`` bool
    (as :meth:`RoutedExpertTrace.finalize` returns). S is ``seq_len`` or the smallest bucket >= the
    longest trajectory. Padded layout: row r is trajectory r, right-padded. Packed layout: rows from
    :func:`pack_rows`, positions restart at 0 per segment. B is then padded up to a multiple of
    ``batch_multiple`` (e.g. ``r3jax.sharding.batch_multiple(mesh)``) with all-padding rows.
    """
    if len(trajectories) == 0:
        raise ValueError("trajectories is empty: expected at least one trajectory")
    for name, v in {"num_experts": num_experts, "top_k": top_k, "num_layers": num_layers,
                    "batch_multiple": batch_multiple}.items():
        checks.check_int(name, v, 1)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k}: expected <= num_experts={num_experts}")
    trajs = [_trajectory(i, t, num_layers, top_k, num_experts) for i, t in enumerate(trajectories)]
    lengths = [t["tokens"].shape[0] for t in trajs]
    longest = max(lengths)
    if seq_len is None:
        seq_len = bucket_length(longest, buckets)
    elif not checks.is_int(seq_len) or seq_len < longest:
        j = int(np.argmax(lengths))
        raise FieldError("seq_len", seq_len, f"an int >= the longest trajectory (trajectories[{j}] has "
                         f"{longest} tokens)")
    rows = pack_rows(lengths, seq_len) if packed else [[j] for j in range(len(trajs))]
    b = -(-len(rows) // batch_multiple) * batch_multiple
    s = int(seq_len)

    dtype = route_dtype(num_experts)
    fill = uncaptured_rows(1, num_layers, top_k, dtype)  # [1, L, K]: what non-replayed rows hold
    out = {"tokens": np.full((b, s), pad_id, np.int32), "positions": np.zeros((b, s), np.int32),
           "segment_ids": np.zeros((b, s), np.int32), "loss_mask": np.zeros((b, s), np.float32),
           "advantages": np.zeros((b, s), np.float32),
           "rollout_logprobs": np.zeros((b, s), np.float32),
           "routes": np.broadcast_to(fill, (b, s, num_layers, top_k)).copy(),
           "route_mask": np.zeros((b, s), bool), "token_versions": np.full((b, s), -1, np.int32),
           "route_versions": np.full((b, s), -1, np.int32)}
    for r, members in enumerate(rows):
        offset = 0
        for seg, j in enumerate(members, start=1):
            t, n = trajs[j], lengths[j]
            span = slice(offset, offset + n)
            out["tokens"][r, span] = t["tokens"]
            out["positions"][r, span] = np.arange(n, dtype=np.int32)
            out["segment_ids"][r, span] = seg
            out["loss_mask"][r, span] = t["loss_mask"]
            out["advantages"][r, span] = t["advantage"]
            out["rollout_logprobs"][r, span] = t["rollout_logprobs"]
            out["routes"][r, span] = np.where(t["captured"][:, None, None], t["routes"], fill)
            out["route_mask"][r, span] = t["captured"]
            out["token_versions"][r, span] = t["token_versions"]
            out["route_versions"][r, span] = np.where(t["captured"], t["route_versions"], -1)
            offset += n
    return Batch(attention_mask=out["segment_ids"] > 0, **out)


def mask_stale(batch: Batch, current_version: int, max_staleness: int) -> tuple[Batch, int]:
    """``(batch, tokens masked)``: ``batch`` with ``loss_mask`` 0 on every loss-active token sampled more
    than ``max_staleness`` weight versions before ``current_version`` (``current - version >
    max_staleness``; tokens of unknown version, -1, are kept). Host-side, on :func:`collate`'s arrays; the
    count says how many tokens the bound took out, so none is dropped silently."""
    checks.check_int("current_version", current_version, 0)
    checks.check_int("max_staleness", max_staleness, 0)
    if batch.token_versions is None:
        raise ValueError("mask_stale: batch.token_versions is None: expected a batch from collate")
    versions = np.asarray(batch.token_versions)
    loss = np.asarray(batch.loss_mask)
    stale = (versions >= 0) & (current_version - versions > max_staleness) & (loss != 0)
    return batch.replace(loss_mask=np.where(stale, 0, loss).astype(loss.dtype)), int(stale.sum())


def version_lag(batch: Batch, current_version: int) -> dict:
    """``{"version_lag_mean", "version_lag_max"}``: ``current_version`` minus the version that sampled each
    loss-active token of known version (0 when there is none)."""
    versions, loss = np.asarray(batch.token_versions), np.asarray(batch.loss_mask)
    known = (versions >= 0) & (loss > 0)
    lag = current_version - versions[known]
    return {"version_lag_mean": float(lag.mean()) if lag.size else 0.0,
            "version_lag_max": int(lag.max()) if lag.size else 0}


def fill_ratio(batch: Batch) -> float:
    """Real tokens / (B * S): the share of the batch that is not padding."""
    mask = np.asarray(batch.attention_mask)
    return float(mask.sum() / max(mask.size, 1))
