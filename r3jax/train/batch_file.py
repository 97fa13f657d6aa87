"""Training rows on disk: a directory with one ``<field>.npy`` per :class:`r3jax.batch.Batch` field
(``[N, S]``, routes ``[N, S, L, K]`` in their compact dtype) and ``meta.json``.

Each file is memory-mapped on read, so a process of a multi-process job reads only its own rows
(``read_rows(path, rows)`` with ``rows = r3jax.sharding.process_rows(mesh, B)`` offset by the
step's first row). Files are written under temporary names and renamed, so a directory never holds
a half-written field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from r3jax.batch import Batch

FORMAT = "r3jax.train.batch_file/1"
FIELDS = tuple(f.name for f in dataclasses.fields(Batch))
OPTIONAL = ("token_versions", "route_versions")  # absent from directories written before it (or from a batch without it)


def write_rows(path, batch: Batch) -> Path:
    """Write the host arrays of ``batch`` (e.g. ``collate(...)``) to directory ``path``. Returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {f: np.asarray(getattr(batch, f)) for f in FIELDS if getattr(batch, f) is not None}
    n, s = arrays["tokens"].shape
    for f, a in arrays.items():
        if a.shape[:2] != (n, s):
            raise ValueError(f"batch.{f} shape={a.shape}: expected leading dims [N, S] = {(n, s)}")
        tmp = path / f".{f}.npy.tmp"
        with open(tmp, "wb") as fh:
            np.save(fh, a)
        os.replace(tmp, path / f"{f}.npy")
    meta = {"format": FORMAT, "rows": int(n), "seq_len": int(s), "routes_shape": list(arrays["routes"].shape[2:])}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def num_rows(path) -> int:
    """How many rows the directory holds (from ``meta.json``)."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{meta_path} does not exist: expected a directory written by "
                         "r3jax.train.batch_file.write_rows") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} format={meta.get('format')!r}: expected {FORMAT!r}")
    return int(meta["rows"])


def read_rows(path, rows: slice) -> Batch:
    """Rows ``rows`` (a slice with step 1 inside ``[0, num_rows)``) as a Batch of NumPy arrays."""
    n = num_rows(path)
    start, stop, step = rows.indices(n)
    if step != 1 or rows.start is None or rows.stop is None or not 0 <= rows.start < rows.stop <= n:
        raise ValueError(f"rows={rows}: expected a slice [start, stop) with 0 <= start < stop <= {n} "
                         f"rows in {path}")
    return Batch(**{f: np.array(np.load(Path(path) / f"{f}.npy", mmap_mode="r")[start:stop])
                    for f in FIELDS if (Path(path) / f"{f}.npy").exists() or f not in OPTIONAL})
