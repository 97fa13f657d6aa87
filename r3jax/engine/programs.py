"""Shape buckets and a record of the distinct programs they compile.

Batch size, prompt chunk and cache length are rounded up to powers of two, so a stream of varied
requests maps onto a small, bounded set of shapes; every other per-request quantity (lengths, sampling
parameters, seeds) travels as an array.
"""

from __future__ import annotations

from typing import Callable

import jax


def pow2_at_least(n: int, *, lo: int = 1, hi: int | None = None) -> int:
    """Smallest power of two >= max(n, lo), capped at hi (hi itself need not be a power of two)."""
    b = 1
    while b < max(n, lo):
        b *= 2
    return b if hi is None else min(b, hi)


def pow2_at_most(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CountedJit:
    """A jitted function plus a record of each distinct signature (static args; shapes, dtypes and
    shardings of the inputs) it is called with. jit compiles one program per signature, so
    ``len(signatures)`` counts the programs a caller needed (the jitted function may be shared, so
    another caller may have compiled them)."""

    def __init__(self, jitted: Callable, name: str, signatures: set, *, static_argnames=()):
        self._jit, self._name, self._signatures = jitted, name, signatures
        self._static = tuple(static_argnames)

    def __call__(self, *args, **kwargs):
        statics = tuple((k, kwargs[k]) for k in self._static if k in kwargs)
        dynamic = (args, {k: v for k, v in kwargs.items() if k not in self._static})
        leaves, treedef = jax.tree.flatten(dynamic)
        shapes = tuple((tuple(x.shape), str(x.dtype), _placement(x)) for x in leaves)
        self._signatures.add((self._name, statics, treedef, shapes))
        return self._jit(*args, **kwargs)

    def cache_size(self) -> int:
        """Programs jit itself holds for this function (a private counter, for cross-checks in tests)."""
        return self._jit._cache_size()


def _placement(x):
    """None for host arrays and arrays on the default device alone (jit treats them alike); else the
    sharding, which is part of what a program is compiled for."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or sharding.device_set == {jax.devices()[0]}:
        return None
    return sharding
