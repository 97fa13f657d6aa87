"""A run directory's ``metrics.jsonl`` (one JSON object per step, with ``"step"``) and its neighbours:
what resuming keeps of a log, and how a fresh start sets an earlier run's files aside instead of
overwriting them. Shared by ``python -m r3jax demo`` and ``python -m r3jax train``."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_lines(path: Path) -> list[str]:
    """The non-empty lines of ``path`` (none if it does not exist), each ending in a newline."""
    return [line if line.endswith("\n") else line + "\n"
            for line in (path.read_text().splitlines() if path.exists() else []) if line.strip()]


def rewrite(path: Path, lines: list[str]) -> None:
    """Replace ``path``'s contents with ``lines`` atomically: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


def keep_until(path: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (a resumed run re-runs them)."""
    rewrite(path, [x for x in read_lines(path) if json.loads(x)["step"] <= step])


def keep_aside(path: Path) -> Path | None:
    """Rename an existing non-empty file or directory to ``<name>.<n>`` (first free n); returns
    the new path, or None if there was nothing to keep."""
    if not path.exists() or (path.read_text().strip() == "" if path.is_file() else not any(path.iterdir())):
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    dst = path.with_name(f"{path.name}.{n}")
    path.rename(dst)
    return dst
