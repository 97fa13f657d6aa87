"""Orbax checkpoints of the whole TrainState plus the data cursor: every N steps, keep the last k,
async saves, restore onto the current mesh; never lose a good checkpoint, never hide a failed write.

On disk, ``<dir>/<step>/state`` holds params, opt_state, step, rng (nested string-keyed dicts, see
tree_io) and ``<dir>/<step>/meta`` a JSON record with the data cursor and the run's settings.
Orbax writes each step into a temporary directory and renames it when complete, so an interrupted
save never has a step name; a step directory without orbax's ``commit_success.txt`` is incomplete.

Restore reads the step's metadata (tree, shapes, dtypes) and compares it with the template before
reading any array. A *different* state (another optimizer, model config or dtype) raises
:class:`CheckpointMismatchError` naming every difference and leaves the directory untouched. Only a
step proven incomplete or corrupt (a missing commit marker or file, bytes that cannot be decoded:
see checkpoint_damage) is renamed ``<step>.damaged`` so that training can fall back to the previous
step; any other read failure (permission denied, an I/O or network-filesystem error) raises
:class:`CheckpointReadError` naming the path, and nothing on disk changes.

A save that fails (directory gone, read-only or full; orbax's background write raising) raises
:class:`CheckpointWriteError` from the next call to ``save``/``wait``/``close`` (``save`` is called
every step, so the run stops at the next step) and from every call after it.

Several processes (``jax.distributed``): every process calls the same methods in the same order
(orbax saves and restores collectively; each process writes and reads its own shards of a directory
they all see). Host-side decisions are taken together: a read failure that is not damage on any
process stops every process; a step counts as damaged when it is on any process, only process 0
renames it, and the others wait for the rename. A checkpoint restores
onto a mesh of any process count (orbax reads whatever shards the new layout needs).
"""

from __future__ import annotations

import errno
import json
import logging
import pathlib
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from models.stacking import GROUPS as STACKED
from r3jax import tree_io
from r3jax.train import checkpoint_damage as damage
from r3jax.train.checkpoint_damage import CheckpointReadError
from r3jax.train.state import TrainState, state_shardings

_FORMAT = "r3jax.train.checkpoint/1"
_COMMIT_FILE = damage.COMMIT_FILE
_ITEMS = ("state", "meta")
_MAX_LISTED = 12  # differences named in one mismatch message
log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """The checkpoint holds a different state than the template (structure, shape or dtype).

    ``differences``: one line per difference, e.g. ``"opt_state/0/mu: only in the checkpoint"``.
    """

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = differences


class CheckpointWriteError(OSError):
    """A checkpoint save failed; training must not go on believing it is protected."""


def _outcomes(kind: int) -> np.ndarray:
    """Every process's ``kind`` (every process must call this, in the same order)."""
    if jax.process_count() == 1:
        return np.array([kind])
    return np.asarray(multihost_utils.process_allgather(np.array([kind], np.int32))).reshape(-1)


class _Sync:
    """Named barriers across processes (no-ops in a single process)."""

    def __init__(self):
        self._n = 0

    def __call__(self, what: str) -> None:
        if jax.process_count() > 1:
            self._n += 1
            multihost_utils.sync_global_devices(f"r3jax.checkpoint:{self._n}:{what}")


def _state_tree(state: TrainState) -> dict:
    return {"params": state.params, "rest": state.rest, "opt_state": state.opt_state,
            "step": state.step, "rng": state.rng}


def _spec(x) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in x.shape), str(np.dtype(x.dtype))


def _diff(on_disk: dict, template: dict) -> list[str]:
    """Differences between two ``{path: (shape, dtype)}`` maps, params first; a whole missing
    subtree is named once, by its top-most path."""
    def top(path, other):  # shortest prefix of path that ``other`` has no leaf under
        prefixes = {p[:i] for p in other for i in range(1, len(p) + 1)}
        return next(path[:i] for i in range(1, len(path) + 1) if path[:i] not in prefixes)

    found = []
    for name, a, b in (("checkpoint", on_disk, template), ("template", template, on_disk)):
        found += [(p, f"only in the {name}") for p in {top(p, b) for p in a if p not in b}]
    for p in set(on_disk) & set(template):
        if on_disk[p] != template[p]:
            (ds, dd), (ts, td) = on_disk[p], template[p]
            found.append((p, f"checkpoint {dd}{list(ds)}, template {td}{list(ts)}"))
    rank = {"params": 0, "rest": 1, "opt_state": 2}
    return [f"{'/'.join(p)}: {what}" for p, what in sorted(found, key=lambda f: (rank.get(f[0][0], 3), f[0]))]


def _layer_layout_hint(on_disk, template) -> str:
    """A sentence for a checkpoint whose decoder layers are in the other layout (models/stacking.py):
    ``params/layers/{i}`` (unrolled: ``scan_layers=False``, and every checkpoint written before scanned
    layers became the default) against ``params/moe_layers`` / ``params/dense_layers`` (scanned)."""
    def layout(paths):
        tops = {p[1] for p in paths if len(p) > 1 and p[0] == "params"}
        return ("layers" in tops, bool(tops & set(STACKED)))  # (unrolled, scanned)

    disk, want = layout(on_disk), layout(template)
    if disk == (True, False) and want == (False, True):
        return (" The checkpoint's layers are unrolled (params/layers/{i}: MoeConfig.scan_layers=False, or "
                "written before scanned layers became the default): restore it into a state built with "
                "scan_layers=False, or convert its trees with models.stacking.stack_layers.")
    if disk == (False, True) and want == (True, False):
        return (" The checkpoint's layers are scanned (params/moe_layers, MoeConfig.scan_layers=True): restore "
                "it into a state built with scan_layers=True, or convert with models.stacking.unstack_layers.")
    return ""


class Checkpointer:
    """``Checkpointer(directory, save_every=N, keep=k, async_save=True, config=None)``.

    ``save(state, data_cursor=...)`` writes when ``state.step`` is a multiple of N (or ``force``);
    ``restore_latest(template)`` returns ``(state, data_cursor)`` from the newest complete,
    readable step (None when there is none), placed like ``template`` on its mesh (or ``mesh``).
    config: JSON-serialisable run settings (e.g. ``{"lr": 1e-3}``) stored with every step; a restore
    under different settings is allowed and logged, and the changes are kept in ``config_changes``
    (``{name: (saved, current)}``).
    """

    def __init__(self, directory, *, save_every: int = 1, keep: int = 3, async_save: bool = True,
                 config: dict | None = None):
        for name, v in (("save_every", save_every), ("keep", keep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an int >= 1")
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"config={config!r}: expected a dict of JSON-serialisable settings or None")
        self._config = json.loads(json.dumps(config)) if config is not None else None
        self.config_changes: dict[str, tuple[Any, Any]] = {}
        self.directory = pathlib.Path(directory).absolute()
        self.save_every, self.keep = save_every, keep
        # Directories are created synchronously: when creation fails orbax's asynchronous variant
        # leaves non-daemon threads waiting 20 minutes for a signal that never comes (the process
        # then hangs at exit); this way the failure raises in save() instead.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=1, create=True, enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()  # so metadata reads need no save first
        for item, handler, save_args, restore_args in (
                ("state", ocp.StandardCheckpointHandler(), ocp.args.StandardSave, ocp.args.StandardRestore),
                ("meta", ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore)):
            registry.add(item, save_args, handler)
            registry.add(item, restore_args, handler)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._pending: int | None = None  # the step of the last started save, until verified
        self._failure: CheckpointWriteError | None = None
        self._sync = _Sync()

    # ---- saving ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.save_every == 0

    def save(self, state: TrainState, *, data_cursor: Any = None, force: bool = False) -> bool:
        """Save ``state`` at its step if due (or ``force``). Returns whether a save was started.

        With async saves this returns once the arrays are copied off the device, so the next
        (donating) train_step may run at once; call :meth:`wait` before reading the files.
        Raises CheckpointWriteError if this or an earlier save failed (checked on every call, due
        or not, without blocking on a save still in progress).
        data_cursor: any JSON-serialisable value (e.g. ``{"epoch": 1, "index": 512}``).
        """
        self._check_saves(block=False)
        step = int(jax.device_get(state.step))
        if not (force or self.should_save(step)) or step in self._mgr.all_steps():
            return False
        try:
            json.dumps(data_cursor)
        except TypeError as e:
            raise ValueError(f"data_cursor={data_cursor!r}: expected a JSON-serialisable value ({e})")
        meta = {"format": _FORMAT, "step": step, "data_cursor": data_cursor, "config": self._config}
        item = tree_io.to_nested(_state_tree(state))
        self._check_saves(block=True)  # orbax waits for the previous save here anyway
        try:
            started = self._mgr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(item), meta=ocp.args.JsonSave(meta)), force=True)
        except OSError as e:  # directory missing, not a directory, read-only, full
            raise self._fail(step, e) from e
        if started:
            self._pending = step
        return bool(started)

    def wait(self) -> None:
        """Block until every started save is on disk; raises CheckpointWriteError if one failed."""
        self._check_saves(block=True)

    def close(self) -> None:
        """Finish pending saves and release orbax's threads. Raises CheckpointWriteError for a
        failed save not reported yet (an already reported one is not raised again)."""
        reported = self._failure is not None
        try:
            self._check_saves(block=True)
        except CheckpointWriteError:
            if not reported:
                raise
        finally:
            self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_saves(self, *, block: bool) -> None:
        if self._failure is not None:
            raise self._failure
        if self._pending is None or (not block and self._mgr.is_saving_in_progress()):
            return
        step, self._pending = self._pending, None
        try:
            self._mgr.wait_until_finished()
        # The background write's own error, whatever orbax raised: re-raised below, never ignored.
        except Exception as e:  # noqa: BLE001
            raise self._fail(step, e) from e
        if not self._complete(step):  # orbax logs some commit failures instead of raising them
            raise self._fail(step, "the save finished without a committed step directory (see the "
                                   "orbax error logged above)")

    def _fail(self, step: int, cause) -> CheckpointWriteError:
        why = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        self._failure = CheckpointWriteError(
            f"checkpoint save of step {step} to {self.directory} failed ({why}); stopping rather than "
            f"training on without checkpoints")
        return self._failure

    # ---- restoring ---------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Steps that have a complete directory (named and committed), oldest first."""
        self._mgr.reload()
        return sorted(s for s in self._mgr.all_steps() if self._complete(s))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, template: TrainState, *, mesh: Mesh | None = None) -> tuple[TrainState, Any]:
        """Restore ``step`` into ``template``'s structure, sharded for ``mesh`` (default: the
        template's mesh, i.e. the current one). Returns ``(state, data_cursor)``.

        Raises CheckpointMismatchError (a ValueError) if the step holds a different tree, shape
        or dtype than ``template``, before any array is read; the read error itself if the step is
        damaged; CheckpointReadError for any other read failure. Nothing on disk is changed.
        """
        out, damaged = self._attempt(step, template, mesh)
        if damaged is None:
            return out
        why, error = damaged
        if error is not None:
            raise error from None
        raise OSError(f"checkpoint step {step} in {self.directory} {why} (see their errors)")

    def restore_latest(self, template: TrainState, *, mesh: Mesh | None = None) -> tuple[TrainState, Any] | None:
        """The newest step that restores cleanly, or None if the directory holds none.

        A step proven damaged -- no commit marker (step's or item's), a file missing, bytes that
        cannot be decoded (see checkpoint_damage) -- is skipped with a warning and renamed
        ``<step>.damaged`` (later saves of that step number then cannot collide with it). A readable
        step that does not match ``template`` raises CheckpointMismatchError, and any other read
        failure (permission denied, an I/O or network-filesystem error) raises CheckpointReadError
        naming the path; then nothing on disk changes.
        """
        self.wait()  # never race a save this process started
        self._sync("restore_latest")  # every process has finished its saves before anyone lists
        self._mgr.reload()
        steps = sorted(self._mgr.all_steps(), reverse=True)
        self._sync("listed")  # ... and everyone has listed before process 0 renames anything
        for step in steps:
            out, damaged = self._attempt(step, template, mesh)
            if damaged is None:
                return out
            self._quarantine(step, damaged[0])
        return None

    def _attempt(self, step, template, mesh):
        """Restore ``step`` on every process together: ``(out, None)``, or ``(None, (why, error))``
        when it is proven damaged on some process (``error``: this process's, None where it read
        the step). Raises CheckpointReadError on every process when a read failed on any of them for
        another reason."""
        step_dir, attempt = self.directory / str(step), 0
        while True:
            attempt += 1
            out, kind, error, why = None, damage.OK, None, None
            marker = damage.missing_marker(step_dir, _ITEMS)
            if marker is not None:
                kind, why = damage.DAMAGED, f"has no {marker.relative_to(step_dir)} (an interrupted save)"
                error = FileNotFoundError(errno.ENOENT, why, str(marker))
            else:
                try:
                    out = self._restore(step, template, mesh)
                except damage.Unreadable as e:
                    kind, error = e.kind, e.__cause__
                    if kind == damage.UNDECODABLE:  # storage's fault or the bytes'? read them ourselves
                        unreadable = damage.unreadable_file(step_dir)
                        if unreadable is not None:
                            kind, error = damage.NOT_DAMAGE, unreadable
                    why = f"could not be read ({damage.describe(error)})"
            kinds = _outcomes(kind)
            elsewhere = [int(i) for i in np.flatnonzero(kinds != damage.OK)]
            if kinds.max() == damage.NOT_DAMAGE:
                raise damage.read_error(step_dir, step, error if kind == damage.NOT_DAMAGE else None,
                                        [int(i) for i in np.flatnonzero(kinds == damage.NOT_DAMAGE)])
            if kinds.max() == damage.OK:
                return out, None
            if kinds.max() == damage.DAMAGED or attempt == 2:
                return None, (why or f"could not be read by process(es) {elsewhere}", error)
            # Only undecodable bytes, and every file reads back: read once more (every process, as
            # orbax restores collectively) so that a transient read error cannot pass for damage.
            log.warning("checkpoint step %d in %s could not be read (%s); every file reads back, trying "
                        "once more", step, self.directory, damage.describe(error) if error else "elsewhere")

    def _restore(self, step, template, mesh):
        mesh = template.mesh if mesh is None else mesh
        sh = state_shardings(template, mesh)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                template, sh)
        target = tree_io.to_nested(_state_tree(abstract))
        meta = self._read(step, lambda: self._mgr.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("step") != step:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} has meta={meta!r}: expected format "
                f"{_FORMAT!r} and step {step} (nothing on disk was changed)", ["meta"])
        items = self._read(step, lambda: self._mgr.item_metadata(step))
        on_disk = items["state"] if "state" in items.keys() else None
        if on_disk is None:  # no state item, or orbax found no tree metadata file
            raise damage.Unreadable(damage.DAMAGED) from FileNotFoundError(
                errno.ENOENT, "no tree metadata", str(self.directory / str(step) / "state" / "_METADATA"))
        disk_specs = {p: _spec(x) for p, x in tree_io.flatten_nested(on_disk).items()}
        want_specs = {p: _spec(x) for p, x in tree_io.flatten_nested(target).items()}
        diffs = _diff(disk_specs, want_specs)
        if diffs:
            listed = "; ".join(diffs[:_MAX_LISTED]) + (f"; and {len(diffs) - _MAX_LISTED} more"
                                                       if len(diffs) > _MAX_LISTED else "")
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} holds a different training state than the "
                f"one it is restored into (changed optimizer, model config or dtype?): {listed}. Nothing "
                f"on disk was changed; restore with the original settings or use another directory."
                + _layer_layout_hint(disk_specs, want_specs), diffs)
        out = self._read(step, lambda: self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state)
        self._note_config(step, meta.get("config"))
        tree = tree_io.from_nested(out, _state_tree(abstract))
        return template.replace(**tree), meta["data_cursor"]

    def _read(self, step: int, fn):
        try:
            return fn()
        except CheckpointMismatchError:
            raise
        # Whatever orbax raised is classified (damage or not) and never dropped: _attempt re-raises
        # it, or the CheckpointReadError that wraps it, unless the step is proven damaged.
        except Exception as e:  # noqa: BLE001
            raise damage.Unreadable(damage.classify(e)) from e

    def _note_config(self, step: int, saved: dict | None) -> None:
        current = self._config
        if saved is None or current is None:
            self.config_changes = {}
            return
        keys = sorted(set(saved) | set(current))
        self.config_changes = {k: (saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)}
        if self.config_changes:
            log.warning("resuming from checkpoint step %d in %s with changed settings: %s", step, self.directory,
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.config_changes.items()))

    def _complete(self, step: int) -> bool:
        return (self.directory / str(step) / _COMMIT_FILE).is_file()

    def _quarantine(self, step: int, why: str) -> None:
        """Rename ``<step>`` to ``<step>.damaged`` (process 0 only; everyone waits for it)."""
        src = self.directory / str(step)
        dst = self.directory / f"{step}.damaged"
        n = 1
        while dst.exists():
            dst, n = self.directory / f"{step}.damaged-{n}", n + 1
        warnings.warn(f"checkpoint step {step} in {self.directory} {why}; moved to {dst.name} and "
                      f"falling back to an earlier step", RuntimeWarning, stacklevel=3)
        self._sync(f"quarantine {step}")  # every process has named dst before it exists
        if jax.process_index() == 0:
            src.rename(dst)
        self._sync(f"quarantined {step}")
        self._mgr.reload()
