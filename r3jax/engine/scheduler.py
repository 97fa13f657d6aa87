"""The engine's scheduling loop: one thread owns the device state and alternates admission, a decode
call and harvesting.

Each turn of the loop:

1. runs control operations (warm-up; a weight swap once no request is in flight, or at once after
   aborting them);
2. drops cancelled requests: waiting ones are forgotten, running ones free their slot (the next
   decode call stops them);
3. admits waiting requests into free slots (unless a weight swap is draining, or the engine is
   static and some slot is busy), a prefill of up to ``prefill_rows`` requests at a time;
4. runs one decode call (``decode_steps`` tokens for every live slot) and harvests every slot that
   finished: its future gets the output and the slot is free for the next admission.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from r3jax.engine.errors import EngineAborted, EngineClosed
from r3jax.engine.request import GenerateRequest

log = logging.getLogger("r3jax.engine")


@dataclasses.dataclass(eq=False)
class Job:
    request: GenerateRequest
    prompt: np.ndarray
    seed: int
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    version: int = -1
    cached: int = 0


@dataclasses.dataclass(eq=False)
class _Control:
    fn: Callable[[], Any]
    drain: bool
    abort: bool
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


class Scheduler:
    def __init__(self, engine):
        self.engine = engine
        b = engine.max_batch_size
        self.slots: list[Job | None] = [None] * b
        self.n_gen = np.zeros((b,), np.int32)
        self.waiting: collections.deque[Job] = collections.deque()
        self.controls: collections.deque[_Control] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        self.warmed = False
        self.thread = threading.Thread(target=self._loop, name="r3jax-engine", daemon=True)
        self.thread.start()

    @property
    def live(self) -> int:
        return sum(j is not None for j in self.slots)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ---- any thread --------------------------------------------------------------------------------
    def submit(self, job: Job) -> concurrent.futures.Future:
        with self.cond:
            if self.closed:
                raise EngineClosed("engine closed; request not started")
            self.waiting.append(job)
            self.cond.notify()
        return job.future

    def control(self, fn: Callable[[], Any], *, drain: bool, abort: bool):
        """Run ``fn`` on the scheduler thread (after draining or aborting in-flight requests when asked)
        and return its result."""
        op = _Control(fn, drain, abort)
        if threading.current_thread() is self.thread:
            return fn()
        with self.cond:
            if self.closed:
                raise EngineClosed("engine closed")
            self.controls.append(op)
            self.cond.notify()
        return op.future.result()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join(60)

    # ---- scheduler thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.closed or self.waiting or self.controls or self.live):
                    self.cond.wait()
                if self.closed:
                    break
            try:
                self._turn()
            except Exception as e:  # a device/program failure: fail the requests it hit, keep serving
                log.exception("engine step failed")
                self._fail_live(e)
                self.engine.reset_state()
        self._shutdown()

    def _turn(self) -> None:
        op = self.controls[0] if self.controls else None
        if op is not None and op.abort:
            self._fail_live(EngineAborted("aborted by a weight update (abort_in_flight=True); retry the request"))
        if op is not None and (not op.drain or not self.live):
            with self.cond:
                self.controls.popleft()
            try:
                op.future.set_result(op.fn())
            except Exception as e:  # returned to the caller of control(), never swallowed
                op.future.set_exception(e)
            return
        self._drop_cancelled()
        if op is None:
            self._admit()
        if self.live:
            self._decode()

    def _drop_cancelled(self) -> None:
        with self.cond:
            kept = [j for j in self.waiting if not j.future.cancelled()]
            self.engine._counters["cancelled"] += len(self.waiting) - len(kept)
            self.waiting = collections.deque(kept)
        for s, job in enumerate(self.slots):
            if job is not None and job.future.cancelled():
                self._free(s)  # not passed to the next decode call: it stops there
                self.engine._counters["cancelled"] += 1

    def _admit(self) -> None:
        eng = self.engine
        if eng.static and self.live:
            return
        while True:
            free = [s for s, j in enumerate(self.slots) if j is None]
            with self.cond:
                take = []
                while self.waiting and len(take) < min(len(free), max(eng._row_buckets)):
                    job = self.waiting.popleft()
                    if not job.future.cancelled():  # stays PENDING until done, so cancel() works
                        take.append(job)
            if not take:
                return
            slot_ids = free[:len(take)]
            for job, s in zip(take, slot_ids):
                job.version = eng.weight_version
                self.slots[s] = job
                self.n_gen[s] = 1
            try:
                eng.prefill(take, slot_ids)
            except Exception as e:  # these jobs are in no slot now: fail them here, or they would wait forever
                for job, s in zip(take, slot_ids):
                    self.slots[s] = None
                    _settle(job.future, error=e)
                raise
            now = time.perf_counter()
            eng._ttft.extend(now - j.submitted for j in take)
            del eng._ttft[:-4096]

    def _decode(self) -> None:
        eng = self.engine
        live = {s: j for s, j in enumerate(self.slots) if j is not None}
        n_gen, done = eng.decode(live, self.n_gen)
        self.n_gen[:] = n_gen
        eng._counters["decode_slot_steps"] += len(live)
        for s, job in live.items():
            if done[s]:
                out = eng.harvest(s, job, int(n_gen[s]))
                self._free(s)
                _settle(job.future, result=out)

    def _free(self, s: int) -> None:
        self.slots[s] = None

    def _fail_live(self, err: BaseException) -> None:
        for s, job in enumerate(self.slots):
            if job is not None:
                self._free(s)
                if isinstance(err, EngineAborted):
                    self.engine._counters["aborted"] += 1
                _settle(job.future, error=err)

    def _shutdown(self) -> None:
        err = EngineClosed("engine closed before the request finished; retry it")
        self._fail_live(err)
        with self.cond:
            pending, self.waiting = list(self.waiting), collections.deque()
            controls, self.controls = list(self.controls), collections.deque()
        for job in pending:
            _settle(job.future, error=err)
        for op in controls:
            op.future.set_exception(EngineClosed("engine closed"))


def _settle(future: concurrent.futures.Future, *, result=None, error: BaseException | None = None) -> None:
    """Complete a future unless its caller cancelled it meanwhile (then there is nobody to tell)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
