"""Ragged attention over the page pool (the XLA kernel) against a dense numpy reference: decode rows and
prefill chunks in one step, rows whose keys end mid-page, GQA and a two-part (MLA latent) key, bf16
pools stored as their bits; and page writes that land exactly where the step says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.paged import PagedMeta, RaggedLayout, pages_reference, ragged_attention, write

PS, PAGES = 4, 24  # page size, pool pages (page 0: trash)


def _step(rng, lay: RaggedLayout, kv_lens, chunks):
    """Meta of a step: decode row r attends to kv_lens[r] keys (its query at kv_len - 1); prefill row
    c feeds positions [lo, hi) of chunks[c] (padding queries sit at hi - 1). Every row gets its own
    random pages (distinct, never page 0)."""
    r, n = lay.rows, lay.tokens
    table = np.zeros((r, lay.pages_per_row), np.int32)
    pages = rng.permutation(np.arange(1, PAGES))
    used = 0
    kv_len, pos = np.ones(r, np.int32), np.zeros(n, np.int32)
    ends = list(kv_lens) + [hi for _, hi in chunks]
    for row, end in enumerate(ends):
        k = -(-end // PS)
        table[row, :k] = pages[used:used + k]
        used += k
        kv_len[row] = end
    pos[:lay.decode_rows] = np.asarray(kv_lens) - 1
    for c, (lo, hi) in enumerate(chunks):
        t0 = lay.decode_rows + c * lay.prefill_len
        pos[t0:t0 + lay.prefill_len] = hi - 1
        pos[t0:t0 + hi - lo] = np.arange(lo, hi)
    meta = PagedMeta(jnp.asarray(table), jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), jnp.asarray(kv_len), lay)
    return meta, jnp.asarray(pos)[None]


@pytest.mark.parametrize("block_pages", [2, 8])  # a loop over key blocks; every table in one block
@pytest.mark.parametrize("bits", [False, True])
@pytest.mark.parametrize("heads,kv_heads,parts", [(4, 2, (8,)), (4, 1, (6, 2))])  # GQA; MLA-like latent key
def test_ragged_attention_equals_the_dense_reference(bits, heads, kv_heads, parts, block_pages):
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16 if bits else jnp.float32
    lay = RaggedLayout(decode_rows=3, prefill_rows=2, prefill_len=5, pages_per_row=8, block_pages=block_pages)
    # decode rows ending mid-page, on a page boundary, and after one token; chunks: a first chunk and a
    # later one that starts mid-page and is padded
    meta, pos = _step(rng, lay, kv_lens=[7, 12, 1], chunks=[(0, 5), (9, 13)])
    dv = 8

    def pool(d):
        x = jnp.asarray(rng.normal(size=(PAGES, PS, kv_heads, d)), dtype)
        return jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x

    keys, values = tuple(pool(d) for d in parts), pool(dv)
    q = jnp.asarray(rng.normal(size=(1, lay.tokens, heads, sum(parts))), dtype)
    got = jax.jit(lambda *a: ragged_attention(*a, meta=meta, scale=0.3, dtype=dtype))(q, keys, values, pos)
    want = pages_reference(q, keys, values, pos, meta, scale=0.3, dtype=dtype)
    assert got.shape == (1, lay.tokens, heads, dv) and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2 if bits else 1e-5)


@pytest.mark.parametrize("block_pages", [1, 4])
def test_keys_past_a_rows_length_do_not_change_it(block_pages):
    """Pages hold stale keys of earlier owners; a row sees only positions <= its query's."""
    rng = np.random.default_rng(1)
    lay = RaggedLayout(decode_rows=2, prefill_rows=1, prefill_len=4, pages_per_row=4, block_pages=block_pages)
    meta, pos = _step(rng, lay, kv_lens=[6, 3], chunks=[(2, 5)])
    keys = (jnp.asarray(rng.normal(size=(PAGES, PS, 1, 8)), jnp.float32),)
    values = jnp.asarray(rng.normal(size=(PAGES, PS, 1, 8)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(1, lay.tokens, 2, 8)), jnp.float32)
    run = jax.jit(lambda k, v: ragged_attention(q, k, v, pos, meta, scale=0.5, dtype=jnp.float32))
    before = run(keys, values)
    # overwrite every slot past each row's own length (the rest of its last page and unused pages)
    table, kv_len = np.asarray(meta.table), np.asarray(meta.kv_len)
    k, v = np.array(keys[0]), np.array(values)
    stale = np.ones((PAGES, PS), bool)
    for row in range(lay.rows):
        for p in range(kv_len[row]):
            stale[table[row, p // PS], p % PS] = False
    k[stale], v[stale] = 1e3, -1e3
    np.testing.assert_array_equal(np.asarray(run((jnp.asarray(k),), jnp.asarray(v))), np.asarray(before))


def test_write_puts_each_token_at_its_page_and_offset_bit_for_bit():
    rng = np.random.default_rng(2)
    lay = RaggedLayout(decode_rows=2, prefill_rows=1, prefill_len=3, pages_per_row=4)
    page = jnp.asarray([5, 7, 3, 3, 0], jnp.int32)  # the last token is padding: page 0 (trash)
    offset = jnp.asarray([1, 3, 0, 1, 0], jnp.int32)
    meta = PagedMeta(jnp.zeros((3, 4), jnp.int32), page, offset, jnp.ones(3, jnp.int32), lay)
    new = jnp.asarray(rng.normal(size=(1, 5, 2, 4)), jnp.bfloat16)
    pool = jnp.zeros((PAGES, PS, 2, 4), jnp.uint16)  # a bf16 pool stored as its bits
    out = np.asarray(jax.jit(write, static_argnums=3)(pool, new, meta, jnp.bfloat16))
    bits = np.asarray(jax.lax.bitcast_convert_type(new[0], jnp.uint16))
    for n in range(4):
        np.testing.assert_array_equal(out[int(page[n]), int(offset[n])], bits[n])
    written = np.zeros((PAGES, PS), bool)
    written[np.asarray(page), np.asarray(offset)] = True
    written[0] = True  # the trash page takes the padding
    assert not out[~written].any()


@pytest.mark.parametrize("block_pages", [2, 8])  # a loop over key blocks; every table in one block
@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # the layer read in place; sliced out before the loop
@pytest.mark.parametrize("form", ["separate", "combined", "latent"])
def test_a_layer_of_stacked_pages_reads_as_that_layer_alone(monkeypatch, form, platform, block_pages):
    import models.paged as paged

    monkeypatch.setattr(paged, "_target_platform", lambda: platform)
    rng = np.random.default_rng(2)
    lay = RaggedLayout(decode_rows=2, prefill_rows=1, prefill_len=4, pages_per_row=8, block_pages=block_pages)
    meta, pos = _step(rng, lay, kv_lens=[7, 3], chunks=[(2, 6)])
    pool = lambda *hd: jnp.asarray(rng.normal(size=(3, PAGES, PS) + hd), jnp.float32)  # 3 stacked layers
    if form == "combined":  # GQA keys and values interleaved by head, one pool
        keys, values = (pool(4, 8),), None
    elif form == "separate":
        keys, values = (pool(2, 8),), pool(2, 8)
    else:  # MLA-like: a two-part key, one KV head
        keys, values = (pool(1, 6), pool(1, 2)), pool(1, 8)
    q = jnp.asarray(rng.normal(size=(1, lay.tokens, 4, 8)), jnp.float32)
    attend = jax.jit(lambda q, k, v, layer: ragged_attention(q, k, v, pos, meta, scale=0.4, dtype=jnp.float32,
                                                             impl="xla", layer=layer), static_argnums=3)
    got = attend(q, keys, values, 1)
    alone = attend(q, tuple(k[1] for k in keys), None if values is None else values[1], None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=1e-6, atol=1e-6)
    other = attend(q, tuple(k[2] for k in keys), None if values is None else values[2], None)
    assert not np.allclose(np.asarray(got), np.asarray(other))  # the layer index matters
