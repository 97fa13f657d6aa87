"""Which failed checkpoint reads prove a step damaged (quarantine it, fall back to an earlier one) and
which do not (stop the run, name the path, change nothing on disk).

A committed step (orbax's ``commit_success.txt`` in the step directory and in each item directory) is
*proven damaged* when

* an item directory or its commit marker is missing (an interrupted or partly deleted save);
* a file it needs is gone (``FileNotFoundError`` anywhere in the error's chain); or
* its bytes were read but could not be decoded: a ``ValueError`` at the root of the chain
  (``json.JSONDecodeError`` and ``UnicodeDecodeError`` from orbax's JSON files; tensorstore's
  errors for its OCDBT nodes and zarr chunks: zstd's "Data corruption detected", bad magic bytes,
  short reads) -- confirmed as below.

tensorstore turns *every* failure into a plain ``ValueError`` (its Python binding maps each absl
status, permission denied and "unavailable" included, to ValueError; the code survives only in the
message), so on its own that type cannot tell corrupt bytes from storage that failed to deliver
them. We narrow it by the origin of the failure instead of by message text: the step's files are
read again with Python's own I/O, which reports storage failures as typed ``OSError``\\ s
(``PermissionError``, ``EIO``, ``ESTALE`` ...); if one fails, the error is the storage's, not the
checkpoint's. If every byte reads back, the restore is tried once more (every process together) so
that a transient read error cannot pass for damage; only a second rejection of the same readable,
committed bytes counts as corruption.

Every other error (any other ``OSError``, or anything unexpected) raises
:class:`CheckpointReadError` naming the file or step directory.
"""

from __future__ import annotations

import os
import pathlib

COMMIT_FILE = "commit_success.txt"  # orbax: path/atomicity_types.COMMIT_SUCCESS_FILE

# Outcomes of one restore attempt, ordered so that the worst across processes is the max.
OK, UNDECODABLE, DAMAGED, NOT_DAMAGE = 0, 1, 2, 3


class CheckpointReadError(OSError):
    """A checkpoint could not be read for a reason that is not proven damage to it (permission
    denied, an I/O or network-filesystem error, an unexpected error): nothing on disk was changed.

    ``path``: the file or step directory that failed; ``step``: the step.
    """

    def __init__(self, message: str, *, path, step: int):
        super().__init__(message)
        self.path, self.step = str(path), step


class Unreadable(Exception):
    """Internal: a failed read of a step, with its outcome (UNDECODABLE, DAMAGED or NOT_DAMAGE);
    the original error is ``__cause__``."""

    def __init__(self, kind: int):
        super().__init__(kind)
        self.kind = kind


def chain(e: BaseException) -> list[BaseException]:
    """``e`` and its explicit causes (``raise ... from``), outermost first: orbax wraps a failed
    array read in a bare ``Exception(...) from err``, so the informative error is at the root. An
    implicit ``__context__`` (raised while another error was handled) is history, not a cause."""
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        out.append(e)
        seen.add(id(e))
        e = e.__cause__
    return out


def classify(e: BaseException) -> int:
    """The outcome for an error raised while orbax read a step (see the module docstring)."""
    errors = chain(e)
    if any(isinstance(x, OSError) and not isinstance(x, FileNotFoundError) for x in errors):
        return NOT_DAMAGE  # the read itself failed: permission, I/O, network filesystem
    if any(isinstance(x, FileNotFoundError) for x in errors):
        return DAMAGED
    if isinstance(errors[-1], ValueError):
        return UNDECODABLE
    return NOT_DAMAGE


def failed_path(e: BaseException, default) -> str:
    """The file an OSError in ``e``'s chain names, else ``default``."""
    for x in chain(e):
        if isinstance(x, OSError) and x.filename:
            return os.fsdecode(x.filename)
    return str(default)


def root(e: BaseException) -> BaseException:
    return chain(e)[-1]


def describe(e: BaseException, limit: int = 300) -> str:
    r = root(e)
    return f"{type(r).__name__}: {str(r)[:limit]}"


def read_error(step_dir: pathlib.Path, step: int, error: BaseException | None,
               processes: list[int]) -> CheckpointReadError:
    """The error that stops the run: names the failed path (``error`` None: another process's)."""
    where = f"checkpoint step {step} in {step_dir.parent}"
    if error is None:
        return CheckpointReadError(f"{where} could not be read by process(es) {processes} (see their errors); "
                                   f"nothing on disk was changed", path=step_dir, step=step)
    path = failed_path(error, step_dir)
    out = CheckpointReadError(
        f"{where} could not be read: {path} ({describe(error)}). That does not prove the checkpoint "
        f"damaged, so nothing on disk was changed; fix the cause (permissions, storage) and run again",
        path=path, step=step)
    out.__cause__ = error
    return out


def missing_marker(step_dir: pathlib.Path, items) -> pathlib.Path | None:
    """The first of orbax's commit markers (the step's, then each item's) that is not a file."""
    for where in (step_dir, *(step_dir / item for item in items)):
        if not (where / COMMIT_FILE).is_file():
            return where / COMMIT_FILE
    return None


def unreadable_file(step_dir: pathlib.Path, block: int = 1 << 20) -> OSError | None:
    """Read every file under ``step_dir`` with Python's own I/O; the first OSError, or None when
    every byte reads back (listing a directory counts: ``os.walk`` would skip it silently)."""
    errors: list[OSError] = []
    for dirpath, _, files in os.walk(step_dir, onerror=errors.append):
        if errors:
            return errors[0]
        for name in sorted(files):
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    while fh.read(block):
                        pass
            except OSError as err:
                return err
    return errors[0] if errors else None
