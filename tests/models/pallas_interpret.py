"""Pallas's TPU interpreter, completed where JAX 0.10.2's cannot run the ragged paged attention kernel.

``pltpu.force_tpu_interpret_mode()`` runs a Mosaic kernel's body on CPU, with its DMAs, semaphores and
VMEM buffers simulated. In jax 0.10.2 two of the ragged paged attention kernel's memory accesses stop it:

- a read through a *reshaped* VMEM ref (``kv_bufs...wait().reshape(...)[start::step]``): the interpreter's
  ``get`` turns every ref transform into an index range and has no case for ``ReshapeTransform``
  (``'ReshapeTransform' object has no attribute 'indices'``);
- a masked store into a buffer whose later dims are smaller than its first: ``swap_buffer_content``
  clears its in-bounds mask along axis 0 for every axis, so an in-bounds masked store reads as
  out of bounds.

:func:`tpu_interpret` fills both gaps around the interpreter's own callbacks, without touching how
anything else is simulated: a read splits its transforms at the first non-index one, reads the indexed
prefix through the interpreter and applies the rest (reshape, then index) to the value read; a masked
store reads the range, merges ``where(mask, new, old)`` and stores unmasked, returning what a masked swap
returns. A kernel whose accesses the interpreter handles goes through unchanged.
"""

from __future__ import annotations

import contextlib

import numpy as np


def _private():
    """The interpreter's modules, or None where this JAX lays them out differently."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        from jax._src.pallas.mosaic.interpret import utils as iutils
        from jax._src.state import indexing, types
    except ImportError:
        return None
    if not all(hasattr(getattr(ipc, f, None), "__wrapped__") for f in ("get", "swap")) or not hasattr(
            ipc, "fail_on_exception"):
        return None
    return ipc, iutils, indexing, types


@contextlib.contextmanager
def tpu_interpret():
    """``force_tpu_interpret_mode()`` with reads through reshaped refs and masked stores completed
    (module docstring); on a JAX whose interpreter is laid out otherwise, the interpreter as it is."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    found = _private()
    if found is None:
        with pltpu.force_tpu_interpret_mode():
            yield
        return
    ipc, iutils, indexing, types = found
    get, swap = ipc.get, ipc.swap
    raw_get, raw_swap = get.__wrapped__, swap.__wrapped__

    def apply(t, val):
        if isinstance(t, indexing.NDIndexer):
            return val[iutils.to_range([t])]
        if isinstance(t, types.ReshapeTransform):
            return val.reshape(t.shape)
        raise NotImplementedError(f"interpreting a read through {type(t).__name__}")

    def read(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        ts = list(transforms)
        cut = next((i for i, t in enumerate(ts) if not isinstance(t, indexing.NDIndexer)), len(ts))
        token, val = raw_get(token, device_id, local_core_id, memory_space, buffer_id, tuple(ts[:cut]), *args,
                             **kwargs)
        for t in ts[cut:]:
            val = apply(jax.tree.map(int, t), val)
        return token, np.asarray(val)

    def store(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs):
        if mask is None:
            return raw_swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, None, **kwargs)
        mask, val = np.asarray(mask), np.asarray(val)
        token, old = read(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                          source_info=kwargs.get("source_info"))
        token, _ = raw_swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                            np.where(mask, val, old), None, **kwargs)
        return token, np.where(mask, old, val)  # a masked swap returns the new value where mask is off

    ipc.get, ipc.swap = ipc.fail_on_exception(read), ipc.fail_on_exception(store)
    try:
        with pltpu.force_tpu_interpret_mode():
            yield
    finally:
        ipc.get, ipc.swap = get, swap
