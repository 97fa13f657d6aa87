"""Route arrays: compact dtypes and the wire forms (JSON+base64, SGLang base64 int32, binary framing).

A route payload is ``routes [rows, L, K]`` (expert ids of rows ``start .. start + rows - 1`` of one
trajectory), the ``start`` row and the global ``layers`` ids of the L MoE layers (docs/design.md §3).
Every decoder is strict: it checks the byte count, the dtype, 3 dims and the ids with
:func:`r3jax.checks.check_route_ids` (integer, not bool or float; >= 0 and < E when E is known;
distinct within each (token, layer)), and raises :class:`r3jax.checks.FieldError` (a ValueError)
naming the field, the value and the expectation. All bytes are little-endian, C order.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from typing import Any, Sequence

import numpy as np

from r3jax import checks
from r3jax.checks import FieldError

# Integer dtypes a sender may use on the wire; bool is excluded on purpose (True/False are not ids).
WIRE_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "uint64")

# Binary framing (version 1). Fixed part, then ``num_layers`` int32 layer ids, zero padding up to
# ``header_len`` (a multiple of 8, so the payload is aligned for any dtype), then the raw routes.
BINARY_MAGIC = b"R3RT"
BINARY_VERSION = 1
_FIXED = struct.Struct("<4sBBHQIIqI")  # magic, version, dtype code, header_len, rows, L, K, start, n_layers
_CODES = {name: i + 1 for i, name in enumerate(WIRE_DTYPES)}
_NAMES = {code: name for name, code in _CODES.items()}


def route_dtype(num_experts: int) -> np.dtype:
    """Smallest dtype holding ids in [0, E): uint8 if E <= 256, int16 if E <= 32768, else int32."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def uncaptured_rows(rows: int, num_layers: int, top_k: int, dtype) -> np.ndarray:
    """``[rows, L, K]`` read-only, every row ``0..K-1``: the contents of rows that are not replayed
    (padding, the terminal gap, uncaptured rows; DESIGN §3). Valid, distinct ids for sort/bincount."""
    return np.broadcast_to(np.arange(top_k, dtype=dtype), (rows, num_layers, top_k))


# The int rule lives in r3jax.checks; re-exported here for existing callers.
check_int = checks.check_int


def compact(routes: Any, num_experts: int) -> np.ndarray:
    """Validated copy of ``routes`` (``[..., L, K]`` valid expert ids, see
    :func:`r3jax.checks.check_route_ids`) in ``route_dtype(E)``."""
    check_int("num_experts", num_experts, 1)
    arr = np.asarray(routes)
    checks.check_route_ids(arr, num_experts)
    return arr.astype(route_dtype(num_experts))


def _check_routes(routes: Any, name: str = "routes") -> np.ndarray:
    if not isinstance(routes, np.ndarray) and not hasattr(routes, "__array__"):
        raise FieldError(name, type(routes).__name__, "an integer array [rows, L, K]",
                         f"{name}: got {type(routes).__name__}, expected an integer array [rows, L, K]")
    arr = np.asarray(routes)
    if arr.ndim != 3:
        raise FieldError(f"{name}.shape", arr.shape, "3 dims [rows, L, K]",
                         f"{name} shape={arr.shape}: expected 3 dims [rows, L, K]")
    checks.check_route_ids(arr, None, name)
    if arr.dtype.name not in WIRE_DTYPES:
        raise FieldError(f"{name}.dtype", arr.dtype.name, f"one of {WIRE_DTYPES}")
    return arr


def _check_layers(layers: Any, num_layers: int, name: str = "layers") -> list[int]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, np.ndarray)):
        raise FieldError(name, layers, f"a list of {num_layers} MoE layer ids",
                         f"{name}={layers!r}: expected a list of {num_layers} MoE layer ids")
    out = [check_int(f"{name}[{i}]", v) for i, v in enumerate(layers)]
    if len(out) != num_layers:
        raise FieldError(name, out, f"L = {num_layers} ids",
                         f"{name} has {len(out)} ids {out}: expected L = {num_layers} (routes.shape[1])")
    return out


def encode(routes: Any, start: int, layers: Sequence[int]) -> dict:
    """JSON wire form ``{"data", "shape", "dtype", "start", "layers"}`` of ``routes [rows, L, K]``.

    ``data`` is base64 of the little-endian C-order bytes in the array's own dtype (pass a
    :func:`compact` array to ship 1 or 2 bytes per id).
    """
    arr = _check_routes(routes)
    start = check_int("start", start)
    layer_ids = _check_layers(layers, arr.shape[1])
    raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    return {"data": base64.b64encode(raw).decode("ascii"), "shape": list(arr.shape),
            "dtype": arr.dtype.name, "start": start, "layers": layer_ids}


def _from_bytes(raw: bytes, dtype_name: str, shape: tuple[int, ...], num_experts, field: str) -> np.ndarray:
    dtype = np.dtype(dtype_name).newbyteorder("<")
    want = math.prod(shape) * dtype.itemsize
    if len(raw) != want:
        raise FieldError(field, len(raw), f"{want} bytes",
                         f"{field} has {len(raw)} bytes: expected {want} = prod(shape {list(shape)}) "
                         f"x {dtype.itemsize} ({dtype_name})")
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)  # read-only view; checked before the copy
    checks.check_route_ids(arr, num_experts, "routed_experts")
    return arr.astype(dtype.newbyteorder("=") if num_experts is None else route_dtype(num_experts))


def decode(obj: Any, num_experts: int | None = None) -> np.ndarray:
    """Strict inverse of :func:`encode` (also reads SkyRL's ``{data, shape, dtype}``).

    ``obj``: the dict (or its JSON text). Returns ``routes [rows, L, K]``: in the wire dtype when
    ``num_experts`` is None, else validated ids < E in ``route_dtype(E)``. ``start``/``layers`` are
    not needed here; :func:`decode_payload` validates and returns them too.
    """
    if isinstance(obj, (str, bytes)):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            raise FieldError("routed_experts", None, "JSON",
                             f"routed_experts: not valid JSON ({e.msg})") from None
    if isinstance(obj, list) or (isinstance(obj, dict) and isinstance(obj.get("data"), list)):
        raise FieldError("routed_experts", "nested lists", "the packed form",
                         "routed_experts: got nested JSON lists; send the packed form "
                         '{"data": base64 of the C-order bytes, "shape": [rows, L, K], "dtype": "uint8"}')
    if not isinstance(obj, dict):
        raise FieldError("routed_experts", type(obj).__name__, "a dict",
                         f"routed_experts: got {type(obj).__name__}, expected a dict with data/shape/dtype")
    missing = [k for k in ("data", "shape", "dtype") if k not in obj]
    if missing:
        raise FieldError(f"routed_experts.{missing[0]}", None, "a required field",
                         f"routed_experts: missing field(s) {missing}; expected data, shape, dtype")
    data, shape, dtype = obj["data"], obj["shape"], obj["dtype"]
    if not isinstance(data, str):
        raise FieldError("routed_experts.data", type(data).__name__, "a base64 string",
                         f"routed_experts.data: got {type(data).__name__}, expected a base64 string")
    if not isinstance(shape, (list, tuple)) or len(shape) != 3:
        raise FieldError("routed_experts.shape", shape, "3 dims",
                         f"routed_experts.shape={shape!r}: expected 3 dims [rows, L, K]")
    dims = tuple(check_int(f"routed_experts.shape[{i}]", v) for i, v in enumerate(shape))
    if dtype not in WIRE_DTYPES:
        raise FieldError("routed_experts.dtype", dtype, f"one of {WIRE_DTYPES}",
                         f"routed_experts.dtype={dtype!r}: expected one of {WIRE_DTYPES}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError("routed_experts.data", None, "base64",
                         "routed_experts.data: not valid base64") from None
    return _from_bytes(raw, dtype, dims, num_experts, "routed_experts.data")


def decode_payload(obj: Any, num_experts: int | None = None) -> tuple[np.ndarray, int, list[int]]:
    """:func:`decode` plus the validated ``start`` (int >= 0) and ``layers`` (L ints) fields."""
    routes = decode(obj, num_experts)
    obj = json.loads(obj) if isinstance(obj, (str, bytes)) else obj
    for key in ("start", "layers"):
        if key not in obj:
            raise FieldError(f"routed_experts.{key}", None, "a required field",
                             f"routed_experts: missing field {key!r}")
    start = check_int("routed_experts.start", obj["start"])
    return routes, start, _check_layers(obj["layers"], routes.shape[1], "routed_experts.layers")


def decode_sglang(b64_int32: str | bytes, num_layers: int, top_k: int,
                  num_experts: int | None = None) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]``: base64 of int32 ids ``[seq_len - 1, L, K]``.

    SGLang sends no shape, so L and K come from the caller. Returns int32 ``[rows, L, K]``, or with
    ``num_experts`` ids checked < E in ``route_dtype(E)``.
    """
    num_layers, top_k = check_int("num_layers", num_layers, 1), check_int("top_k", top_k, 1)
    if not isinstance(b64_int32, (str, bytes)):
        raise FieldError("routed_experts", type(b64_int32).__name__, "a base64 string",
                         f"routed_experts: got {type(b64_int32).__name__}, expected a base64 string")
    try:
        raw = base64.b64decode(b64_int32, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError("routed_experts", None, "base64", "routed_experts: not valid base64") from None
    row = 4 * num_layers * top_k
    if len(raw) % row:
        raise FieldError("routed_experts", len(raw), f"a multiple of {row} bytes",
                         f"routed_experts has {len(raw)} bytes: expected a multiple of "
                         f"4 x num_layers {num_layers} x top_k {top_k} = {row} (int32 rows)")
    return _from_bytes(raw, "int32", (len(raw) // row, num_layers, top_k), num_experts, "routed_experts")


def encode_binary(routes: Any, start: int, layers: Sequence[int]) -> bytes:
    """Binary framing: a small header, then the raw little-endian C-order bytes of ``routes``.

    Header (version 1, little-endian): ``b"R3RT"``, u8 version, u8 dtype code, u16 header_len,
    u64 rows, u32 L, u32 K, i64 start, u32 n_layers, n_layers x i32 layer ids, zero pad to
    header_len (a multiple of 8). Payload length is exactly ``rows * L * K * itemsize``.
    """
    arr = _check_routes(routes)
    start = check_int("start", start)
    layer_ids = _check_layers(layers, arr.shape[1])
    head_len = _FIXED.size + 4 * len(layer_ids)
    head_len += -head_len % 8
    rows, num_layers, top_k = arr.shape
    head = _FIXED.pack(BINARY_MAGIC, BINARY_VERSION, _CODES[arr.dtype.name], head_len, rows,
                       num_layers, top_k, start, len(layer_ids))
    head += np.asarray(layer_ids, dtype="<i4").tobytes()
    head += b"\0" * (head_len - len(head))
    return head + np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def decode_binary(data: bytes, num_experts: int | None = None) -> tuple[np.ndarray, int, list[int]]:
    """Strict inverse of :func:`encode_binary`: ``(routes [rows, L, K], start, layers)``.

    With ``num_experts`` the ids are checked < E and returned in ``route_dtype(E)``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FieldError("routed_experts", type(data).__name__, "bytes",
                         f"routed_experts: got {type(data).__name__}, expected bytes")
    data = bytes(data)
    if len(data) < _FIXED.size:
        raise FieldError("routed_experts", len(data), "a header",
                         f"routed_experts has {len(data)} bytes: expected at least the "
                         f"{_FIXED.size}-byte header")
    magic, version, code, head_len, rows, num_layers, top_k, start, n_layers = _FIXED.unpack_from(data)
    if magic != BINARY_MAGIC:
        raise FieldError("routed_experts.magic", magic, repr(BINARY_MAGIC),
                         f"routed_experts magic={magic!r}: expected {BINARY_MAGIC!r}")
    if version != BINARY_VERSION:
        raise FieldError("routed_experts.version", version, str(BINARY_VERSION),
                         f"routed_experts version={version}: expected {BINARY_VERSION}")
    if code not in _NAMES:
        raise FieldError("routed_experts.dtype", code, "a wire dtype code",
                         f"routed_experts dtype code={code}: expected one of {sorted(_NAMES)} "
                         f"({', '.join(WIRE_DTYPES)})")
    if start < 0:
        raise FieldError("routed_experts.start", start, "an int >= 0",
                         f"routed_experts start={start}: expected an int >= 0")
    if n_layers != num_layers:
        raise FieldError("routed_experts.layers", n_layers, f"L = {num_layers} ids",
                         f"routed_experts has {n_layers} layer ids: expected L = {num_layers}")
    if head_len < _FIXED.size + 4 * n_layers or head_len % 8 or head_len > len(data):
        raise FieldError("routed_experts.header_len", head_len, "a multiple of 8",
                         f"routed_experts header_len={head_len}: expected a multiple of 8 in "
                         f"[{_FIXED.size + 4 * n_layers}, {len(data)}]")
    layers = np.frombuffer(data, "<i4", n_layers, _FIXED.size).tolist()
    if any(v < 0 for v in layers):
        raise FieldError("routed_experts.layers", layers, "ids >= 0",
                         f"routed_experts layers={layers}: expected ids >= 0")
    routes = _from_bytes(data[head_len:], _NAMES[code], (rows, num_layers, top_k), num_experts,
                         "routed_experts payload")
    return routes, int(start), layers
