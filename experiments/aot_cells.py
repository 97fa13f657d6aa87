"""One cell of the memory plan: a program of one model compiled for one mesh, from abstract inputs.

Nothing is allocated: the train state comes from ``jax.eval_shape`` of ``init_train_state`` (so its
structure is the trainer's own), the engine's page pool from ``jax.eval_shape`` of
``PagedCache.init_pool``, and every leaf is a ``jax.ShapeDtypeStruct`` carrying the sharding the
trainer (:func:`r3jax.train.state_shardings`, :func:`r3jax.sharding.batch_sharding`) or the engine
(:class:`r3jax.engine.sharding.Placement`) would give it. The programs are the trainer's own jitted
step (:func:`r3jax.train.make_train_step`, R3 replay) and the engine's mixed step
(:func:`r3jax.engine.step.step`, jitted as ``Engine._build`` does) with decode rows only, one engine
core's (the server's data axis runs cores on disjoint devices), lowered at those inputs and compiled; per-chip bytes come from each leaf's shard shape, peak memory and bytes
accessed from XLA.
"""

from __future__ import annotations

import functools
import math
import re
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from models import MoeConfig, MoeTransformer
from models import axes
from models.axes import ReplicationError
from r3jax import sharding as batch_axes
from r3jax.batch import Batch
from r3jax.engine.programs import round_up
from r3jax.engine.sharding import AXES as ENGINE_AXES
from r3jax.engine.sharding import Placement
from r3jax.engine.sharding import make_mesh as engine_mesh
from r3jax.routes import route_dtype
from r3jax.train import init_train_state, make_train_step, state_shardings

PROGRAMS = ("train", "decode")


# ---- per-chip accounting -------------------------------------------------------------------------
def chip_bytes(tree) -> int:
    """Bytes one chip holds of ``tree`` (leaves with a ``sharding``): the largest shard of each leaf."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(tuple(leaf.shape))
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def full_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def describe_sharding(leaf) -> dict[str, Any]:
    """How one array is laid out: its spec, mesh axis sizes, global and per-chip shape."""
    sh = leaf.sharding
    spec = str(sh.spec) if isinstance(sh, NamedSharding) else str(sh)
    return {"spec": spec, "global_shape": list(leaf.shape), "chip_shape": list(sh.shard_shape(tuple(leaf.shape))),
            "dtype": np.dtype(leaf.dtype).name}


def _abstract(tree, shardings):
    """``tree``'s shapes and dtypes as ShapeDtypeStructs placed like ``shardings`` (same structure)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ---- meshes --------------------------------------------------------------------------------------
def train_layouts(cfg: MoeConfig, chips: int, max_tries: int = 6) -> list[tuple[int, int, int]]:
    """(data, fsdp, expert) layouts of the trainer's mesh to try, most parameter-sharded first:
    ``(d, chips / d, 1)`` for d = 1, 2, 4, ... (at most ``max_tries``).

    The batch splits over every axis (r3jax.sharding.BATCH_AXES) and experts over expert x fsdp
    (models.expert_parallel.expert_weight_spec: E when it divides, else each expert's hidden dim), so
    fsdp = chips / d splits parameters, optimizer state and experts that many ways (replicated over
    data) while the expert-parallel layer gathers tokens over those chips only. An expert axis would
    only move the same split from I to E, so it stays 1. Layouts leaving exactly one expert per chip
    are skipped (libtpu 0.0.42 fails to compile the ragged_dot gradient there), and so are layouts
    whose fsdp divides neither E nor I (the experts would be replicated: models.axes)."""
    out, d = [], 1
    while d <= chips and len(out) < max_tries:
        f = chips // d
        experts = axes.resolve(axes.EXPERT_IN, (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size),
                               {"data": d, "fsdp": f, "expert": 1}, "train")
        if chips % d == 0 and not (cfg.num_experts % f == 0 and cfg.num_experts // f < 2) and not experts.unsplit:
            out.append((d, f, 1))
        d *= 2
    return out


def train_layout(cfg: MoeConfig, chips: int) -> tuple[int, int, int]:
    """The first of :func:`train_layouts` (the one a CPU-simulated cell compiles)."""
    return train_layouts(cfg, chips)[0]


#: TPU vector lanes: a chip's share of an expert's hidden dim should be a multiple of this
TPU_LANES = 128


def decode_layouts(cfg: MoeConfig, chips: int, slots: int) -> list[tuple[int, int, int]]:
    """Every (data, tensor, expert) factorisation of ``chips`` the engine can use: ``data`` engine cores
    (:class:`r3jax.engine.group.EngineGroup`) that divide the slots, each on ``tensor x expert`` chips;
    tensor divides the kv heads (the KV cache splits by kv head), and each expert shard keeps >= 2
    experts (libtpu 0.0.42 fails on a lone expert per chip)."""
    out = []
    for t in _divisors(chips):
        for e in _divisors(chips // t):
            d = chips // (t * e)
            if cfg.num_kv_heads % t == 0 and cfg.num_experts % e == 0 and cfg.num_experts // e >= 2 \
                    and slots % d == 0:
                out.append((d, t, e))
    if not out:
        raise ValueError(f"no (data, tensor, expert) layout of {chips} chips fits slots={slots}, "
                         f"num_kv_heads={cfg.num_kv_heads}, num_experts={cfg.num_experts}")
    return out


def lane_aligned(cfg: MoeConfig, tensor: int, lanes: int = TPU_LANES) -> bool:
    """Whether ``tensor`` splits an expert's hidden size into shares that are multiples of ``lanes``.
    On a TPU a share that is not is padded and re-laid out around the expert matmuls: DeepSeek-V3
    decoding 256 x 8192 on 256 v5p chips at tensor = 64 (32 per chip) needed 114 GiB of temporaries and
    was refused; at tensor = 16 (128 per chip), 8.5 GiB."""
    share, ragged = divmod(cfg.moe_intermediate_size, tensor)
    return not ragged and share % lanes == 0


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _mesh(layout, devices) -> Mesh:
    """The engine's mesh; where jax cannot map that shape onto the slice's torus (e.g. 1 x 1 x 16 on
    2x2x4) the devices in their listed order (per-chip bytes do not depend on the order)."""
    try:
        return engine_mesh(*layout, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return Mesh(np.asarray(devices, dtype=object).reshape(layout), ENGINE_AXES,
                    axis_types=(AxisType.Auto,) * 3)


# ---- programs ------------------------------------------------------------------------------------
def abstract_batch(cfg: MoeConfig, rows: int, seq_len: int, sharding) -> Batch:
    """A training :class:`Batch` of ``[rows, seq_len]`` ShapeDtypeStructs (routes in the compact dtype)."""
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    b = (rows, seq_len)
    return Batch(tokens=s(b, jnp.int32), positions=s(b, jnp.int32), segment_ids=s(b, jnp.int32),
                 attention_mask=s(b, jnp.bool_), loss_mask=s(b, jnp.float32), advantages=s(b, jnp.float32),
                 rollout_logprobs=s(b, jnp.float32),
                 routes=s(b + (cfg.num_moe_layers, cfg.top_k), route_dtype(cfg.num_experts)),
                 route_mask=s(b, jnp.bool_))


def train_program(cfg: MoeConfig, devices, *, rows: int, seq_len: int, rl_batch: int, layout=None,
                  tx: optax.GradientTransformation | None = None):
    """The trainer's R3 step on a ``(data, fsdp, expert)`` mesh of ``devices`` at a minibatch of
    ``rows`` sequences; returns ``(jitted, args, info)`` (info: per-chip bytes and the layout)."""
    layout = train_layout(cfg, len(devices)) if layout is None else tuple(layout)
    try:
        mesh = batch_axes.make_mesh(*layout, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):  # shape jax cannot map onto the torus
        mesh = Mesh(np.asarray(devices, dtype=object).reshape(layout), batch_axes.AXES,
                    axis_types=(AxisType.Auto,) * 3)
    tx = optax.adamw(1e-6) if tx is None else tx
    state = jax.eval_shape(lambda: init_train_state(MoeTransformer(cfg, rngs=nnx.Rngs(0)), tx, mesh=mesh))
    state = _abstract(state, state_shardings(state, mesh))
    bsh = batch_axes.batch_sharding(mesh)
    batch = abstract_batch(cfg, rows, seq_len, bsh)
    full = abstract_batch(cfg, rl_batch, seq_len, bsh)
    info = {"mesh": dict(zip(batch_axes.AXES, layout)), "params_bytes": chip_bytes(state.params),
            "optimizer_bytes": chip_bytes(state.opt_state), "params_total_bytes": full_bytes(state.params),
            "minibatch_rows": rows, "minibatch_bytes": chip_bytes(batch),
            "routes_bytes": chip_bytes(full.routes), "routes_total_bytes": full_bytes(full.routes),
            "rl_batch_bytes": chip_bytes(full), "routes_sharding": describe_sharding(full.routes),
            "minibatch_routes_bytes": chip_bytes(batch.routes)}
    return make_train_step(state, replay="rollout"), (state, batch), info


def _decode_candidates(cfg: MoeConfig, devices, params, rest, *, slots: int, seq_len: int, block_size: int,
                       layouts=None, allow_replication: bool = False) -> list[tuple]:
    """Each layout's placement of one engine core (``layouts``: default every :func:`decode_layouts`),
    best first: on TPU devices lane-aligned expert shares (:func:`lane_aligned`) first, then the fewest
    resident bytes per chip (parameters + pool), no replication, the larger data axis. A layout
    Placement refuses (models.axes) is left out, unless it was asked for by name (then it raises)."""
    from models.paged import PagedCache

    tpu = getattr(devices[0], "platform", None) == "tpu"
    candidates = decode_layouts(cfg, len(devices), slots) if layouts is None else layouts
    scored, refused = [], []
    for lay in candidates:
        d, t, e = lay
        if slots % d:
            raise ValueError(f"layout={lay}: data={d} engine cores must divide slots={slots}")
        rows, num_pages = slots // d, 1 + (slots // d) * -(-seq_len // block_size)
        k, v = jax.eval_shape(lambda: PagedCache.init_pool(cfg, num_pages, block_size))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                place = Placement(_mesh((1, t, e), devices[:t * e]), cfg, allow_replication=allow_replication)
                p_ = _abstract(params, place.param_shardings(params))
                r_ = _abstract(rest, jax.tree.map(lambda _: place.replicated, rest))
                kv = place.kv()  # as Engine: [n, P, ps, Hc, Dc], heads along tensor, pages whole
                pool = (tuple(_abstract(a, kv) for a in k), tuple(_abstract(a, kv) for a in v))
            except ReplicationError as err:  # a layout that would replicate an array: not one the engine takes
                if layouts is not None:
                    raise
                refused.append(err)
                continue
        notes = [str(w.message) for w in caught if "allow_replication=True" in str(w.message)]
        key = (tpu and not lane_aligned(cfg, t), chip_bytes(p_) + chip_bytes(pool), bool(notes), -d, t)
        scored.append((key, lay, place, (p_, r_, pool), rows, num_pages, notes))
    if not scored:
        raise refused[0]
    return sorted(scored, key=lambda s: s[0])


def decode_order(cfg: MoeConfig, devices, *, slots: int, seq_len: int, block_size: int = 16,
                 allow_replication: bool = False) -> list[tuple[int, int, int]]:
    """The layouts :func:`decode_program` chooses from, best first (its default is the first)."""
    model = nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return [s[1] for s in _decode_candidates(cfg, devices, params, rest, slots=slots, seq_len=seq_len,
                                             block_size=block_size, allow_replication=allow_replication)]


def decode_program(cfg: MoeConfig, devices, *, slots: int, seq_len: int, decode_steps: int = 8,
                   block_size: int = 16, stop_width: int = 64, layout=None, allow_replication: bool = False):
    """The engine's decode program on ``devices``: ``slots`` decode rows, every row's page table as long
    as a ``seq_len`` request; returns ``(jitted, args, info)``. A layout (data, tensor, expert) is what
    the server runs (``--mesh D,T,E``): ``data`` engine cores (:class:`r3jax.engine.group.EngineGroup`),
    each an engine on its own ``tensor x expert`` devices with ``slots / data`` rows and a pool of its
    own of ``1 + (slots / data) * pages`` pages of ``block_size`` tokens (the engine's default pool
    without a prefix cache). The cores run the same program on disjoint devices, so the program
    compiled is one core's, on the first ``tensor x expert`` devices; per-chip figures are a core's
    chips' (every chip of the slice holds the same). With ``decode_steps`` > 1 it is the engine's decode
    loop (:func:`r3jax.engine.step.decode_loop`: ``decode_steps`` tokens per row per call, the stop
    check on device against ``stop_width`` stop ids per row, route rows ``[decode_steps, rows, L, K]``);
    with 1, one step (:func:`r3jax.engine.step.step`). The program is traced under the core's mesh, so
    the paged attention's ``"auto"`` sees the target's devices (the Pallas kernel on a TPU topology,
    :mod:`models.paged`).

    ``layout`` defaults to the first of :func:`decode_order`: on a TPU a lane-aligned expert share
    first, then the fewest resident bytes per chip (parameters + pool as :class:`Placement` places
    them), ties to the larger data axis. A layout on which Placement would replicate an array
    (models.axes: e.g. an MLA latent pool over tensor) is skipped, unless ``allow_replication`` (as
    the engine's): then it competes like the others and ``info["replicated"]`` names what it
    replicates."""
    from models.paged import RaggedLayout
    from r3jax.engine import step as engine_step
    from r3jax.engine.engine import BLOCK_TOKENS

    block_pages = max(1, BLOCK_TOKENS // block_size)  # as Engine
    pages_per_row = round_up(-(-seq_len // block_size), block_pages)
    model = nnx.eval_shape(lambda: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rdt = route_dtype(cfg.num_experts)
    scored = _decode_candidates(cfg, devices, params, rest, slots=slots, seq_len=seq_len, block_size=block_size,
                                layouts=None if layout is None else [tuple(layout)],
                                allow_replication=allow_replication)
    _, layout, place, (params, rest, (k, v)), rows, num_pages, notes = scored[0]
    d = layout[0]
    lay_step = RaggedLayout(decode_rows=rows, prefill_rows=0, prefill_len=1, pages_per_row=pages_per_row,
                            block_pages=min(block_pages, pages_per_row))
    rep = place.replicated
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    i32 = lambda *shape: sds(shape, jnp.int32)
    n, r = lay_step.tokens, lay_step.rows
    x = engine_step.StepInputs(tokens=i32(n), from_slot=i32(n), positions=i32(n), page=i32(n), offset=i32(n),
                               table=i32(r, pages_per_row), kv_len=i32(r), sample_at=i32(r), slot=i32(r),
                               key_data=sds((r, 2), jnp.uint32), index=i32(r), temperature=sds((r,), jnp.float32),
                               top_k=i32(r), top_p=sds((r,), jnp.float32), processed=sds((r,), jnp.bool_))
    last = i32(rows)
    mesh = place.mesh
    common = dict(layout=lay_step, head_only=callable(getattr(model, "logits", None)), route_dtype=rdt)
    if decode_steps > 1:  # as Engine._build
        fn = functools.partial(engine_step.decode_loop, graphdef, steps=decode_steps, page_size=block_size,
                               route_shape=(cfg.num_moe_layers, cfg.top_k), **common)
        extra = (i32(r, 1 + stop_width),)
    else:
        fn, extra = functools.partial(engine_step.step, graphdef, **common), ()

    def under_mesh(*args):  # the kernels choose by the target's devices (models/paged.py)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    kv = place.kv()
    out = (tuple(kv for _ in k), tuple(kv for _ in v), rep, rep, rep, rep)
    jitted = jax.jit(under_mesh, donate_argnums=(2, 3, 4), out_shardings=out)  # as Engine._build
    # the call's route rows (the pool's are on the host)
    call_rows = (decode_steps, r) if decode_steps > 1 else (n,)
    routes = sds(call_rows + (cfg.num_moe_layers, cfg.top_k), rdt)
    info = {"mesh": dict(zip(ENGINE_AXES, layout)), "engine_cores": d, "core_devices": len(mesh.devices.flat),
            "core_slots": rows, "replicated": notes, "decode_steps": decode_steps,
            "params_bytes": chip_bytes(params), "optimizer_bytes": 0, "params_total_bytes": full_bytes(params),
            "slots": slots, "num_pages": num_pages, "pages_per_row": pages_per_row, "step_tokens": n,
            "kv_cache_bytes": chip_bytes((k, v)), "routes_bytes": chip_bytes(routes),
            "routes_total_bytes": d * full_bytes(routes), "slot_state_bytes": chip_bytes((k, v, last)),
            "routes_sharding": describe_sharding(routes), "layouts_considered": len(scored)}
    return jitted, (params, rest, k, v, last, x) + extra, info


# ---- compile -------------------------------------------------------------------------------------
_OOM = re.compile(r"required[^(]*\(([\d.]+)([KMGT])\)[^(]*available HBM \(([\d.]+)([KMGT])\)")


def _size(num: str, unit: str) -> int:
    return int(float(num) * (1 << (10 * "KMGT".index(unit) + 10)))


def compile_report(jitted, args) -> dict[str, Any]:
    """Lower and compile ``jitted`` at ``args``; what XLA says about one chip.

    status "fits" with peak_bytes (``memory_analysis().peak_memory_in_bytes``), argument/output/temp
    bytes and flops per chip, or "RESOURCE_EXHAUSTED" with what libtpu said it needed and had, or
    "error" with the message. compile_s counts lowering and compilation."""
    t0 = time.perf_counter()
    try:
        lowered = jitted.lower(*args)
        t_lower = time.perf_counter() - t0
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - every failure is a result of this cell
        msg = str(e)
        out = {"compile_s": time.perf_counter() - t0, "error": msg[:2000]}
        if "RESOURCE_EXHAUSTED" in msg:
            out["status"] = "RESOURCE_EXHAUSTED"
            m = _OOM.search(msg)
            if m:
                out["required_bytes"], out["available_bytes"] = _size(*m.group(1, 2)), _size(*m.group(3, 4))
        else:
            out["status"] = "error"
            out["error_type"] = type(e).__name__
        return out
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"status": "fits", "compile_s": time.perf_counter() - t0, "lower_s": t_lower,
            "peak_bytes": int(ma.peak_memory_in_bytes), "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes),
            "temp_bytes": int(ma.temp_size_in_bytes), "flops": float((cost or {}).get("flops", -1.0)),
            # XLA's estimate: a while loop's body counted once, a Pallas kernel's own DMAs not at all
            "bytes_accessed": float((cost or {}).get("bytes accessed", -1.0))}
