"""Orbax checkpoints of the whole TrainState plus the data cursor: every N steps, keep the last k,
async saves, restore onto the current mesh, and fall back past incomplete or damaged steps.

On disk, ``<dir>/<step>/state`` holds params, opt_state, step, rng (nested string-keyed dicts, see
tree_io) and ``<dir>/<step>/meta`` a JSON record with the data cursor. Orbax writes each step into a
temporary directory and renames it when complete, so an interrupted save never has a step name;
a step directory without orbax's ``commit_success.txt`` is treated as incomplete as well.
Single-process (one host) checkpointing.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from r3jax.train import tree_io
from r3jax.train.state import TrainState, state_shardings

_FORMAT = "r3jax.train.checkpoint/1"
_COMMIT_FILE = "commit_success.txt"


def _state_tree(state: TrainState) -> dict:
    return {"params": state.params, "rest": state.rest, "opt_state": state.opt_state,
            "step": state.step, "rng": state.rng}


class Checkpointer:
    """``Checkpointer(directory, save_every=N, keep=k, async_save=True)``.

    ``save(state, data_cursor=...)`` writes when ``state.step`` is a multiple of N (or ``force``);
    ``restore_latest(template)`` returns ``(state, data_cursor)`` from the newest complete,
    readable step (None when there is none), placed like ``template`` on its mesh (or ``mesh``).
    """

    def __init__(self, directory, *, save_every: int = 1, keep: int = 3, async_save: bool = True):
        for name, v in (("save_every", save_every), ("keep", keep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an int >= 1")
        self.directory = pathlib.Path(directory).absolute()
        self.save_every, self.keep = save_every, keep
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1, create=True,
                                               enable_async_checkpointing=async_save)
        self._mgr = ocp.CheckpointManager(self.directory, options=options)

    # ---- saving ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.save_every == 0

    def save(self, state: TrainState, *, data_cursor: Any = None, force: bool = False) -> bool:
        """Save ``state`` at its step if due (or ``force``). Returns whether a save was started.

        With async saves this returns once the arrays are copied off the device, so the next
        (donating) train_step may run at once; call :meth:`wait` before reading the files.
        data_cursor: any JSON-serialisable value (e.g. ``{"epoch": 1, "index": 512}``).
        """
        step = int(jax.device_get(state.step))
        if not (force or self.should_save(step)) or step in self._mgr.all_steps():
            return False
        try:
            json.dumps(data_cursor)
        except TypeError as e:
            raise ValueError(f"data_cursor={data_cursor!r}: expected a JSON-serialisable value ({e})")
        meta = {"format": _FORMAT, "step": step, "data_cursor": data_cursor}
        item = tree_io.to_nested(_state_tree(state))
        return bool(self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(item), meta=ocp.args.JsonSave(meta)), force=True))

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
        template's mesh, i.e. the current one). Returns ``(state, data_cursor)``."""
        mesh = template.mesh if mesh is None else mesh
        sh = state_shardings(template, mesh)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                template, sh)
        target = tree_io.to_nested(_state_tree(abstract))
        out = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        meta = out.meta
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("step") != step:
            raise ValueError(f"checkpoint step {step} meta={meta!r}: expected format {_FORMAT!r} "
                             f"and step {step}")
        tree = tree_io.from_nested(out.state, _state_tree(abstract))
        return template.replace(**tree), meta["data_cursor"]

    def restore_latest(self, template: TrainState, *, mesh: Mesh | None = None) -> tuple[TrainState, Any] | None:
        """The newest step that restores cleanly, or None if the directory holds none.

        A step directory without a commit marker or one that fails to restore (truncated or
        missing files, wrong structure) is skipped with a warning and renamed ``<step>.damaged``
        so that later saves of that step number cannot collide with it.
        """
        self.wait()  # never race a save this process started
        self._mgr.reload()
        for step in sorted(self._mgr.all_steps(), reverse=True):
            if not self._complete(step):
                self._quarantine(step, f"has no {_COMMIT_FILE} (an interrupted save)")
                continue
            try:
                return self.restore(step, template, mesh=mesh)
            except Exception as e:  # noqa: BLE001 - any read failure means "damaged": fall back
                self._quarantine(step, f"could not be restored ({type(e).__name__}: {str(e)[:300]})")
        return None

    def _complete(self, step: int) -> bool:
        return (self.directory / str(step) / _COMMIT_FILE).is_file()

    def _quarantine(self, step: int, why: str) -> None:
        src = self.directory / str(step)
        dst = self.directory / f"{step}.damaged"
        n = 1
        while dst.exists():
            dst, n = self.directory / f"{step}.damaged-{n}", n + 1
        warnings.warn(f"checkpoint step {step} in {self.directory} {why}; moved to {dst.name} and "
                      f"falling back to an earlier step", RuntimeWarning, stacklevel=3)
        src.rename(dst)
        self._mgr.reload()
