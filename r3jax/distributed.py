"""Joining a multi-process JAX job: ``jax.distributed.initialize`` from flags or the environment.

One process per host (or per GPU): every process runs the same program, ``jax.devices()`` then lists
every process's devices, and a mesh over them is one global mesh (r3jax.sharding.make_mesh).
Call :func:`initialize` before anything touches a JAX device.

Sources, first found wins: the arguments (the CLI's ``--coordinator/--num-processes/--process-id``),
then ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``. ``num_processes="auto"``
leaves everything to JAX's cluster detection (Cloud TPU pods, SLURM, Open MPI, Kubernetes
indexed jobs): on a TPU pod ``jax.distributed.initialize()`` needs no arguments.
On CPU, processes talk through gloo (CPU collectives are otherwise in-process only).
"""

from __future__ import annotations

import os

import jax

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def _int(value, flag: str) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}={value!r}: expected an int") from None
    if isinstance(value, bool) or out < 0:
        raise ValueError(f"{flag}={value!r}: expected an int >= 0")
    return out


def resolve(coordinator: str | None = None, num_processes: int | str | None = None,
            process_id: int | None = None, environ=None) -> dict | None:
    """The arguments for ``jax.distributed.initialize``, or None for a single-process run (one
    process and no coordinator; with a coordinator, one process still joins a 1-process job).

    Returns ``{}`` for ``num_processes="auto"`` (cluster auto-detection; a coordinator, when
    given, is passed on). Raises ValueError naming the flag or variable that is missing or wrong.
    """
    env = os.environ if environ is None else environ
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    flags = {k: (v, f"--{k.replace('_', '-')}") for k, v in given.items() if v is not None}
    for k, var in ENV.items():
        if k not in flags and env.get(var):
            flags[k] = (env[var], var)
    n, n_src = flags.get("num_processes", (None, "--num-processes"))
    if n == "auto":
        return {"coordinator_address": flags["coordinator"][0]} if "coordinator" in flags else {}
    n = 1 if n is None else _int(n, n_src)
    if n < 1:
        raise ValueError(f"{n_src}={n}: expected an int >= 1, or 'auto'")
    if n == 1 and "coordinator" not in flags:
        return None
    if n == 1:  # a 1-process job: the same (gloo) collectives as a multi-process one
        flags.setdefault("process_id", (0, "--process-id"))
    missing = [f"--{k.replace('_', '-')} (or {ENV[k]})" for k in ("coordinator", "process_id")
               if k not in flags]
    if missing:
        raise ValueError(f"{n_src}={n} needs {' and '.join(missing)}")
    pid, pid_src = flags["process_id"]
    pid = _int(pid, pid_src)
    if pid >= n:
        raise ValueError(f"{pid_src}={pid}: expected a process id in [0, {n}) for {n} processes")
    addr, addr_src = flags["coordinator"]
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{addr_src}={addr!r}: expected HOST:PORT of process 0's coordinator")
    return {"coordinator_address": str(addr), "num_processes": n, "process_id": pid}


def initialize(coordinator: str | None = None, num_processes: int | str | None = None,
               process_id: int | None = None) -> bool:
    """Join the job described by the arguments or the environment (see :func:`resolve`).

    Returns False (and does nothing) for a single process. Must run before any JAX computation;
    every process blocks here until all ``num_processes`` have joined.
    """
    kwargs = resolve(coordinator, num_processes, process_id)
    if kwargs is None:
        return False
    # Only the CPU client reads this; without it CPU devices of different processes cannot
    # take part in one collective.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True
