"""A directory of rollout batches in order, between rollout workers and an asynchronous trainer.

Workers :meth:`Spool.put` batches (each a rows directory of :mod:`r3jax.train.batch_file`, written
under a temporary name and published by one atomic rename, so a reader never sees half of one) as
``batch-00000000``, ``batch-00000001``, ...; several workers may put into one spool (each takes the
next free number). The trainer's step ``n`` reads batch ``n`` (:meth:`Spool.wait` blocks until it is
there), so a resumed run goes on with the batch after its checkpoint's step. Each batch keeps its
``token_versions``: the trainer masks what is older than its staleness bound (:func:`r3jax.batch.mask_stale`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from r3jax.batch import Batch
from r3jax.train.batch_file import write_rows


class Spool:
    def __init__(self, path):
        self.dir = Path(path)

    def path(self, n: int) -> Path:
        return self.dir / f"batch-{n:08d}"

    def __len__(self) -> int:
        """Batches published so far (the first missing number)."""
        n = 0
        while (self.path(n) / "meta.json").exists():
            n += 1
        return n

    def put(self, batch: Batch) -> int:
        """Publish ``batch`` (host arrays, e.g. ``collate(...)``) as the next batch; returns its number."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.dir, prefix=".tmp-"))
        try:
            write_rows(tmp, batch)
            n = len(self)
            while True:
                try:
                    os.rename(tmp, self.path(n))  # atomic; fails if another worker took n first
                    return n
                except OSError:
                    if not self.path(n).exists():
                        raise
                    n += 1
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def wait(self, n: int, timeout: float, poll_s: float = 0.05) -> Path:
        """The directory of batch ``n`` once published; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not (self.path(n) / "meta.json").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path(n)}: batch {n} not published within {timeout} s "
                                   f"(the spool has {len(self)}; are the rollout workers running?)")
            time.sleep(poll_s)
        return self.path(n)
