"""Route chunks through every encoder/decoder pair, both directions, for any E (E = 384 above all):
0-row chunks, chunks whose ids all fit uint8, and ids up to E - 1; plus the refusals."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from r3jax import routes as routes_lib
from r3jax.checks import FieldError
from r3jax.routes import route_dtype
from r3jax.serve.peers import sglang, skyrl, vllm

L, K = 3, 8
DATA = Path(__file__).parent / "data"


def chunk(rows: int, hi: int, seed: int = 0) -> np.ndarray:
    """``[rows, L, K]`` distinct ids per (token, layer) below ``hi``."""
    rng = np.random.default_rng(seed)
    if rows == 0:
        return np.zeros((0, L, K), np.int64)
    return np.stack([rng.permutation(hi)[:K] for _ in range(rows * L)]).reshape(rows, L, K)


# (E, rows, largest id + 1): 0 rows, ids that all fit uint8 although E > 256, ids up to E - 1.
SHAPES = [(384, 0, 384), (384, 1, 256), (384, 17, 256), (384, 17, 384), (128, 5, 128), (256, 5, 256),
          (40000, 3, 40000), (8, 4, 8)]


def _decoders(e):
    return {
        "skyrl": lambda payload: skyrl.decode_routes(payload, e),
        "r3jax": lambda payload: routes_lib.decode(payload, e),
    }


@pytest.mark.parametrize("e,rows,hi", SHAPES)
def test_skyrl_and_r3jax_json_forms_read_each_other(e, rows, hi):
    """SkyRL's packed form and r3jax's JSON form share data/shape/dtype: each decoder reads both."""
    r = chunk(rows, hi).astype(route_dtype(e))
    ours = routes_lib.encode(r, start=2, layers=list(range(L)))  # r3jax: route_dtype(E) for every chunk
    theirs = skyrl.encode_routes(r, e)  # SkyRL: value-canonical dtype of this chunk
    assert theirs["dtype"] == skyrl.canonical_dtype(r).name
    if rows == 0 or hi <= 256:
        assert theirs["dtype"] == "uint8"  # what SkyRL's decoder demands; r3jax's own form says int16 here
    assert list(theirs) == ["data", "shape", "dtype"]  # data first, for SkyRL's splice scan
    for name, decode in _decoders(e).items():
        for payload in (ours, theirs):
            got = decode(payload)
            assert got.dtype == route_dtype(e) and got.shape == (rows, L, K), name
            np.testing.assert_array_equal(got, r)


@pytest.mark.parametrize("e,rows,hi", SHAPES)
def test_vllm_npy_round_trip(e, rows, hi):
    r = chunk(rows, hi)
    text = vllm.encode_routes(r, e)
    assert np.dtype(vllm.route_wire_dtype(e)).name in {"uint8", "uint16", "int32"}
    got = vllm.decode_routes(text, e)
    assert got.shape == (rows, L, K) and got.dtype == vllm.route_wire_dtype(e)
    np.testing.assert_array_equal(got, r)


@pytest.mark.parametrize("dtype", ["uint8", "int16", "uint16", "int32", "int64"])
def test_vllm_decoder_reads_any_integer_npy(dtype):
    import io
    r = chunk(4, 200)
    buf = io.BytesIO()
    np.save(buf, r.astype(dtype))
    np.testing.assert_array_equal(vllm.decode_routes(base64.b64encode(buf.getvalue()).decode(), 384), r)


@pytest.mark.parametrize("e,rows,hi", SHAPES)
def test_sglang_int32_round_trip(e, rows, hi):
    r = chunk(rows, hi)
    text = sglang.encode_routes(r, e)
    assert len(base64.b64decode(text)) == rows * L * K * 4
    got = sglang.decode_routes(text, e, L, K)
    assert got.dtype == np.int32 and got.shape == (rows, L, K)
    np.testing.assert_array_equal(got, r)


def test_peer_produced_chunks_decode():
    """Chunks the peers' own code produced (recorded data) read back with E = 384."""
    sky = json.loads((DATA / "skyrl_0.4.0_generate.json").read_text())
    for case in sky["cases"].values():
        payload = case["response"]["choices"][0]["routed_experts"]
        want = np.asarray(case["routes"], dtype=np.int64).reshape(-1, sky["num_layers"], sky["top_k"])
        np.testing.assert_array_equal(skyrl.decode_routes(payload, 384), want)
        np.testing.assert_array_equal(routes_lib.decode(payload, 384), want)
        assert skyrl.encode_routes(want, 384) == payload  # same bytes as SkyRL's pack_routed_experts
    sg = json.loads((DATA / "sglang_0.5.23_generate.json").read_text())
    for case in sg["cases"].values():
        want = np.asarray(case["routes"], dtype=np.int64).reshape(-1, sg["num_layers"], sg["top_k"])
        text = case["response"]["meta_info"]["routed_experts"]
        np.testing.assert_array_equal(sglang.decode_routes(text, 384, sg["num_layers"], sg["top_k"]), want)
        assert sglang.encode_routes(want, 384) == text
    vl = json.loads((DATA / "vllm_completions.json").read_text())
    for case in vl["cases"].values():
        want = np.asarray(case["routes"], dtype=np.int64).reshape(-1, vl["num_layers"], vl["top_k"])
        text = case["response"]["choices"][0]["routed_experts"]
        np.testing.assert_array_equal(vllm.decode_routes(text, 384), want)
        assert vllm.encode_routes(want, 384) == text


BAD_CHUNKS = [
    (np.array([[[3, 3, 1]]]), "repeated"),
    (np.array([[[384, 0, 1]]]), "num_experts=384"),
]


@pytest.mark.parametrize("bad,match", BAD_CHUNKS)
def test_every_decoder_refuses_bad_ids(bad, match):
    raw = bad.astype("<i4")
    sky = {"data": base64.b64encode(raw.tobytes()).decode(), "shape": list(raw.shape), "dtype": "int32"}
    with pytest.raises(ValueError, match=match):
        skyrl.decode_routes(sky, 384)
    with pytest.raises(ValueError, match=match):
        sglang.decode_routes(base64.b64encode(raw.tobytes()).decode(), 384, 1, 3)
    import io
    buf = io.BytesIO()
    np.save(buf, raw)
    with pytest.raises(ValueError, match=match):
        vllm.decode_routes(base64.b64encode(buf.getvalue()).decode(), 384)


@pytest.mark.parametrize("encode", [lambda r: skyrl.encode_routes(r, 384), lambda r: vllm.encode_routes(r, 384),
                                    lambda r: sglang.encode_routes(r, 384)])
def test_every_encoder_refuses_bad_ids(encode):
    for bad in (np.array([[[3, 3, 1]]]), np.array([[[400, 0, 1]]]), np.array([[[True, False, True]]]),
                np.ones((1, 1, 3), np.float32)):
        with pytest.raises(FieldError):
            encode(bad)
    with pytest.raises(ValueError, match="3 dims"):
        encode(np.zeros((2, 3), np.int32))


def test_skyrl_decoder_refuses_a_lying_envelope():
    r = chunk(2, 300).astype(np.int16)
    payload = skyrl.encode_routes(r, 384)
    for broken, match in [({**payload, "shape": [3, L, K]}, "bytes"), ({**payload, "dtype": "float32"}, "dtype"),
                          ({**payload, "data": "!!"}, "base64"), ({**payload, "shape": [2, L]}, "3 dims")]:
        with pytest.raises(ValueError, match=match):
            skyrl.decode_routes(broken, 384)
