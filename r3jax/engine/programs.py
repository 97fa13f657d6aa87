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
