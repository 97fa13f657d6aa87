"""Shape buckets and the engine's fixed set of compiled device programs.

Every shape a program sees comes from the engine's configuration (decode-row and prefill-row buckets,
page tables, prefill chunk, decode steps), never from traffic, so the set of programs is
known before the first request and warm-up (:meth:`r3jax.engine.Engine.warmup`) compiles all of them.
Programs are compiled ahead of time (``jit(...).lower(...).compile()``) and called directly, so a call
with any other shape or placement fails loudly instead of compiling quietly.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import jax

from r3jax.engine.program_cache import watch_cache_hits


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest of ``sizes`` (ascending) that is >= n (the last one if none is)."""
    for size in sizes:
        if size >= n:
            return size
    return sizes[-1]


DEFAULT_PREFILL_ROWS = 16


def default_prefill_rows(max_batch_size: int) -> int:
    """An engine's ``prefill_rows`` when neither it nor ``max_num_batched_tokens`` is given: 16 when at
    least 12 requests run at once, else 4. A step takes more than 4 rows only for that many distinct
    prompts (:meth:`r3jax.engine.Engine.prefill_rows_for`), and :func:`fill` takes 16 rows for 12 or
    more, so a smaller engine would compile a 16-row step it never runs (an 8-request engine did). Nor
    does it get an intermediate bucket of ``max_batch_size`` rows: 8-row steps beside 8 decode rows
    made bench_paged's mixed workload worse than steps of 4 (CHANGELOG has the runs)."""
    big = fill(max_batch_size, prefill_buckets(DEFAULT_PREFILL_ROWS)) > 4
    return DEFAULT_PREFILL_ROWS if big else 4


def prefill_buckets(prefill_rows: int) -> list[int]:
    """Prefill-row buckets of an engine of at most ``prefill_rows`` rows per step: 0 (the decode loop),
    the powers of 4 from 4 below ``prefill_rows``, and ``prefill_rows`` itself (16: [0, 4, 16]; 2: [0, 2]).
    No bucket of one row: next to the decode rows a step carries (B, with the default
    ``mixed_decode_buckets``) 4 rows cost it little more than 1 (``python -m experiments.serve_start``
    times both), and each bucket is a program to compile at start."""
    sizes, b = {0, prefill_rows}, 4
    while b < prefill_rows:
        sizes.add(b)
        b *= 4
    return sorted(sizes)


def fill(n: int, sizes: list[int]) -> int:
    """Prefill rows a step takes when ``n`` prompt chunks are ready, among ``sizes`` (ascending, from
    :func:`prefill_buckets`): all of them when their bucket pads at most a third of ``n`` rows (or no
    smaller bucket exists), else as many as the largest bucket below ``n`` holds (the rest go in a
    later step); at most the largest bucket. A padded row costs ``prefill_chunk`` tokens of work for nothing, a step more its decode
    rows and fixed cost: of [0, 4, 16], 8 ready chunks take 4 rows, 12 take all 12 (16 rows)."""
    if n <= 0:
        return 0
    up = bucket(n, sizes)
    if up < n:
        return up
    down = max((s for s in sizes if 0 < s <= n), default=None)
    return n if down is None or 3 * (up - n) <= n else down


# Compiled programs shared by every live engine of an equal configuration (a rebuilt engine, a second
# engine in one process, a test suite), so none compiles twice. Key: (engine key, program name, bucket);
# value: [executable, engines holding it]. An entry goes when the last engine holding it is closed: a
# live XLA executable keeps its code mapped, and a long-lived process that builds many engines (a test
# run, a sweep) would otherwise keep every program it ever compiled.
_SHARED: dict[Hashable, list] = {}
_SHARED_LOCK = threading.Lock()


def shared_programs() -> int:
    """Programs held in the process-wide cache (by live, unclosed engines)."""
    with _SHARED_LOCK:
        return len(_SHARED)


class Programs:
    """The compiled programs one engine uses. ``run(name, bucket, build, *args)`` calls the program
    ``(name, bucket)``, compiling it on first use from ``build() -> (fn, jit_kwargs)`` lowered at
    ``args``. ``len(self)`` is the number of distinct programs this engine has needed; :meth:`release`
    (``Engine.close``) drops them, and the process-wide cache frees those no other engine holds."""

    def __init__(self, engine_key: Hashable, disk=None):
        self._key = engine_key
        self._disk = disk  # a ProgramCache (r3jax.engine.program_cache), or None
        self._exe: dict[tuple, Any] = {}
        self._needed: set[tuple] = set()  # kept after release: stats still count them
        self._released = False
        self.compiles = 0  # programs this process built for this engine (0 when shared ones were reused)

    def __len__(self) -> int:
        return len(self._needed)

    def __contains__(self, name_bucket: tuple) -> bool:
        return name_bucket in self._needed

    def get(self, name: str, bucket_key: Hashable, build: Callable[[], tuple[Callable, dict]], *args):
        key = (name, bucket_key)
        exe = self._exe.get(key)
        if exe is None:
            if self._released:
                raise RuntimeError("engine programs released (the engine is closed)")
            shared = (self._key, key)
            with _SHARED_LOCK:
                entry = _SHARED.get(shared)
                if entry is None:
                    exe = None if self._disk is None else self._disk.load(name, bucket_key, args)
                    if exe is None:
                        fn, kw = build()
                        with watch_cache_hits() as from_jax_cache:
                            exe = jax.jit(fn, **kw).lower(*args).compile()
                        if self._disk is not None and not from_jax_cache():  # see program_cache: not storable
                            self._disk.save(name, bucket_key, args, exe)
                    entry = _SHARED[shared] = [exe, 0]
                    self.compiles += 1
                entry[1] += 1
                exe = entry[0]
            self._exe[key] = exe
            self._needed.add(key)
        return exe

    def run(self, name: str, bucket_key: Hashable, build, *args):
        return self.get(name, bucket_key, build, *args)(*args)

    def release(self) -> None:
        """Drop this engine's programs; the shared cache frees each one no other live engine holds."""
        with _SHARED_LOCK:
            if self._released:
                return
            self._released = True
            for key in self._exe:
                entry = _SHARED.get((self._key, key))
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del _SHARED[(self._key, key)]
            self._exe.clear()
