"""The Pallas ragged paged attention path (models/ragged_tpu.py) and the kernel dispatch of
models.paged.ragged_attention.

On CPU the real kernel runs in Pallas's TPU interpreter (two gaps of jax 0.10.2's interpreter filled,
tests/models/pallas_interpret.py) against pages_reference; the adapter is also checked through the
kernel's pure-JAX reference, which takes the same inputs, against pages_reference and the XLA kernel;
with libtpu (.venv-tpu) the real kernel is compiled for a v5p slice ahead of time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged, ragged_tpu
from models.paged import PagedMeta, RaggedLayout

PS, PAGES, H, HKV, D = 4, 24, 4, 2, 128
SCALE = D ** -0.5


def _step(lay: RaggedLayout, decode, chunks, seed=0):
    """A planner-shaped step (r3jax/engine/planner.build): ``decode`` a list of context lengths (the row
    feeds position len - 1), ``chunks`` a list of ``(lo, hi)`` prompt chunks (hi - lo <= prefill_len,
    padding at position hi - 1); rows not given are padding rows (kv_len 1, position 0, page 0).
    Returns (q, k pages, v pages, positions, meta) with every row on its own distinct pages."""
    rng = np.random.default_rng(seed)
    n, r = lay.tokens, lay.rows
    free = list(rng.permutation(np.arange(1, PAGES)))
    table, kv_len = np.zeros((r, lay.pages_per_row), np.int32), np.ones(r, np.int32)
    pos, page, off = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)

    def pages_for(i, length):
        need = -(-length // PS)
        table[i, :need] = [free.pop() for _ in range(need)]

    for i, length in enumerate(decode):
        pages_for(i, length)
        pos[i], kv_len[i] = length - 1, length
        page[i], off[i] = table[i, (length - 1) // PS], (length - 1) % PS
    for c, (lo, hi) in enumerate(chunks):
        i, t0 = lay.decode_rows + c, lay.decode_rows + c * lay.prefill_len
        pages_for(i, hi)
        kv_len[i] = hi
        pos[t0:t0 + lay.prefill_len] = hi - 1
        pos[t0:t0 + hi - lo] = np.arange(lo, hi)
        for j, p in enumerate(range(lo, hi)):
            page[t0 + j], off[t0 + j] = table[i, p // PS], p % PS
    q = jnp.asarray(rng.normal(size=(1, n, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(PAGES, PS, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(PAGES, PS, HKV, D)), jnp.float32)
    meta = PagedMeta(jnp.asarray(table), jnp.asarray(page), jnp.asarray(off), jnp.asarray(kv_len), lay)
    return q, k, v, jnp.asarray(pos)[None], meta


# 3 decode rows (one a padding row), 3 prefill rows: a full chunk, a prompt's short last chunk, a
# padding row; context lengths end mid-page
LAYOUT = RaggedLayout(decode_rows=3, prefill_rows=3, prefill_len=6, pages_per_row=4, block_pages=2)
DECODE, CHUNKS = [7, 13], [(3, 9), (10, 13)]


def _real_tokens(lay, chunks):
    """Indices of the non-padding tokens of :func:`_step`'s layout."""
    idx = list(range(len(DECODE)))
    for c, (lo, hi) in enumerate(chunks):
        t0 = lay.decode_rows + c * lay.prefill_len
        idx += list(range(t0, t0 + hi - lo))
    return np.array(idx)


def test_packing_of_padded_rows():
    _, _, _, pos, meta = _step(LAYOUT, DECODE, CHUNKS)
    slot, real, cu = ragged_tpu.packing(pos, meta)
    # decode rows 1 each; prefill: 6 real, 3 real (+3 padding), a padding row counts 1 (+5 padding)
    assert np.asarray(cu).tolist() == [0, 1, 2, 3, 9, 12, 13]
    assert np.asarray(slot).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11, 11, 12, 12, 12, 12, 12, 12]
    assert np.flatnonzero(np.asarray(real)).tolist() == list(range(3)) + list(range(3, 9)) + [9, 10, 11, 15]


def test_adapter_matches_pages_reference_and_the_xla_kernel():
    q, k, v, pos, meta = _step(LAYOUT, DECODE, CHUNKS)
    want = paged.pages_reference(q, (k,), v, pos, meta, scale=SCALE)
    xla = paged.ragged_attention(q, (k,), v, pos, meta, scale=SCALE, dtype=jnp.float32, impl="xla")
    got = ragged_tpu.reference_via_kernel_contract(q, (k,), v, pos, meta, scale=SCALE, dtype=jnp.float32)
    real, got = _real_tokens(LAYOUT, CHUNKS), np.asarray(got)
    np.testing.assert_allclose(got[:, real], want[:, real], atol=2e-5)
    np.testing.assert_allclose(got[:, real], np.asarray(xla)[:, real], atol=2e-5)
    # a padding token gets its row's last real token's output (nothing reads it; models/ragged_tpu.py)
    short = LAYOUT.decode_rows + LAYOUT.prefill_len  # the second chunk: 3 real tokens, then padding
    np.testing.assert_array_equal(got[:, short + 3:short + 6], np.repeat(got[:, short + 2:short + 3], 3, axis=1))


def test_adapter_reads_an_unsigned_int_pool_as_its_floats():
    q, k, v, pos, meta = _step(LAYOUT, DECODE, CHUNKS, seed=1)
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    got = ragged_tpu.reference_via_kernel_contract(q, (bits(k),), bits(v), pos, meta, scale=SCALE,
                                                   dtype=jnp.bfloat16)
    xla = paged.ragged_attention(q, (bits(k),), bits(v), pos, meta, scale=SCALE, dtype=jnp.bfloat16, impl="xla")
    real = _real_tokens(LAYOUT, CHUNKS)
    np.testing.assert_allclose(np.asarray(got, np.float32)[:, real], np.asarray(xla, np.float32)[:, real], atol=2e-2)


def test_combined_pages_interleave_k_and_v_by_head():
    _, k, v, _, _ = _step(LAYOUT, DECODE, CHUNKS)
    kv = ragged_tpu.combined_pages(k, v, jnp.float32)
    assert kv.shape == (PAGES, PS, 2 * HKV, D)
    np.testing.assert_array_equal(kv[:, :, 0::2], k)
    np.testing.assert_array_equal(kv[:, :, 1::2], v)


def _stacked_combined(k, v, layer, n=3):
    """A stacked combined pool [n, P, ps, 2Hkv, D] holding k, v (interleaved) at ``layer``, other layers noise."""
    other = jnp.asarray(np.random.default_rng(7).normal(size=(n, PAGES, PS, 2 * HKV, D)), jnp.float32)
    return other.at[layer].set(ragged_tpu.combined_pages(k, v, jnp.float32))


def test_a_combined_stacked_pool_is_read_in_place_by_either_kernel():
    """The engine's GQA pool (models.paged): one [n, P, ps, 2Hkv, D] pool per layer group. The adapter
    hands the kernel a reshape of it with the layer's page ids offset (no copy: the jaxpr of the kernel's
    pages argument is one reshape), and both kernels read layer j's pages as separate k, v pools."""
    q, k, v, pos, meta = _step(LAYOUT, DECODE, CHUNKS, seed=2)
    pool, j = _stacked_combined(k, v, layer=1), jnp.int32(1)
    want = paged.pages_reference(q, (k,), v, pos, meta, scale=SCALE)
    unstacked = paged.pages_reference(q, (pool[1],), None, pos, meta, scale=SCALE)
    np.testing.assert_allclose(unstacked, want, atol=1e-9)
    xla = paged.ragged_attention(q, (pool,), None, pos, meta, scale=SCALE, dtype=jnp.float32, impl="xla", layer=j)
    got = ragged_tpu.reference_via_kernel_contract(q, (pool,), None, pos, meta, scale=SCALE, dtype=jnp.float32,
                                                   layer=j)
    real = _real_tokens(LAYOUT, CHUNKS)
    np.testing.assert_allclose(np.asarray(xla)[:, real], want[:, real], atol=2e-5)
    np.testing.assert_allclose(np.asarray(got)[:, real], want[:, real], atol=2e-5)
    (_, kv, _, table, _, _), _ = ragged_tpu.kernel_inputs(q, (pool,), None, pos, meta, jnp.float32, j)
    assert kv.shape == (3 * PAGES, PS, 2 * HKV, D)
    np.testing.assert_array_equal(table, np.asarray(meta.table) + PAGES)
    pages_of = lambda p: ragged_tpu.kernel_inputs(q, (p,), None, pos, meta, jnp.float32, j)[0][1]
    jaxpr = jax.make_jaxpr(pages_of)(pool).jaxpr
    made = next(e for e in jaxpr.eqns if jaxpr.outvars[0] in e.outvars)
    assert made.primitive.name == "reshape" and made.invars[0] is jaxpr.invars[0]


def test_write_kv_interleaves_a_steps_keys_and_values_in_one_scatter():
    _, _, _, _, meta = _step(LAYOUT, DECODE, CHUNKS, seed=3)
    rng = np.random.default_rng(3)
    n = LAYOUT.tokens
    k, v = (jnp.asarray(rng.normal(size=(1, n, HKV, D)), jnp.float32) for _ in range(2))
    pool = jnp.zeros((2, PAGES, PS, 2 * HKV, D), jnp.bfloat16)
    out = paged.write_kv(pool, k, v, meta, jnp.bfloat16, layer=jnp.int32(1))
    page, off = np.asarray(meta.page), np.asarray(meta.offset)
    real = page > 0  # padding tokens go to the trash page 0
    got = np.asarray(out[1, page[real], off[real]], np.float32)
    np.testing.assert_array_equal(got[:, 0::2], np.asarray(k[0][real].astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(got[:, 1::2], np.asarray(v[0][real].astype(jnp.bfloat16), np.float32))
    assert not np.asarray(out[0], np.float32).any()  # other layers untouched
    jaxpr = jax.make_jaxpr(lambda p: paged.write_kv(p, k, v, meta, jnp.bfloat16, jnp.int32(1)))(pool)
    assert [e.primitive.name for e in jaxpr.eqns].count("scatter") == 1


def test_the_engine_pool_is_combined_for_gqa_and_two_pools_for_mla():
    from models import MoeConfig

    cfg = MoeConfig.tiny()
    k, v = paged.PagedCache.init_pool(cfg, 5, 4)
    assert v == () and k[0].shape[-2:] == (2 * cfg.num_kv_heads, cfg.head_dim)
    mla = MoeConfig.preset("deepseek_v3").replace(num_layers=2, first_dense_layers=1)
    shapes = jax.eval_shape(lambda: paged.PagedCache.init_pool(mla, 5, 4))
    assert [a.shape[-1] for a in shapes[0]] == [mla.kv_lora_rank] * 2
    assert [a.shape[-1] for a in shapes[1]] == [mla.qk_rope_head_dim] * 2


def test_dispatch_per_target_and_what_the_kernel_covers():
    q, k, v, _, _ = _step(LAYOUT, DECODE, CHUNKS)
    resolve = lambda impl, *a: paged._resolve(impl, *a)
    assert jax.default_backend() != "tpu"
    assert [resolve(i, q, (k,), v, jnp.float32) for i in ("auto", "splash", "blockwise", "cudnn", "xla")] == ["xla"] * 5
    assert resolve("pallas", q, (k,), v, jnp.float32) == "pallas"
    assert ragged_tpu.unsupported(q, (k,), v, jnp.bfloat16) is None
    mla_keys = (jnp.zeros((PAGES, PS, 1, 96)), jnp.zeros((PAGES, PS, 1, 32)))
    assert "MLA" in ragged_tpu.unsupported(q, mla_keys, mla_keys[0], jnp.float32)
    assert "multiple of 128" in ragged_tpu.unsupported(q[..., :64], (k[..., :64],), v[..., :64], jnp.float32)
    with pytest.raises(ValueError, match=r"impl='pallas': 2 key arrays \(MLA's latent cache\)"):
        ragged_tpu.ragged_paged_attention(q, mla_keys, mla_keys[0], None, None, scale=1.0, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"impl='flash': expected one of 'auto', 'xla', 'pallas'"):
        resolve("flash", q, (k,), v, jnp.float32)


def test_block_sizes_follow_the_target_device_kind():
    # v5p bf16, 8 q / 2 kv heads per block, head dim 128, 16-token pages: the kernel's tuned table
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tb

    key = tb.simplify_key((jnp.bfloat16, jnp.bfloat16, 8, 2, 128, 16, 64, 64))
    want = tb.TUNED_BLOCK_SIZES["TPU v5"].get(key, (128, 32))
    assert ragged_tpu.block_sizes(jnp.bfloat16, 8, 2, 128, 16, 64, 64, device_kind="TPU v5") == (min(64, want[0]),
                                                                                                min(64, want[1]))
    assert ragged_tpu.block_sizes(jnp.bfloat16, 8, 2, 128, 16, 64, 64, device_kind="TPU v4") == (32, 32)


def _interleaved(k, v, n=2):
    """k, v [P, ps, Hkv, D] -> the engine's pool: ``n`` stacked layers [n, P, ps, 2 Hkv, D], k and v
    interleaved by head, layer i holding (k, v) * (i + 1) so a wrong layer reads other values."""
    kv = jnp.stack([k, v], axis=-2).reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3])
    return jnp.stack([kv * (i + 1) for i in range(n)])


@pytest.mark.parametrize("form", ["separate", "stacked"])
def test_pallas_kernel_in_interpret_mode_equals_the_reference(form):
    """The real Pallas kernel, run by the TPU interpreter on CPU (its reads through reshaped VMEM refs
    and its masked stores completed, tests/models/pallas_interpret.py), against pages_reference: separate
    k and v pools, and the engine's stacked combined pool read at a layer."""
    from tests.models.pallas_interpret import tpu_interpret

    q, k, v, pos, meta = _step(LAYOUT, DECODE, CHUNKS)
    if form == "separate":
        keys, values, layer, scale = (k,), v, None, 1
    else:
        keys, values, layer, scale = (_interleaved(k, v),), None, jnp.int32(1), 2
    with tpu_interpret():
        got = np.asarray(jax.jit(lambda q, keys, values, layer: paged.ragged_attention(
            q, keys, values, pos, meta, scale=SCALE, dtype=jnp.float32, impl="pallas", layer=layer))(
                q, keys, values, layer))
    want = np.asarray(paged.pages_reference(q, (k * scale,), v * scale, pos, meta, scale=SCALE))
    real = _real_tokens(LAYOUT, CHUNKS)
    np.testing.assert_allclose(got[:, real], want[:, real], atol=2e-5)
    assert np.abs(want[:, real]).max() > 0.1  # not a comparison of zeros


def test_ragged_paged_attention_compiles_for_a_tpu_topology():
    from experiments import topologies

    if not topologies.tpu_aot_available():
        pytest.skip("libtpu not installed: install the tpu-aot extra (.venv-tpu) to compile for a TPU topology")
    from jax.sharding import NamedSharding, PartitionSpec as P

    devs = topologies.devices(topologies.topology("v5p:2x2x1"), "tpu")
    mesh = jax.sharding.Mesh(np.array(devs).reshape(2, 2, 1), ("data", "tensor", "expert"))
    lay = RaggedLayout(decode_rows=16, prefill_rows=2, prefill_len=64, pages_per_row=16)
    n, r, h, hkv, d, pages, ps = lay.tokens, lay.rows, 8, 4, 128, 256, 16
    rep = NamedSharding(mesh, P())
    heads = NamedSharding(mesh, P(None, None, "tensor"))
    sd = lambda shape, dt, sh=rep: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    stacked = NamedSharding(mesh, P(None, None, None, "tensor"))
    args = (sd((1, n, h, d), jnp.bfloat16, NamedSharding(mesh, P(None, None, "tensor"))),
            sd((2, pages, ps, 2 * hkv, d), jnp.bfloat16, stacked),  # the engine's pool: 2 layers, combined
            sd((1, n), jnp.int32), sd((r, lay.pages_per_row), jnp.int32), sd((r,), jnp.int32))

    def attend(q, kv, pos, table, kv_len):
        meta = PagedMeta(table, jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32), kv_len, lay)
        return paged.ragged_attention(q, (kv,), None, pos, meta, scale=d ** -0.5, dtype=jnp.bfloat16, impl="auto",
                                      layer=jnp.int32(1))

    with jax.set_mesh(mesh):  # the topology's devices answer the kernel's lowering (no patching of JAX)
        compiled = jax.jit(attend).lower(*args).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "ragged_paged_attention" in text  # "auto" chose the Pallas kernel
    # the pool reaches the kernel as it is stored: no copy of it (1 MiB per layer here) in the program
    pool_bytes = 2 * pages * ps * 2 * hkv * d * 2 // 2  # per chip: heads split over tensor = 2
    assert compiled.cost_analysis()["bytes accessed"] < pool_bytes


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_xla_kernel_reads_a_combined_pool_in_either_gather_form(platform, monkeypatch):
    """The XLA kernel takes a combined pool's keys and values by an index inside its gather on CPU (slicing a
    gathered block copies it there) and by slicing one gathered block elsewhere (the index form makes the
    TPU compiler re-tile the whole pool every step): both give the reference's values."""
    monkeypatch.setattr(paged, "_target_platform", lambda: platform)
    q, k, v, pos, meta = _step(LAYOUT, DECODE, CHUNKS, seed=3)
    pool, j = _stacked_combined(k, v, layer=1), jnp.int32(1)
    want = paged.pages_reference(q, (k,), v, pos, meta, scale=SCALE)
    got = paged.ragged_attention(q, (pool,), None, pos, meta, scale=SCALE, dtype=jnp.float32, impl="xla", layer=j)
    real = _real_tokens(LAYOUT, CHUNKS)
    np.testing.assert_allclose(np.asarray(got)[:, real], want[:, real], atol=2e-5)
    picked = jax.make_jaxpr(lambda p: paged.ragged_attention(q, (p,), None, pos, meta, scale=SCALE, dtype=jnp.float32,
                                                             impl="xla", layer=j))(pool)
    # the decode rows and the prefill rows each run the row kernel: 2 gathers of the pool each, or 1
    assert str(picked).count(" gather[") == (4 if platform == "cpu" else 2)
