"""One table for every sharding: the logical axes each parameter declares where it is built, the mesh
axes each role puts them on, and the one rule for a dimension that a mesh axis does not divide.

Every ``nnx.Param`` of the model is built with ``logical_axes`` metadata, one name per dim (as flax's
partitioning metadata and MaxText's ``logical_axis_rules``): q_proj ``("embed", "heads")``, an expert
weight ``("experts", "expert_embed", "expert_mlp")``, ... Stacked (scanned) layers add a leading
``"layers"`` axis, in one place (:func:`param_axes`). A tree without the metadata (a nested dict of
arrays: a checkpoint, a tensor map) is matched to the declarations by each parameter's name.

Two roles, two meshes (:data:`MESH_AXES`, built by :func:`make_mesh`): the trainer's
``(data, fsdp, expert)`` and the engine's ``(data, tensor, expert)``. :data:`RULES` maps each logical
axis to the mesh axes it may be split over, per role; :func:`resolve` turns the logical axes and the
shape of an array into its partition spec:

- ``experts`` claims its mesh axes first (the expert-parallel layout), then the other dims, largest
  first (so the trainer's ``fsdp`` goes to the largest dim it divides); each mesh axis splits at most
  one dim of an array;
- a dim takes the longest prefix of its mesh axes (those of size > 1) whose product divides it; on
  ``tensor`` in whole heads (``units``: a head's q/k/v/o columns stay on one device);
- a mesh axis that a dim asked for and no dim took leaves the array replicated over it: its memory on
  each device is multiplied by the axis size. :func:`spec` raises :class:`ReplicationError` naming the
  array, its dim, the axis and that multiplier, unless the caller opted in
  (``allow_replication=True``: one warning per placement, naming the multiplier). Norm scales
  (``"norm"``, a few KiB per layer) may stay whole without a word.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Mapping, NamedTuple, Sequence

import jax
from jax.sharding import AxisType, Mesh

from models.fields import FieldError, is_int
from models.stacking import is_stacked, path_names

ROLES = ("train", "serve")
MESH_AXES = {"train": ("data", "fsdp", "expert"), "serve": ("data", "tensor", "expert")}
# The trainer splits the batch over every axis: outside the MoE layers ``expert`` acts as one more data
# axis (as in MaxText), inside them the expert-parallel layer exchanges tokens over fsdp x expert.
BATCH_AXES = ("data", "fsdp", "expert")

#: logical axis -> (train mesh axes, serve mesh axes). A tuple of several axes splits the dim over
#: their product (experts over expert x fsdp), or over the longest prefix of them that divides it.
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "batch": (BATCH_AXES, ("data",)),          # sequences [B, ...] (the engine's rows, once data splits them)
    # the rows of a cache without a head axis (MLA's latent): DP attention, every data-like serving axis
    "attn_batch": (BATCH_AXES, ("data", "tensor")),
    "layers": ((), ()),                        # the leading axis of stacked layers (the scan slices it)
    "vocab": (("fsdp",), ("tensor",)),         # embedding rows, LM head columns
    "embed": (("fsdp",), ()),                  # the hidden size D
    "heads": (("fsdp",), ("tensor",)),         # H * head_dim (q, o; MLA's up-projections)
    "kv_heads": (("fsdp",), ("tensor",)),      # Hkv * head_dim (k, v), and the KV cache's Hkv
    "mlp": (("fsdp",), ("tensor",)),           # a dense MLP's hidden size
    "q_lora": (("fsdp",), ()),                 # MLA's low ranks
    "kv_lora": (("fsdp",), ()),
    "expert_logits": (("fsdp",), ()),          # the router's output, one logit per expert
    "experts": (("expert", "fsdp"), ("expert",)),
    "expert_embed": ((), ()),                  # D of an expert weight: whole, tokens come to it
    "expert_mlp": (("fsdp",), ("tensor",)),    # I of an expert weight
    "norm": (("fsdp",), ()),                   # norm scales
}
EXPERT_IN = ("experts", "expert_embed", "expert_mlp")  # gate/up [E, D, I]
EXPERT_OUT = ("experts", "expert_mlp", "expert_embed")  # down [E, I, D]
CLAIM_FIRST = ("experts",)  # these dims take their mesh axes before any other dim
WHOLE_HEADS = ("tensor",)  # mesh axes that split a heads dim only at head boundaries
MAY_STAY_WHOLE = ("norm",)  # dims a mesh axis may leave unsplit without it counting as replication


class ReplicationError(FieldError):
    """A mesh axis would leave an array replicated (``field``: the array, ``value``: its shape)."""


class Layout(NamedTuple):
    """spec: one entry per dim (None, a mesh axis or a tuple of them); unsplit: ``(axis, dims)`` for
    each mesh axis (size > 1) that ``dims`` asked for and none of them took."""

    spec: tuple
    unsplit: tuple[tuple[str, tuple[int, ...]], ...]


def rules(role: str) -> dict[str, tuple[str, ...]]:
    """:data:`RULES` for one role: logical axis -> mesh axes."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: expected one of {ROLES}")
    i = ROLES.index(role)
    return {name: axes[i] for name, axes in RULES.items()}


def head_units(cfg) -> dict[str, int]:
    """The head counts ``units`` of :func:`resolve` for a MoeConfig."""
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}


def resolve(axes: Sequence[str | None], shape: Sequence[int], sizes: Mapping[str, int], role: str,
            units: Mapping[str, int] | None = None) -> Layout:
    """The :class:`Layout` of an array of ``shape`` whose dims have logical ``axes`` (None: never
    split) on a mesh of axis ``sizes`` (absent axes count as 1). units: whole-head counts per logical
    axis (:func:`head_units`) that :data:`WHOLE_HEADS` mesh axes must divide too."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} for shape {tuple(shape)}: expected one per dim")
    table, units = rules(role), units or {}
    unknown = [a for a in axes if a is not None and a not in table]
    if unknown:
        raise ValueError(f"logical axes {unknown}: expected names of models.axes.RULES {tuple(RULES)}")
    want = [tuple(m for m in table[a] if sizes.get(m, 1) > 1) if a is not None else () for a in axes]
    order = sorted(range(len(shape)), key=lambda d: (axes[d] not in CLAIM_FIRST, -shape[d], d))
    spec, used = [None] * len(shape), set()
    for d in order:
        free = [m for m in want[d] if m not in used]
        for k in range(len(free), 0, -1):
            split = free[:k]
            n = math.prod(sizes[m] for m in split)
            whole = units.get(axes[d]) if any(m in WHOLE_HEADS for m in split) else None
            if shape[d] % n == 0 and (whole is None or whole % n == 0):
                spec[d] = split[0] if k == 1 else tuple(split)
                used.update(split)
                break
    unsplit: dict[str, tuple[int, ...]] = {}
    for d, ms in enumerate(want):
        for m in ms:
            if m not in used and axes[d] not in MAY_STAY_WHOLE:
                unsplit[m] = unsplit.get(m, ()) + (d,)
    return Layout(tuple(spec), tuple(unsplit.items()))


def check_layout(what: str, axes, shape, sizes: Mapping[str, int], layout: Layout, *,
                 allow_replication: bool = False, units: Mapping[str, int] | None = None,
                 notes: list | None = None) -> tuple:
    """``layout.spec``, or :class:`ReplicationError` when a mesh axis leaves the array replicated.
    With ``allow_replication`` the message goes to ``notes`` (for one warning per placement:
    :func:`warn_replication`), or is warned at once when notes is None."""
    if not layout.unsplit:
        return layout.spec
    mult = math.prod(sizes[m] for m, _ in layout.unsplit)
    parts = []
    for m, dims in layout.unsplit:
        of = []
        for d in dims:
            unit = (units or {}).get(axes[d]) if m in WHOLE_HEADS else None
            of.append(f"dim {d} ({axes[d]}) = {shape[d]}" + (f" ({unit} heads)" if unit is not None else ""))
        parts.append(f"{m}={sizes[m]} divides none of {', '.join(of)}")
    msg = (f"{what} {list(shape)} with logical axes {tuple(axes)}: {'; '.join(parts)}, so it would be "
           f"replicated {mult}x ({mult} times its memory on each device)")
    if not allow_replication:
        raise ReplicationError(what, tuple(shape), "mesh axes that divide the dims they split",
                               f"{msg}: expected mesh axis sizes that divide those dims (or "
                               "allow_replication=True to accept the replication)")
    if notes is None:
        warn_replication([msg])
    else:
        notes.append(msg)
    return layout.spec


def warn_replication(notes: Sequence[str], stacklevel: int = 3) -> None:
    """One warning for the arrays a placement replicated by the caller's choice (nothing if none)."""
    if notes:
        more = f" (and {len(notes) - 1} more arrays)" if len(notes) > 1 else ""
        warnings.warn(f"allow_replication=True: {notes[0]}{more}", stacklevel=stacklevel)


def spec(axes, shape, sizes: Mapping[str, int], role: str, *, what: str, units=None,
         allow_replication: bool = False, notes: list | None = None) -> tuple:
    """The partition spec entries of one array (:func:`resolve`, then :func:`check_layout`)."""
    layout = resolve(axes, shape, sizes, role, units)
    return check_layout(what, axes, shape, sizes, layout, allow_replication=allow_replication, units=units,
                        notes=notes)


# ---- the parameters' declared axes ----------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def declared_axes() -> dict[tuple[str, int], tuple]:
    """``(parameter name, ndim of one layer's array) -> logical axes``, read from the declarations of
    abstract models that build every kind of parameter (GQA with biases, MLA with and without the
    low-rank query, dense, MoE and shared-expert MLPs, router, untied LM head)."""
    from flax import nnx

    from models.config import MoeConfig
    from models.transformer import MoeTransformer

    base = dict(num_layers=2, scan_layers=False, tie_embeddings=False, num_shared_experts=1)
    cfgs = [MoeConfig.tiny(attention_bias=True, **base),
            MoeConfig.tiny(attention="mla", num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=16,
                           kv_lora_rank=8, v_head_dim=8, **base),
            MoeConfig.tiny(attention="mla", num_kv_heads=4, head_dim=12, qk_rope_head_dim=4, q_lora_rank=0,
                           kv_lora_rank=8, v_head_dim=8, **base)]
    out: dict[tuple[str, int], tuple] = {}
    for cfg in cfgs:
        model = nnx.eval_shape(lambda cfg=cfg: MoeTransformer(cfg, rngs=nnx.Rngs(0)))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            axes = var.get_metadata().get("logical_axes")
            key = (path_names(path)[-1], len(var.shape))
            if out.setdefault(key, axes) != axes:
                raise ValueError(f"parameter {key[0]!r} (ndim {key[1]}) is declared with logical axes {out[key]} "
                                 f"and {axes}: expected one declaration per name and rank")
    return out


def param_axes(path, leaf) -> tuple:
    """The logical axes of a parameter-tree leaf at ``path``: an ``nnx.Variable``'s ``logical_axes``
    metadata, else the declaration of a parameter of that name; a leading ``"layers"`` axis for
    stacked layers (models/stacking.py)."""
    names = path_names(path)
    lead = ("layers",) if is_stacked(path) else ()
    meta = getattr(leaf, "get_metadata", None)
    axes = meta().get("logical_axes") if meta is not None else None
    ndim = len(getattr(leaf, "shape", ()))
    if axes is None:
        axes = declared_axes().get((names[-1] if names else "", ndim - len(lead)))
        if axes is None:
            raise ValueError(f"parameter {'/'.join(names)} shape={tuple(leaf.shape)}: no logical axes declared "
                             "for that name and rank: expected nnx.Param(..., logical_axes=(...)) where it is built")
    axes = lead + tuple(axes)
    if len(axes) != ndim:
        raise ValueError(f"parameter {'/'.join(names)} shape={tuple(leaf.shape)}: logical axes {axes}: "
                         "expected one per dim")
    return axes


def leaf_name(path) -> str:
    """``"moe_layers/mlp/gate_proj"``: how errors name a parameter."""
    return "/".join(path_names(path))


# ---- meshes ---------------------------------------------------------------------------------------
def make_mesh(role: str, sizes: Mapping[str, int], devices: Sequence[Any] | None = None, *,
              axis_type: AxisType = AxisType.Auto) -> Mesh:
    """The ``role``'s mesh (axes :data:`MESH_AXES`) with ``sizes`` per axis over ``devices`` (default:
    all). One size may be -1: it takes the devices left over. The sizes must multiply to the device
    count."""
    if role not in MESH_AXES:
        raise ValueError(f"role={role!r}: expected one of {ROLES}")
    names = MESH_AXES[role]
    devices = list(jax.devices() if devices is None else devices)
    sizes = {name: sizes[name] for name in names}
    for name, v in sizes.items():
        if not is_int(v) or (v < 1 and v != -1):
            raise ValueError(f"{name}={v!r}: expected an int >= 1, or -1 for the remaining devices")
    free = [name for name, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"{' and '.join(free)} are both -1: expected at most one axis of size -1")
    known = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"{free[0]}=-1: {len(devices)} devices are not divisible by the other "
                             f"axes' product {known}")
        sizes[free[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"mesh ({shown}) has {math.prod(sizes.values())} slots: expected {len(devices)} "
                         f"(the device count)")
    return jax.make_mesh(tuple(sizes.values()), names, axis_types=(axis_type,) * len(names), devices=devices)


def mesh_sizes(mesh) -> dict[str, int]:
    """``{axis: size}`` of a Mesh or AbstractMesh."""
    return {a: int(n) for a, n in dict(mesh.shape).items()}
