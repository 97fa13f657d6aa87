"""Route wire forms: round trips, every rejection, SGLang's int32 base64, binary framing."""

import base64
import json
import re
import struct

import numpy as np
import pytest

from r3jax import routes as R


def _routes(rows, num_layers=3, top_k=2, num_experts=8, dtype=np.uint8, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((rows, num_layers, num_experts)), axis=-1)[..., :top_k]  # distinct ids
    return ids.astype(dtype)


@pytest.mark.parametrize("num_experts,dtype", [(8, "uint8"), (256, "uint8"), (257, "int16"),
                                               (32768, "int16"), (32769, "int32")])
def test_route_dtype_and_compact(num_experts, dtype):
    assert R.route_dtype(num_experts) == np.dtype(dtype)
    ids = np.array([[[0, num_experts - 1]]], np.int64)
    out = R.compact(ids, num_experts)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, ids)


def test_compact_rejects_out_of_range_and_non_integers():
    with pytest.raises(ValueError, match=r"expert id 8: expected ids in \[0, num_experts=8\)"):
        R.compact(np.array([[[0, 8]]]), 8)
    with pytest.raises(ValueError, match="expert id -1: expected ids >= 0"):
        R.compact(np.array([[[-1, 0]]]), 8)
    with pytest.raises(ValueError, match="dtype=float32: expected an integer dtype"):
        R.compact(np.zeros((1, 1, 2), np.float32), 8)
    with pytest.raises(ValueError, match="dtype=bool"):
        R.compact(np.zeros((1, 1, 2), bool), 8)


@pytest.mark.parametrize("dtype", R.WIRE_DTYPES)
@pytest.mark.parametrize("rows", [0, 5])
def test_json_and_binary_round_trip(dtype, rows):
    routes = _routes(rows, dtype=dtype)
    payload = json.loads(json.dumps(R.encode(routes, 4, [1, 2, 3])))
    assert payload["shape"] == [rows, 3, 2] and payload["dtype"] == dtype
    assert payload["start"] == 4 and payload["layers"] == [1, 2, 3]
    out = R.decode(payload)
    assert out.dtype == np.dtype(dtype) and out.shape == (rows, 3, 2)
    np.testing.assert_array_equal(out, routes)
    out, start, layers = R.decode_payload(json.dumps(payload), num_experts=8)
    assert out.dtype == np.uint8 and (start, layers) == (4, [1, 2, 3])
    np.testing.assert_array_equal(out, routes)

    blob = R.encode_binary(routes, 4, [1, 2, 3])
    assert len(blob) - routes.nbytes <= 64  # small header, then exactly the raw bytes
    assert blob.endswith(routes.astype(routes.dtype.newbyteorder("<")).tobytes())
    out, start, layers = R.decode_binary(blob)
    assert out.dtype == np.dtype(dtype) and (start, layers) == (4, [1, 2, 3])
    np.testing.assert_array_equal(out, routes)


def test_decode_with_num_experts_compacts_and_checks_range():
    routes = _routes(4, num_experts=300, dtype=np.int32)
    out = R.decode(R.encode(routes, 0, [0, 1, 2]), num_experts=300)
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out, routes)
    with pytest.raises(ValueError, match=r"expert id 2\d\d: expected ids in \[0, num_experts=200\)"):
        R.decode(R.encode(routes, 0, [0, 1, 2]), num_experts=200)


def _good():
    return R.encode(_routes(2), 0, [1, 2, 3])


@pytest.mark.parametrize("mutate,message", [
    (lambda p: p.update(data=base64.b64encode(b"\0" * 11).decode()),
     "routed_experts.data has 11 bytes: expected 12"),
    (lambda p: p.update(dtype="float32"), "routed_experts.dtype='float32': expected one of"),
    (lambda p: p.update(dtype="bool"), "routed_experts.dtype='bool': expected one of"),
    (lambda p: p.update(shape=[2, 6]), r"routed_experts.shape=\[2, 6\]: expected 3 dims"),
    (lambda p: p.update(shape=[2, 3, 2, 1]), "expected 3 dims"),
    (lambda p: p.update(shape=[-2, 3, 2]), r"routed_experts.shape\[0\]=-2: expected an int >= 0"),
    (lambda p: p.update(shape=[True, 3, 2]),
     r"routed_experts.shape\[0\]=True: expected an int \(not a bool\)"),
    (lambda p: p.update(shape=[2.0, 3, 2]), r"routed_experts.shape\[0\]=2.0: expected an int"),
    (lambda p: p.update(data="@@not base64@@"), "routed_experts.data: not valid base64"),
    (lambda p: p.update(data=[[1, 2]]), "nested JSON lists; send the packed form"),
    (lambda p: p.pop("dtype"), r"missing field\(s\) \['dtype'\]"),
    (lambda p: p.update(data=12), "routed_experts.data: got int, expected a base64 string"),
])
def test_decode_rejections(mutate, message):
    payload = _good()
    mutate(payload)
    with pytest.raises(ValueError, match=message):
        R.decode(payload)


def test_decode_rejects_lists_negative_ids_and_bad_meta():
    with pytest.raises(ValueError, match="nested JSON lists; send the packed form"):
        R.decode([[[0, 1]]])
    with pytest.raises(ValueError, match="got int, expected a dict"):
        R.decode(3)
    with pytest.raises(ValueError, match="not valid JSON"):
        R.decode("{oops")
    neg = {"data": base64.b64encode(np.array([0, -3], "<i2").tobytes()).decode(), "shape": [1, 1, 2],
           "dtype": "int16"}
    with pytest.raises(ValueError, match="expert id -3: expected ids >= 0"):
        R.decode(neg)
    with pytest.raises(ValueError, match="missing field 'start'"):
        R.decode_payload({k: v for k, v in _good().items() if k != "start"})
    with pytest.raises(ValueError, match=r"routed_experts.start=True: expected an int \(not a bool\)"):
        R.decode_payload({**_good(), "start": True})
    with pytest.raises(ValueError, match=r"routed_experts.layers has 2 ids \[1, 2\]: expected L = 3"):
        R.decode_payload({**_good(), "layers": [1, 2]})


def test_encode_rejections():
    good = _routes(2)
    with pytest.raises(ValueError, match=r"start=True: expected an int \(not a bool\)"):
        R.encode(good, True, [1, 2, 3])
    with pytest.raises(ValueError, match="start=-1: expected an int >= 0"):
        R.encode(good, -1, [1, 2, 3])
    with pytest.raises(ValueError, match=r"layers has 2 ids \[1, 2\]: expected L = 3"):
        R.encode(good, 0, [1, 2])
    with pytest.raises(ValueError, match=r"routes shape=\(2, 6\): expected 3 dims"):
        R.encode(good.reshape(2, 6), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="routes dtype=bool"):
        R.encode(good.astype(bool), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="routes dtype=float64"):
        R.encode(good.astype(float), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="routes: got list"):
        R.encode(good.tolist(), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="expert id -1"):
        R.encode_binary(np.full((2, 3, 2), -1, np.int8), 0, [1, 2, 3])


def test_decode_sglang():
    routes = _routes(5, num_layers=4, top_k=2, num_experts=128, dtype=np.int32)
    b64 = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    out = R.decode_sglang(b64, num_layers=4, top_k=2)
    assert out.dtype == np.int32 and out.shape == (5, 4, 2)
    np.testing.assert_array_equal(out, routes)
    assert R.decode_sglang("", 4, 2).shape == (0, 4, 2)
    with pytest.raises(ValueError, match=re.escape("has 40 bytes: expected a multiple of 4 x num_layers 3 "
                                                   "x top_k 2 = 24")):
        R.decode_sglang(base64.b64encode(b"\0" * 40).decode(), 3, 2)
    with pytest.raises(ValueError, match="not valid base64"):
        R.decode_sglang("%%%", 4, 2)
    with pytest.raises(ValueError, match="expert id -1"):
        R.decode_sglang(base64.b64encode(np.full(8, -1, "<i4").tobytes()), 4, 2)


def test_decode_binary_rejections():
    blob = R.encode_binary(_routes(2), 7, [1, 2, 3])
    head = R._FIXED.size
    with pytest.raises(ValueError, match="routed_experts magic=b'XXXX': expected b'R3RT'"):
        R.decode_binary(b"XXXX" + blob[4:])
    with pytest.raises(ValueError, match="routed_experts version=9: expected 1"):
        R.decode_binary(blob[:4] + bytes([9]) + blob[5:])
    with pytest.raises(ValueError, match="routed_experts dtype code=99"):
        R.decode_binary(blob[:5] + bytes([99]) + blob[6:])
    with pytest.raises(ValueError, match="routed_experts payload has 11 bytes: expected 12"):
        R.decode_binary(blob[:-1])
    with pytest.raises(ValueError, match="routed_experts payload has 13 bytes: expected 12"):
        R.decode_binary(blob + b"\0")
    with pytest.raises(ValueError, match=f"has 10 bytes: expected at least the {head}-byte header"):
        R.decode_binary(blob[:10])
    with pytest.raises(ValueError, match=r"expert id \d: expected ids in \[0, num_experts=2\)"):
        R.decode_binary(blob, num_experts=2)
    with pytest.raises(ValueError, match="got str, expected bytes"):
        R.decode_binary("abc")
    bad_start = bytearray(blob)
    struct.pack_into("<q", bad_start, 24, -5)  # start follows magic..K
    with pytest.raises(ValueError, match="routed_experts start=-5: expected an int >= 0"):
        R.decode_binary(bytes(bad_start))
