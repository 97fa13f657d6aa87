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


def run_local(num_processes: int, argv: Sequence[str], *, devices_per_process: int, timeout: float = 300.0,
              env: dict | None = None, cwd: str | None = None) -> list[ProcessResult]:
    """Run ``python -m r3jax train *argv`` as ``num_processes`` processes joined through a coordinator
    on 127.0.0.1 (``num_processes=1`` runs one plain process). Returns one result per process.

    Raises LocalJobError (with every process's output) when one exits non-zero (the others are
    killed at once rather than left waiting for a peer that is gone) or ``timeout`` seconds pass.
    No process outlives this call.
    """
    port = free_port()
    base = dict(os.environ if env is None else env)
    procs, logs = [], []
    try:
        for i in range(num_processes):
            cmd = [sys.executable, "-m", "r3jax", "train", *argv, "--local-devices", str(devices_per_process)]
            if num_processes > 1:
                cmd += ["--num-processes", str(num_processes), "--process-id", str(i),
                        "--coordinator", f"127.0.0.1:{port}"]
            logs.append(tempfile.TemporaryFile("w+"))
            procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=base, cwd=cwd))
        deadline = time.monotonic() + timeout
        failed = None
        pending = list(procs)
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
                    failed = f"process {procs.index(p)} exited with status {p.returncode}"
                    break
    finally:
        for p in procs:  # on success they have all exited; otherwise stop the rest now
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        results.append(ProcessResult(i, p.returncode, log.read()))
        log.close()
    if failed is not None:
        tails = "\n".join(f"--- process {r.process_id} (status {r.returncode}) ---\n{r.output[-3000:]}"
                          for r in results)
        raise LocalJobError(f"local {num_processes}-process job {failed}:\n{tails}", results)
    return results
