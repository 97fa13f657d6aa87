"""The engine's compiled programs on disk, loaded on restart without tracing or lowering them.

JAX's persistent compilation cache keys an executable by its lowered module, so a restart still
traces and lowers every program before the cache can answer (most of a warm restart's time). This
cache keys a program by what determines it instead, and loads the serialized executable
(:mod:`jax.experimental.serialize_executable`) directly:

- the JAX and jaxlib versions, the backend, its devices and ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS``;
- the model's graph definition (its module types and every static attribute, configuration included);
- every argument's shape, dtype and sharding (parameters, pool, inputs);
- the engine configuration (the program name and its layout, decode steps, stop width, ...);
- the source of the code that traces it: every file of :mod:`models` and :mod:`r3jax.engine`, and
  the module defining the model's class.

A key that misses loads nothing: the program is compiled and stored, unless JAX's persistent cache
answered that compile (:func:`watch_cache_hits`): on XLA:CPU an executable JAX loaded from its own cache
serializes without its compiled functions, and a later process that loads it fails at its first run
("Function ... not found"). Such a program comes from JAX's cache on the next start too. A file that cannot be
read back (truncated, another JAX) is compiled over. Entries are written to a temporary name and
renamed, so a reader never sees half of one. Loading an entry runs code from it, as JAX's own cache
does: keep the directory as private as the code itself.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger("r3jax.engine")
VERSION = 2  # of the entry format and the key (2: no entry from JAX's cache; 1 may hold broken ones)


_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_watch = threading.local()
_listening = threading.Lock()
_listener = None


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT and getattr(_watch, "on", False):
        _watch.hit = True


@contextlib.contextmanager
def watch_cache_hits():
    """Yields a callable answering whether a compile in the block (this thread) was a hit of JAX's
    persistent compilation cache (``jax.monitoring``'s cache-hit event)."""
    global _listener
    with _listening:
        if _listener is None:
            jax.monitoring.register_event_listener(_on_event)
            _listener = _on_event
    _watch.on, _watch.hit = True, False
    try:
        yield lambda: _watch.hit
    finally:
        _watch.on = False


@functools.lru_cache(maxsize=None)
def _source_digest(extra: tuple[str, ...]) -> str:
    """sha256 over the Python sources of models/, r3jax/engine/ and ``extra`` files (sorted paths)."""
    import models
    import r3jax.engine

    files = set(extra)
    for pkg in (models, r3jax.engine):
        files.update(str(p) for p in Path(pkg.__file__).parent.rglob("*.py"))
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode())
        try:
            h.update(Path(path).read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


def _devices(args: tuple) -> list | None:
    """The devices a program over ``args`` runs on, in its device assignment's order (a mesh's flat
    order, or the one device), or None to let JAX pick."""
    for leaf in jax.tree.leaves(args):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding):
            return list(sh.mesh.devices.flat)
        if isinstance(sh, jax.sharding.SingleDeviceSharding):
            return list(sh.device_set)
    return None


def _signature(args: tuple) -> str:
    leaves = jax.tree.leaves(args)
    return repr([(tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None))) for a in leaves])


def fingerprint(model_type: type, graphdef: Any, engine_key: tuple) -> str:
    """The part of every key one engine shares: platform, code, model and configuration."""
    try:
        model_file = (inspect.getsourcefile(model_type) or "",)
    except TypeError:  # a class without a source file
        model_file = ()
    import jaxlib

    devices = jax.devices()
    h = hashlib.sha256()
    for part in (f"r3jax-programs/{VERSION}", jax.__version__, jaxlib.__version__, jax.default_backend(),
                 repr(sorted({d.device_kind for d in devices})), str(len(devices)),
                 os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                 _source_digest(tuple(f for f in model_file if f)), repr(graphdef), repr(engine_key)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class ProgramCache:
    """Serialized executables under ``directory``; ``load`` / ``save`` by (fingerprint, name, bucket, args)."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.loaded = 0  # programs this cache supplied

    def _path(self, name: str, bucket_key: Any, args: tuple) -> Path:
        h = hashlib.sha256(f"{self.fingerprint}\0{name}\0{bucket_key!r}\0{_signature(args)}".encode())
        return self.dir / f"{name}-{h.hexdigest()[:40]}.bin"

    def load(self, name: str, bucket_key: Any, args: tuple):
        """The compiled program, or None when it is not stored or cannot be loaded."""
        path = self._path(name, bucket_key, args)
        if not path.exists():
            return None
        from jax.experimental import serialize_executable

        try:
            with open(path, "rb") as f:
                payload, out_tree = pickle.load(f)
            exe = serialize_executable.deserialize_and_load(payload, jax.tree.structure((args, {})), out_tree,
                                                            execution_devices=_devices(args))
        except Exception as e:  # noqa: BLE001 - a bad entry is compiled over, never fatal
            log.warning("program cache: %s not loaded (%s: %s); compiling it", path.name, type(e).__name__, e)
            return None
        self.loaded += 1
        return exe

    def save(self, name: str, bucket_key: Any, args: tuple, compiled) -> None:
        from jax.experimental import serialize_executable

        path = self._path(name, bucket_key, args)
        try:
            payload, _, out_tree = serialize_executable.serialize(compiled)
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump((payload, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as e:  # noqa: BLE001 - the program runs anyway; only the next start is slower
            log.warning("program cache: %s not stored (%s: %s)", path.name, type(e).__name__, e)
