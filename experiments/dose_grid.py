"""The bookkeeping of a resumable experiment grid (experiments/replay_dose.py): one JSON file of
``runs["<setting>/<arm>"][seed]`` = per-step records, re-summarized on every write.

The file is the only state. Every read-modify-write holds an exclusive ``flock`` on ``<file>.lock``,
and a process claims a run (``claims["<cell>#<seed>"] = {host, pid, call}``) before it starts it, so several
processes given the same grid split its runs between them; the claim of a process that died is taken
over. The tests drive it with a stand-in run function.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Callable

from experiments import dose_summary as ds
from experiments.common import environment, run_provenance


def load(path: Path, fixed: dict) -> dict:
    """The stored grid at ``path`` (or a new one); refuses one whose fixed knobs differ."""
    if not path.exists():
        return {"fixed": fixed, "settings": {}, "runs": {}, "run_provenance": {}}
    result = json.loads(path.read_text())
    changed = {k: (result["fixed"].get(k), v) for k, v in fixed.items() if result["fixed"].get(k) != v}
    if changed:
        k, (old, new) = next(iter(changed.items()))
        raise SystemExit(f"{path}: stored grid has {k}={old!r}, this run asks {new!r}; pass --results "
                         "another file (or delete it) rather than mix two grids")
    return result


def save(path: Path, result: dict, command: str, summarize=None) -> dict:
    """Re-derive the summary (``summarize(runs, seeds_wanted, provenance)``, default the dose grid's) and
    write the result atomically (a kill mid-write leaves the old file)."""
    runs = result["runs"]
    result.update((summarize or ds.summarize)(runs, result["seeds_wanted"], result["run_provenance"]))
    # complete: every (cell, seed) any invocation asked for has finished
    result["complete"] = all(seed in runs.get(cell, {}) for cell, seed in
                             (g.rsplit("#", 1) for g in result["grid"]))
    prov = [p for per in result["run_provenance"].values() for p in per.values()]
    result.update(run_provenance())
    result["dirty"] = result["dirty"] or any(p["dirty"] for p in prov)
    result["commits"] = sorted({p["commit"] for p in prov})
    result["command"], result["environment"] = command, environment()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result


@contextlib.contextmanager
def _locked(path: Path):
    """Holds an exclusive lock on ``path``'s grid for one read-modify-write (flock: freed if we die)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _me() -> dict:
    """Who holds a claim: this host and process, and one ``run_grid`` call within it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "call": uuid.uuid4().hex}


def _alive(claim: dict) -> bool:
    """Whether the process holding a claim still runs (a claim from another host counts as alive)."""
    if claim.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(claim["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_superseded(result: dict, arm_defs: dict[str, dict]) -> list[str]:
    """Removes the stored runs of every arm in ``arm_defs`` whose provenance does not carry that arm's
    current definition (the runs of an earlier form); returns their ``"<cell>#<seed>"`` names."""
    dropped = []
    for cell in list(result["runs"]):
        want = arm_defs.get(cell.rsplit("/", 1)[1])
        if not want:
            continue
        prov = result["run_provenance"].setdefault(cell, {})
        for seed in list(result["runs"][cell]):
            if any(prov.get(seed, {}).get(k) != v for k, v in want.items()):
                del result["runs"][cell][seed]
                prov.pop(seed, None)
                dropped.append(f"{cell}#{seed}")
        if not result["runs"][cell]:
            del result["runs"][cell], result["run_provenance"][cell]
    return dropped


def run_grid(path: Path, fixed: dict, settings: list, arms: list[str], seeds: int,
             run_one: Callable[[object, str, int], list[dict]], *, command: str, on_done=None,
             arm_defs: dict[str, dict] | None = None, summarize=None) -> dict:
    """Run every missing (setting, arm, seed) of the grid, settings outermost (a stopped grid has whole
    settings), storing each run as it finishes. ``run_one(setting, arm, seed)`` -> per-step records.
    A cell is complete with ``seeds`` seeds (the latest invocation's number). ``arm_defs[arm]``: the
    definition each run of ``arm`` must carry (stored in its provenance; other runs of it are rerun).

    The file is the only state: each step locks it, reads it, changes it and writes it, so processes
    running the same grid share its runs and skip each other's claimed ones."""
    arm_defs, me = arm_defs or {}, _me()
    grid = [(f"{st.name}/{arm}", st, seed) for st in settings for seed in range(seeds) for arm in arms]

    def transact(change):
        with _locked(path):
            result = load(path, fixed)
            result.setdefault("claims", {})
            out = change(result)
            return save(path, result, command, summarize), out

    def register(result):
        for st in settings:
            result["settings"][st.name] = st.describe()
        result["seeds_wanted"] = seeds
        result["grid"] = list(dict.fromkeys(result.get("grid", []) + [f"{c}#{s}" for c, _, s in grid]))
        return drop_superseded(result, arm_defs)

    result, dropped = transact(register)
    if dropped:
        print(f"{path}: dropped {len(dropped)} stored runs of an earlier arm definition, to rerun: "
              + ", ".join(dropped))
    for cell, st, seed in grid:
        name = f"{cell}#{seed}"

        def claim(result):
            c = result["claims"].get(name)
            if str(seed) in result["runs"].get(cell, {}) or (c is not None and c != me and _alive(c)):
                return False  # finished, or running in another live call
            result["claims"][name] = me
            return True

        result, mine = transact(claim)
        if not mine:
            continue
        try:
            records = run_one(st, cell.rsplit("/", 1)[1], seed)
        except BaseException:
            transact(lambda r: r["claims"].pop(name, None))
            raise

        def store(result):
            result["runs"].setdefault(cell, {})[str(seed)] = records
            result["run_provenance"].setdefault(cell, {})[str(seed)] = {
                **run_provenance(), **arm_defs.get(cell.rsplit("/", 1)[1], {})}
            result["claims"].pop(name, None)

        result, _ = transact(store)
        if on_done is not None:
            on_done(cell, seed, records)
    return result


def resummarize(path: Path) -> dict:
    """``--summarize``: recompute the summary, tables and figure from the stored records."""
    with _locked(path):
        result = json.loads(path.read_text())
        result.update(ds.summarize(result["runs"], result["seeds_wanted"], result["run_provenance"]))
        path.write_text(json.dumps(result, indent=1))
    report(result, path)
    return result


def report(result: dict, path: Path) -> None:
    ds.plot(result, result["settings"], path.with_suffix(".png"))
    print(ds.tables(result))
    print(f"{path} ({'complete' if result.get('complete') else 'incomplete'} grid), {path.with_suffix('.png')}")
