"""Where a run's step metrics go: ``metrics.jsonl`` always, TensorBoard event files with
``--tensorboard DIR``, Weights & Biases with ``--wandb PROJECT``.

    with MetricWriters(run_dir / "metrics.jsonl", tensorboard="tb", wandb=None, run_name="rollout-seed0") as w:
        w.write({"step": 1, "reward": 0.5, "k3_kl": 1e-4, ...})

A record is one JSON object per step with an int ``"step"``. ``metrics.jsonl`` gets it whole; the
other writers get its numbers (:func:`scalars`: nested dicts and lists flattened to ``a/b`` and
``a/0`` tags, booleans and strings left out). TensorBoard event files are written here (TFRecord
framing of ``Event`` protos, the format TensorBoard's own reader reads), so they need no package;
viewing them needs ``tensorboard``. W&B needs the ``wandb`` package and says so when it is missing.
In a multi-process job only process 0 writes (``primary``).
"""

from __future__ import annotations

import json
import numbers
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Mapping


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``record`` by tag (``step`` left out): nested mappings and lists flattened."""
    out: dict[str, float] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if tag == "step" or isinstance(value, (bool, str)) or value is None:
            continue
        if isinstance(value, Mapping):
            out.update(scalars(value, tag + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(scalars({str(i): v for i, v in enumerate(value)}, tag + "/"))
        elif isinstance(value, numbers.Real):
            out[tag] = float(value)
    return out


# ---- TensorBoard event files -----------------------------------------------------------------------
def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative ints
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint(number << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _event(wall_time: float, step: int | None = None, *, file_version: str | None = None,
           values: Mapping[str, float] | None = None) -> bytes:
    """A serialized ``tensorflow.Event``: wall_time (1), step (2), file_version (3), summary (5) of
    ``Summary.Value`` tag (1) / simple_value (2)."""
    out = _field(1, 1, struct.pack("<d", wall_time))
    if step is not None:
        out += _field(2, 0, _varint(step))
    if file_version is not None:
        out += _field(3, 2, file_version.encode())
    if values:
        summary = b"".join(_field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
                           for tag, v in values.items())
        out += _field(5, 2, summary)
    return out


def _record(data: bytes) -> bytes:
    """TFRecord framing: length, its masked CRC, the data, its masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked(crc32c(header))) + data + struct.pack("<I", _masked(crc32c(data)))


class TensorBoardWriter:
    """Scalars into a new ``events.out.tfevents.*`` file under ``logdir`` (one per writer)."""

    def __init__(self, logdir: str | os.PathLike):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}.r3jax"
        self.path = self.logdir / name
        self._f = open(self.path, "ab")
        self._f.write(_record(_event(time.time(), file_version="brain.Event:2")))
        self._f.flush()

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if values:
            self._f.write(_record(_event(time.time(), int(step), values=values)))
            self._f.flush()

    def close(self) -> None:
        self._f.close()


# ---- Weights & Biases -----------------------------------------------------------------------------
class WandbWriter:
    """One W&B run: ``wandb.init(project=, name=, config=)``, ``wandb.log(values, step=)``."""

    def __init__(self, project: str, run_name: str, config: Mapping[str, Any] | None = None):
        try:
            import wandb
        except ImportError:
            raise ImportError(f"--wandb {project}: the wandb package is not installed (pip install wandb); "
                              "or log with --tensorboard DIR, which needs no package") from None
        self._run = wandb.init(project=project, name=run_name, config=dict(config or {}), reinit=True)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=int(step))

    def close(self) -> None:
        self._run.finish()


# ---- all of them -------------------------------------------------------------------------------------
class MetricWriters:
    """``metrics.jsonl`` plus the writers asked for. ``primary=False`` (a process other than 0 of a
    multi-process job): nothing is written at all."""

    def __init__(self, jsonl: str | os.PathLike, *, tensorboard: str | os.PathLike | None = None,
                 wandb: str | None = None, run_name: str = "run", config: Mapping[str, Any] | None = None,
                 primary: bool = True):
        self.jsonl = Path(jsonl)
        self._log = None
        self._others: list = []
        if not primary:
            return
        self._log = open(self.jsonl, "a")
        try:
            if tensorboard is not None:
                self._others.append(TensorBoardWriter(tensorboard))
            if wandb is not None:
                self._others.append(WandbWriter(wandb, run_name, config))
        except BaseException:
            self.close()
            raise

    def write(self, record: Mapping[str, Any]) -> None:
        if self._log is None:
            return
        step = record["step"]
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()
        values = scalars(record) if self._others else {}
        for w in self._others:
            w.write(step, values)

    def close(self) -> None:
        for w in self._others:
            w.close()
        self._others = []
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
