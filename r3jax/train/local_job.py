"""A multi-host rehearsal on one machine: N ``python -m r3jax train`` processes on a loopback
coordinator, each with its own simulated CPU devices; all of them stopped if one fails or time runs out.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence


@dataclasses.dataclass
class ProcessResult:
    process_id: int
    returncode: int
    output: str  # stdout and stderr together


class LocalJobError(RuntimeError):
    def __init__(self, message: str, results: list[ProcessResult]):
        super().__init__(message)
        self.results = results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalJob:
    """``python -m r3jax train *argv`` as ``num_processes`` processes joined through a coordinator on
    127.0.0.1 (``num_processes=1`` too: one process in a 1-process job, with the same gloo
    collectives as several; ``distributed=False`` runs one plain process instead, with XLA's
    in-process collectives). Started on construction; :meth:`wait` collects it, :meth:`kill` stops
    whatever still runs (also on exit from a ``with`` block), so no process outlives its owner.
    """

    def __init__(self, num_processes: int, argv: Sequence[str], *, devices_per_process: int,
                 env: dict | None = None, cwd: str | None = None, distributed: bool = True):
        if not distributed and num_processes != 1:
            raise ValueError(f"distributed=False with num_processes={num_processes}: expected 1 process")
        port = free_port()
        self.num_processes = num_processes
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        try:
            for i in range(num_processes):
                cmd = [sys.executable, "-m", "r3jax", "train", *argv, "--local-devices", str(devices_per_process)]
                if distributed:
                    cmd += ["--num-processes", str(num_processes), "--process-id", str(i),
                            "--coordinator", f"127.0.0.1:{port}"]
                self.logs.append(tempfile.TemporaryFile("w+"))
                self.procs.append(subprocess.Popen(cmd, stdout=self.logs[-1], stderr=subprocess.STDOUT,
                                                   env=dict(os.environ if env is None else env), cwd=cwd))
        except BaseException:
            self.kill()
            raise

    def wait(self, timeout: float = 300.0) -> list[ProcessResult]:
        """Block until every process exits; returns one result per process. Raises LocalJobError
        (with every process's output) when one exits non-zero (the others are killed at once
        rather than left waiting for a peer that is gone) or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        failed, pending = None, list(self.procs)
        try:
            while pending and failed is None:
                for p in list(pending):
                    try:
                        p.wait(timeout=max(0.05, min(0.5, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        if time.monotonic() > deadline:
                            failed = f"timed out after {timeout:.0f} s"
                            break
                        continue
                    pending.remove(p)
                    if p.returncode != 0:
                        failed = f"process {self.procs.index(p)} exited with status {p.returncode}"
                        break
        finally:
            self.kill()
        results = []
        for i, (p, log) in enumerate(zip(self.procs, self.logs)):
            log.seek(0)
            results.append(ProcessResult(i, p.returncode, log.read()))
        if failed is not None:
            tails = "\n".join(f"--- process {r.process_id} (status {r.returncode}) ---\n{r.output[-3000:]}"
                              for r in results)
            raise LocalJobError(f"local {self.num_processes}-process job {failed}:\n{tails}", results)
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def run_local(num_processes: int, argv: Sequence[str], *, devices_per_process: int, timeout: float = 300.0,
              env: dict | None = None, cwd: str | None = None) -> list[ProcessResult]:
    """Start a :class:`LocalJob` and wait for it (see there)."""
    with LocalJob(num_processes, argv, devices_per_process=devices_per_process, env=env, cwd=cwd) as job:
        return job.wait(timeout)
