"""The previous engine's scheduling loop: one thread owns the device state and alternates admission, a decode
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

Failures: a request whose own host-side preparation raises (its sampling parameters do not fit
their device dtypes, say) fails alone at admission; a turn that fails on device fails the requests
in flight with its error, the slot buffers are rebuilt and serving goes on. If the loop itself
cannot go on (rebuilding the buffers raises too), the engine is *failed*: every request not
finished, every waiting control operation and every later ``submit`` fail at once with
:class:`EngineFailedError` naming the reason (nothing ever waits on a thread that is gone).
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

from r3jax.engine.errors import EngineAborted, EngineClosed, EngineFailedError
from r3jax.engine.loop import _CannotContinue, _say, _settle
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
    row: Any = None  # the request's host-side slot parameters (Engine.prepare), built at admission


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
        self.failure: str | None = None  # why the loop stopped for good (closed is then True too)
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
            self._check_open("request not started")
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
            self._check_open("operation not run")
            self.controls.append(op)
            self.cond.notify()
        return op.future.result()

    def _check_open(self, what: str) -> None:
        """Raise (holding ``cond``) if no more work can be taken: failed, or closed."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        if self.closed:
            raise EngineClosed(f"engine closed; {what}")

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join(60)

    # ---- scheduler thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
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
                    try:
                        self.engine.reset_state()
                    except Exception as again:
                        raise _CannotContinue(f"rebuilding the device state after a failed step ({_say(e)}) "
                                              f"raised {_say(again)}") from again
        except BaseException as e:  # the loop cannot go on: tell every caller now and every later one
            log.exception("engine failed; it serves no more requests")
            self._fail_engine(str(e) if isinstance(e, _CannotContinue) else f"the scheduler loop raised {_say(e)}")
            if not isinstance(e, Exception):
                raise
            return
        self._shutdown()

    def _turn(self) -> None:
        op = self.controls[0] if self.controls else None
        if op is not None and op.abort:
            self._fail_live(EngineAborted("aborted by a weight update (abort_in_flight=True); retry the request"),
                            count="aborted")
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
            take = [job for job in take if self._prepare(job)]
            if not take:
                continue
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
                eng._counters["failed"] += len(take)
                raise
            now = time.perf_counter()
            eng._ttft.extend(now - j.submitted for j in take)
            del eng._ttft[:-4096]

    def _prepare(self, job: Job) -> bool:
        """Build ``job``'s host-side slot parameters; on an error that request alone fails (False)."""
        try:
            job.row = self.engine.prepare(job)
        except Exception as e:  # the request's own data: its caller gets the error, the others run on
            log.warning("request failed before prefill: %s", _say(e))
            self.engine._counters["failed"] += 1
            _settle(job.future, error=e)
            return False
        return True

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

    def _fail_live(self, err: BaseException, count: str | None = "failed") -> None:
        for s, job in enumerate(self.slots):
            if job is not None:
                self._free(s)
                if count is not None:
                    self.engine._counters[count] += 1
                _settle(job.future, error=err)

    def _fail_engine(self, reason: str) -> None:
        """Failed for good: refuse new work, then fail everything that waits (no thread is left to run it)."""
        with self.cond:
            self.failure, self.closed = reason, True
        err = EngineFailedError(reason)
        try:
            self._fail_live(err)
        finally:  # whatever happens to the slots, nothing queued may be left waiting
            self._fail_pending(err, err)

    def _shutdown(self) -> None:
        err = EngineClosed("engine closed before the request finished; retry it")
        self._fail_live(err, count=None)
        self._fail_pending(err, EngineClosed("engine closed"))

    def _fail_pending(self, err: EngineClosed, op_err: EngineClosed) -> None:
        """Fail every waiting request with ``err`` and every waiting control operation with ``op_err``."""
        with self.cond:
            pending, self.waiting = list(self.waiting), collections.deque()
            controls, self.controls = list(self.controls), collections.deque()
        for job in pending:
            _settle(job.future, error=err)
        for op in controls:
            _settle(op.future, error=op_err)
