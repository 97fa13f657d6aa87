"""The engine's scheduling loop: one thread owns the device state, plans each step while the previous
one runs, and hands each request back as soon as its last token reaches the host.

Each turn:

1. runs control operations (warm-up; a weight swap once nothing is in flight, or at once after
   aborting every running request);
2. drops cancelled requests (a running one frees its pages and slot at once: the device runs steps in
   order, so whatever a step still in flight writes for it is overwritten before anyone reads it);
3. admits waiting requests in order while a slot is free and the pool can reserve their prompt's pages
   (prefix hits first) and still hold the next call of every running request; otherwise they wait;
4. reserves the pages the next call's decode rows reach (pages on demand). When the pool cannot give
   them, it first takes in the steps in flight (finished requests free theirs), then preempts the most
   recently admitted request: its pages are freed and it goes back to the front of the queue, keeping
   the tokens, logprobs and route rows it has; admitted again, it prefills its prompt and those tokens
   and samples on from there (vLLM's recompute preemption). Its answer equals an uninterrupted run's;
   no request that fits the pool alone is refused or lost for lack of pages;
5. plans and dispatches the next step (:mod:`r3jax.engine.planner`): prompt chunks join the decode rows
   in a mixed step (one token per decode row), except right after one, when the decode rows run a
   decode loop of ``decode_steps`` tokens and the prompts wait that call; then reads the outputs of the step
   before it: so the device always has the next step queued while the host appends tokens, logprobs
   and route rows to each request and finishes the ones that stopped.

Failures: a request whose own host-side preparation raises fails alone at admission; a step that
fails on device fails the requests in flight with its error, the pool is rebuilt and serving goes on.
If rebuilding raises too, the engine is *failed*: everything pending and every later ``submit`` fails
at once with :class:`EngineFailedError` naming the reason.
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

from r3jax.engine.admission import Admission
from r3jax.engine.errors import EngineAborted, EngineClosed, EngineFailedError
from r3jax.engine.planner import Seq, build, choose_chunks
from r3jax.engine.request import GenerateOutput, GenerateRequest

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
    row: Any = None  # host-side sampling parameters (Engine.prepare), built at admission
    resume: Any = None  # (tokens, logprobs, routes) kept when it was preempted; None before
    on_token: Any = None  # on_token(token, logprob | None) as each token arrives (Engine.submit)
    versions: list = dataclasses.field(default_factory=list)  # [(first token index, weight version)] spans
    batch: tuple = ()  # the jobs of its submit_many (more than one): their caller waits for all of them


@dataclasses.dataclass(eq=False)
class Control:
    fn: Callable[[], Any]
    drain: bool
    abort: str | None  # running requests: "error" fails them, "return" returns what they have; None: untouched
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass(eq=False)
class _Step:
    layout: Any
    rows: list
    outputs: tuple
    steps: int = 1  # > 1: a decode loop (outputs [steps, R, ...])
    version: int = 0  # the weight version it ran with


class Loop(Admission):
    def __init__(self, engine):
        self.engine = engine
        self.waiting: collections.deque[Job] = collections.deque()
        self.controls: collections.deque[Control] = collections.deque()
        self.seqs: list[Seq] = []  # admitted and not finished, in admission order
        self.free_slots = list(range(engine.max_batch_size - 1, -1, -1))
        self.inflight: collections.deque[_Step] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        self.failure: str | None = None
        self.warmed = False
        self.mixed_last = False  # the last step dispatched had prefill rows
        self.thread = threading.Thread(target=self._loop, name="r3jax-engine", daemon=True)
        self.thread.start()

    @property
    def live(self) -> int:
        return len(self.seqs)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ---- any thread --------------------------------------------------------------------------------
    def submit(self, *jobs: Job) -> list[concurrent.futures.Future]:
        """Queue ``jobs`` together: the scheduler sees all of them or none at its next admission."""
        if len(jobs) > 1:
            for job in jobs:
                job.batch = jobs
        with self.cond:
            self._check_open("request not started")
            self.waiting.extend(jobs)
            self.cond.notify()
        return [job.future for job in jobs]

    def control(self, fn: Callable[[], Any], *, drain: bool, abort: str | None):
        """Run ``fn`` on the scheduler thread (after draining or aborting in-flight requests when asked)."""
        if threading.current_thread() is self.thread:
            return fn()
        op = Control(fn, drain, abort)
        with self.cond:
            self._check_open("operation not run")
            self.controls.append(op)
            self.cond.notify()
        return op.future.result()

    def _check_open(self, what: str) -> None:
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
                    while not (self.closed or self.waiting or self.controls or self.seqs or self.inflight):
                        self.cond.wait()
                    if self.closed:
                        break
                try:
                    self._turn()
                except Exception as e:  # a device/program failure: fail the requests it hit, keep serving
                    log.exception("engine step failed")
                    self.inflight.clear()
                    self._fail_live(e)
                    try:
                        self.engine.reset_state()
                    except Exception as again:
                        raise _CannotContinue(f"rebuilding the device state after a failed step ({_say(e)}) "
                                              f"raised {_say(again)}") from again
        except BaseException as e:
            log.exception("engine failed; it serves no more requests")
            self._fail_engine(str(e) if isinstance(e, _CannotContinue) else f"the scheduler loop raised {_say(e)}")
            if not isinstance(e, Exception):
                raise
            return
        self._shutdown()

    def _turn(self) -> None:
        op = self.controls[0] if self.controls else None
        if op is not None and op.abort == "error":
            err = EngineAborted("aborted by a weight update (abort_in_flight=True); retry the request")
            self._fail_live(err, count="aborted")
            self._fail_preempted(err)
            self.inflight.clear()  # their outputs belong to nobody now
        elif op is not None and op.abort == "return":
            self._return_live()
            self.inflight.clear()  # tokens still on the device are not part of what was returned
        if op is not None and (not op.drain or not (self.seqs or self.inflight or self._preempted())):
            with self.cond:
                self.controls.popleft()
            try:
                op.future.set_result(op.fn())
            except Exception as e:
                op.future.set_exception(e)
            return
        self._drop_cancelled()
        self._admit(resumed_only=op is not None)  # a drain finishes preempted requests on their weights
        dispatched = self._dispatch()
        if self.inflight and (len(self.inflight) > 1 or not dispatched):
            self._process(self.inflight.popleft())

    def _drop_cancelled(self) -> None:
        with self.cond:
            kept = [j for j in self.waiting if not j.future.cancelled()]
            self.engine._counters["cancelled"] += len(self.waiting) - len(kept)
            self.waiting = collections.deque(kept)
        for seq in [s for s in self.seqs if s.job.future.cancelled()]:
            self._retire(seq)
            self.engine._counters["cancelled"] += 1

    def _prepare(self, job: Job) -> bool:
        try:
            job.row = self.engine.prepare(job)
        except Exception as e:  # the request's own data: its caller gets the error, the others run on
            log.warning("request failed before prefill: %s", _say(e))
            self.engine._counters["failed"] += 1
            _settle(job.future, error=e)
            return False
        return True

    def _dispatch(self) -> bool:
        eng = self.engine
        decoding = [s for s in self.seqs if s.decodable]
        prefilling = [s for s in self.seqs if s.prefilling]
        if not decoding and not prefilling:
            return False
        if decoding and self.mixed_last and eng.decode_steps > 1:
            # after a mixed step (one token per decode row) a decode loop: under a steady stream of
            # prompts decoding still gets decode_steps tokens every other call, and a prompt waits one call
            prefilling = []
        t0 = time.perf_counter()
        ready = sum(-(-(len(s.feed) - s.computed) // eng.prefill_chunk) for s in prefilling)
        chunks = choose_chunks(prefilling, eng.prefill_rows_for(ready, len(prefilling)), eng.prefill_chunk)
        lay = eng.layout(len(decoding), len(chunks))
        steps = cap = eng.steps_of(lay)
        if steps > 1 and eng.return_at_finish:  # the call ends where its first caller gets all it waits for
            cap = max(1, min(steps, _first_return(decoding)))
        if not self._grow(decoding, cap):
            return False
        x, rows = build(eng.pool, decoding, chunks, lay, slots=eng.max_batch_size, steps=steps, cap=cap)
        self.mixed_last = bool(chunks)
        for row in rows[len(decoding):]:  # prompt pages this step completes: indexed now, rows when they arrive
            if row.seq.job.version == eng.weight_version:  # KV of one version only (weights kept mid-request)
                row.pending = eng.pool.register(row.seq.pages, row.seq.feed[:row.hi], None)
        extra = None
        if steps > 1:  # each row's budget and stop ids, for the loop's checks on device
            extra = np.zeros((lay.rows, 1 + eng.max_stop_tokens), np.int32)
            extra[:, 1:] = -1
            for row in rows:
                extra[row.row, 0] = row.hi - row.lo
                extra[row.row, 1:] = row.seq.job.row["stop_ids"]
        t1 = time.perf_counter()
        outputs = eng.dispatch(lay, x) if extra is None else eng.dispatch(lay, x, extra)
        self.inflight.append(_Step(lay, rows, outputs, steps, eng.weight_version))
        c = eng._counters
        c["plan_s"] += t1 - t0
        c["dispatch_s"] += time.perf_counter() - t1
        c["steps"] += 1
        c["decode_calls"] += bool(decoding)
        c["decode_slot_steps"] += sum(r.hi - r.lo for r in rows[:len(decoding)])
        c["prefill_calls"] += len(chunks)
        fed = len(decoding) + sum(hi - lo for _, lo, hi in chunks)
        c["prefill_tokens"] += fed - len(decoding)
        c["padded_tokens"] += lay.tokens - fed
        c["max_live_slots"] = max(c["max_live_slots"], len(self.seqs))
        return True

    def _process(self, step: _Step) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        tok, lp, routes = (np.asarray(a) for a in step.outputs)
        now = time.perf_counter()
        eng._counters["host_wait_s"] += now - t0
        ps = eng.pool.page_size
        gather = 0.0
        for row in step.rows:
            seq = row.seq
            t = time.perf_counter()
            if step.steps > 1:  # a decode loop: position lo + i fed in step i, which sampled tok[i]
                # rows past a stop are left over from the loop: beyond any position read or registered
                seq.routes[row.lo:row.hi] = routes[:row.hi - row.lo, row.at]
                gather += time.perf_counter() - t
                for i in range(row.hi - row.lo):
                    if seq.finished:  # stopped earlier in this call, or in a call before it
                        eng._counters["wasted_tokens"] += row.hi - row.lo - i
                        break
                    self._take(seq, int(tok[i, row.row]), float(lp[i, row.row]), now, step.version)
                continue
            lo = max(row.lo, seq.final)  # a preempted request's rows below final are the ones it received
            if lo < row.hi:  # even if seq is gone: its pending pages need them
                seq.routes[lo:row.hi] = routes[row.at + lo - row.lo:row.at + row.hi - row.lo]
            gather += time.perf_counter() - t
            for j, page, key in row.pending:
                eng.pool.set_routes(page, key, seq.routes[j * ps:(j + 1) * ps])
            if seq.finished:
                eng._counters["wasted_tokens"] += row.hi - row.lo
                continue
            if row.samples:
                self._take(seq, int(tok[row.row]), float(lp[row.row]), now, step.version)
        del eng._ttft[:-4096]
        eng._counters["route_gather_s"] += gather
        eng._counters["process_s"] += time.perf_counter() - now

    def _take(self, seq: Seq, token: int, logprob: float, now: float, version: int) -> None:
        """One sampled token of seq (by the weights of ``version``); finishes seq at a stop token or its
        max_tokens."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        spans = seq.job.versions
        if not spans or spans[-1][1] != version:
            spans.append((len(seq.tokens) - 1, version))
        stop_here = False
        if seq.job.on_token is not None:
            try:  # a true answer stops the request at this token (stop strings: r3jax.serve.peers.stream)
                stop_here = bool(seq.job.on_token(token, logprob if seq.job.request.return_logprobs else None))
            except Exception:  # a streaming caller's bug must not stop the engine
                log.exception("on_token raised; the request goes on")
        if len(seq.tokens) == 1:
            self.engine._ttft.append(now - seq.job.submitted)
        if token in seq.job.row["stop"] or stop_here:
            seq.stopped = True
        if seq.stopped or len(seq.tokens) >= seq.max_new:
            self._finish(seq)

    def _finish(self, seq: Seq) -> None:
        eng, job = self.engine, seq.job
        self._hit_rows(seq)
        out = self._output(job, seq.tokens, seq.logprobs, seq.routes, "stop" if seq.stopped else "length")
        if job.version == eng.weight_version and all(v == job.version for _, v in job.versions):
            fed = np.concatenate([job.prompt, np.asarray(seq.tokens[:-1], np.int32)])
            eng.pool.register(seq.pages, fed, seq.routes)  # never pages whose KV spans two versions
        eng._counters["requests"] += 1
        eng._counters["generated_tokens"] += len(seq.tokens)
        self._retire(seq)
        _settle(job.future, result=out)

    def _hit_rows(self, seq: Seq) -> None:
        """Copy the prefix hit's route rows into seq's (all on the host by now: their steps ran before)."""
        if seq.hit:
            hit = seq.pages[:seq.hit // self.engine.pool.page_size]
            seq.routes[:seq.hit] = self.engine.pool.routes[hit].reshape(seq.hit, *seq.routes.shape[1:])

    def _output(self, job: Job, tokens: list, logprobs: list, routes: np.ndarray, finish: str) -> GenerateOutput:
        """A request's answer from its tokens, logprobs and route rows ``[P + G - 1, ...]`` so far."""
        eng, req, p, g = self.engine, job.request, len(job.prompt), len(tokens)
        t0 = time.perf_counter()
        s = req.routed_experts_prompt_start
        routed = None
        if req.return_routed_experts:
            routed = np.ascontiguousarray(routes[s:p + g - 1])
            eng._counters["route_rows"] += len(routed)
        eng._counters["route_gather_s"] += time.perf_counter() - t0
        return GenerateOutput(
            output_ids=list(tokens), logprobs=list(logprobs) if req.return_logprobs else None,
            finish_reason=finish, routed_experts=routed, prompt_tokens=p, cached_tokens=job.cached,
            weight_version=job.version, routed_experts_start=s, weight_versions=tuple(job.versions))

    def _return_live(self) -> None:
        """A weight update's mode "abort": every request that has sampled a token returns what it has
        (finish_reason "abort"); one that has not goes back to the front of the queue for the new weights."""
        eng, back = self.engine, []
        for seq in list(self.seqs):
            job = seq.job
            if seq.tokens:
                self._hit_rows(seq)
                out = self._output(job, seq.tokens, seq.logprobs, seq.routes, "abort")
                self._retire(seq)
                eng._counters["aborted"] += 1
                _settle(job.future, result=out)
            else:
                self._retire(seq)
                job.versions.clear()
                back.append(job)
        with self.cond:
            preempted = [j for j in self.waiting if j.resume is not None and j.resume[0]]
            for j in self.waiting:
                if j.resume is not None and not j.resume[0]:  # preempted before its first token: start afresh
                    j.resume = None
                    j.versions.clear()
            self.waiting = collections.deque(back + [j for j in self.waiting if j.resume is None])
        for job in preempted:  # what a preempted request had received when it was preempted
            tokens, logprobs, routes = job.resume
            eng._counters["aborted"] += 1
            _settle(job.future, result=self._output(job, tokens, logprobs, routes, "abort"))

    def _retire(self, seq: Seq) -> None:
        """Free seq's slot, pages and unused reservation. Safe with its steps still in flight: the
        device runs steps in order, so a later owner's writes land after them."""
        if seq.finished:
            return
        seq.finished = True
        pool = self.engine.pool
        pool.release(seq.pages)
        pool.unreserve(seq.reserved)
        seq.pages, seq.reserved = [], 0
        self.free_slots.append(seq.slot)
        self.seqs.remove(seq)

    def _fail_live(self, err: BaseException, count: str | None = "failed") -> None:
        for seq in list(self.seqs):
            self._retire(seq)
            if count is not None:
                self.engine._counters[count] += 1
            _settle(seq.job.future, error=err)

    def _fail_engine(self, reason: str) -> None:
        with self.cond:
            self.failure, self.closed = reason, True
        err = EngineFailedError(reason)
        try:
            self._fail_live(err)
        finally:
            self._fail_pending(err, err)

    def _shutdown(self) -> None:
        err = EngineClosed("engine closed before the request finished; retry it")
        self._fail_live(err, count=None)
        self._fail_pending(err, EngineClosed("engine closed"))

    def _fail_pending(self, err: BaseException, op_err: BaseException) -> None:
        with self.cond:
            pending, self.waiting = list(self.waiting), collections.deque()
            controls, self.controls = list(self.controls), collections.deque()
        for job in pending:
            _settle(job.future, error=err)
        for op in controls:
            _settle(op.future, error=op_err)


def _first_return(decoding: list[Seq]) -> int:
    """Decode steps until a caller has every answer it waits for, by max_tokens: a request submitted
    alone when it reaches its own, a submit_many batch when the last of its requests reaches theirs.
    Ending a call at a batch's first request would return nothing sooner (its caller waits for the
    rest) and cost a batch prefilled over several steps one more call per further step. A batch with
    a request not decoding yet (waiting, prefilling, preempted) returns after this call anyway."""
    groups: dict[int, list] = {}  # id(batch) -> [batch, its requests decoding, most steps one has left]
    for s in decoding:
        batch = s.job.batch or (s.job,)
        g = groups.setdefault(id(batch), [batch, 0, 0])
        g[1] += 1
        g[2] = max(g[2], s.max_new - s.planned)
    ends = [most for batch, n, most in groups.values() if n == sum(not j.future.done() for j in batch)]
    return min(ends, default=1 << 30)


class _CannotContinue(RuntimeError):
    """The loop could not recover from a failed step (its message is the engine's failure reason)."""


def _say(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _settle(future: concurrent.futures.Future, *, result=None, error: BaseException | None = None) -> None:
    """Complete a future unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
