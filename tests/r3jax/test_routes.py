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
    with pytest.raises(ValueError, match=r"expert id 8 at slot 1: expected ids >= 0 and < num_experts=8"):
        R.compact(np.array([[[0, 8]]]), 8)
    with pytest.raises(ValueError, match="expert id -1 at slot 0: expected ids >= 0"):
        R.compact(np.array([[[-1, 0]]]), 8)
    with pytest.raises(ValueError, match="expert id 3 repeated"):
        R.compact(np.array([[[3, 3]]]), 8)
    with pytest.raises(ValueError, match="dtype='float32': expected an integer dtype"):
        R.compact(np.zeros((1, 1, 2), np.float32), 8)
    with pytest.raises(ValueError, match="dtype='bool'"):
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
    with pytest.raises(ValueError, match=r"expert id 2\d\d at slot \d: expected ids >= 0 and < num_experts=200"):
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
     r"routed_experts.shape\[0\]=True: expected an int >= 0"),
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
    with pytest.raises(ValueError, match=r"routed_experts \(token 0, layer 0\): expert id -3 at slot 1: "
                                         "expected ids >= 0"):
        R.decode(neg)
    with pytest.raises(ValueError, match="missing field 'start'"):
        R.decode_payload({k: v for k, v in _good().items() if k != "start"})
    with pytest.raises(ValueError, match="routed_experts.start=True: expected an int >= 0"):
        R.decode_payload({**_good(), "start": True})
    with pytest.raises(ValueError, match=r"routed_experts.layers has 2 ids \[1, 2\]: expected L = 3"):
        R.decode_payload({**_good(), "layers": [1, 2]})


def test_encode_rejections():
    good = _routes(2)
    with pytest.raises(ValueError, match="start=True: expected an int >= 0"):
        R.encode(good, True, [1, 2, 3])
    with pytest.raises(ValueError, match="start=-1: expected an int >= 0"):
        R.encode(good, -1, [1, 2, 3])
    with pytest.raises(ValueError, match=r"layers has 2 ids \[1, 2\]: expected L = 3"):
        R.encode(good, 0, [1, 2])
    with pytest.raises(ValueError, match=r"routes shape=\(2, 6\): expected 3 dims"):
        R.encode(good.reshape(2, 6), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="routes.dtype='bool'"):
        R.encode(good.astype(bool), 0, [1, 2, 3])
    with pytest.raises(ValueError, match="routes.dtype='float64'"):
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
    with pytest.raises(ValueError, match=r"expert id \d at slot \d: expected ids >= 0 and < num_experts=2"):
        R.decode_binary(blob, num_experts=2)
    with pytest.raises(ValueError, match="got str, expected bytes"):
        R.decode_binary("abc")
    bad_start = bytearray(blob)
    struct.pack_into("<q", bad_start, 24, -5)  # start follows magic..K
    with pytest.raises(ValueError, match="routed_experts start=-5: expected an int >= 0"):
        R.decode_binary(bytes(bad_start))


# ---- every decoder refuses what replay cannot use: [3, 3], id == E, bool and float ids -----------

def _bad_rows(kind):
    """3 rows [3, L=2, K=2] of valid ids, with token 1, layer 1 made bad."""
    rows = np.array([[[0, 1], [2, 3]]] * 3, np.int32)
    if kind == "repeat":
        rows[1, 1] = [3, 3]
    elif kind == "E":
        rows[1, 1] = [1, 8]
    return rows


def _frames(rows):
    """The same rows in every wire form: (name, decode with E = 8)."""
    layers = [1, 2]
    wire = {"data": base64.b64encode(rows.astype("<i4").tobytes()).decode(), "shape": list(rows.shape),
            "dtype": "int32", "start": 0, "layers": layers}
    head = R._FIXED.pack(R.BINARY_MAGIC, R.BINARY_VERSION, R._CODES["int32"], 48, rows.shape[0], 2, 2, 0, 2)
    blob = head + np.asarray(layers, "<i4").tobytes() + b"\0" * (48 - R._FIXED.size - 8) + rows.astype("<i4").tobytes()
    skyrl = {k: wire[k] for k in ("data", "shape", "dtype")}
    return [("json", lambda e: R.decode(json.dumps(wire), e)),
            ("payload", lambda e: R.decode_payload(wire, e)),
            ("skyrl", lambda e: R.decode(skyrl, e)),
            ("binary", lambda e: R.decode_binary(blob, e)),
            ("sglang", lambda e: R.decode_sglang(wire["data"], 2, 2, num_experts=e))]


@pytest.mark.parametrize("form", ["json", "payload", "skyrl", "binary", "sglang"])
def test_every_decoder_refuses_repeated_and_out_of_range_ids(form):
    decode = dict(_frames(_bad_rows("repeat")))[form]
    for e in (8, None):  # a decoder that does not know E still checks distinctness
        with pytest.raises(ValueError, match=re.escape("routed_experts (token 1, layer 1)=[3, 3]: expert id 3 "
                                                       "repeated; expected K distinct")) as err:
            decode(e)
        assert err.value.field == "routed_experts" and err.value.value == [3, 3]
    decode = dict(_frames(_bad_rows("E")))[form]
    with pytest.raises(ValueError, match=re.escape("routed_experts (token 1, layer 1): expert id 8 at slot 1: "
                                                   "expected ids >= 0 and < num_experts=8")):
        decode(8)
    decode(9)  # 8 is a valid id of 9 experts
    negative = _bad_rows("ok")
    negative[2, 0, 1] = -4
    with pytest.raises(ValueError, match=re.escape("routed_experts (token 2, layer 0): expert id -4 at slot 1")):
        dict(_frames(negative))[form](None)


@pytest.mark.parametrize("dtype", ["bool", "float32", "float64"])
def test_decoders_refuse_bool_and_float_ids(dtype):
    ids = np.array([[[0, 1]]], dtype)
    wire = {"data": base64.b64encode(ids.tobytes()).decode(), "shape": [1, 1, 2], "dtype": dtype,
            "start": 0, "layers": [1]}
    for decode in (R.decode, R.decode_payload):
        with pytest.raises(ValueError, match=f"routed_experts.dtype='{dtype}': expected one of") as err:
            decode(wire, 8)
        assert err.value.field == "routed_experts.dtype"
    # binary framing has no code for them: a frame claiming one is refused by its code
    blob = bytearray(R.encode_binary(np.array([[[0, 1]]], np.uint8), 0, [1]))
    blob[5] = 0
    with pytest.raises(ValueError, match="routed_experts dtype code=0"):
        R.decode_binary(bytes(blob))
    # encoders refuse them too, so they never reach the wire
    with pytest.raises(ValueError, match=f"routes.dtype='{dtype}'"):
        R.encode(ids, 0, [1])
