"""Rows on disk for ``python -m r3jax train``: written once, read back by row ranges exactly."""

import numpy as np
import pytest

from r3jax.batch import collate
from r3jax.train.batch_file import FIELDS, num_rows, read_rows, write_rows


def _batch(n=6):
    rng = np.random.default_rng(1)
    trajs = [dict(tokens=rng.integers(1, 50, 5 + j), loss_mask=np.r_[0.0, np.ones(4 + j)],
                  rollout_logprobs=-rng.random(5 + j), advantage=float(j), captured=np.arange(5 + j) < 4 + j,
                  routes=np.argsort(rng.random((5 + j, 2, 8)), -1)[..., :2]) for j in range(n)]
    return collate(trajs, seq_len=16, num_experts=8, top_k=2, num_layers=2)


def test_rows_round_trip_by_range_keeping_dtypes(tmp_path):
    batch = _batch()
    write_rows(tmp_path / "rows", batch)
    assert num_rows(tmp_path / "rows") == 6
    part = read_rows(tmp_path / "rows", slice(2, 5))
    for f in FIELDS:
        want = np.asarray(getattr(batch, f))[2:5]
        got = getattr(part, f)
        assert got.dtype == want.dtype and isinstance(got, np.ndarray), f
        np.testing.assert_array_equal(got, want)
    assert part.routes.dtype == np.uint8


def test_bad_ranges_and_directories_are_named(tmp_path):
    write_rows(tmp_path / "rows", _batch())
    for rows in (slice(4, 7), slice(3, 3), slice(None, 2), slice(0, 4, 2)):
        with pytest.raises(ValueError, match=r"rows=slice\(.*\): expected a slice \[start, stop\) with "
                                             r"0 <= start < stop <= 6 rows"):
            read_rows(tmp_path / "rows", rows)
    with pytest.raises(ValueError, match=r"meta.json does not exist: expected a directory written by "
                                         r"r3jax.train.batch_file.write_rows"):
        num_rows(tmp_path / "nothing")
