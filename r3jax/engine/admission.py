"""Admission and pages on demand, the part of the scheduling loop (:class:`r3jax.engine.loop.Loop`)
that decides which waiting request runs and where its pages come from.

- A request is admitted in order while a row is free and the pool can reserve its prompt's pages (less
  its prefix hit) and still hold the next call of every running request.
- Before each call the decode rows' pages for that call are reserved (:meth:`Admission._grow`); when
  the pool cannot give them, the loop takes in the step in flight, then preempts the most recently
  admitted request (:meth:`Admission._preempt`), which goes back to the front of the queue with what
  it had and is admitted again later with its prompt and sampled tokens as its feed.
- The samples of one prompt submitted together wait for its first page to be dispatched, then share
  its pages (:meth:`Admission._prefill_pending`).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

from r3jax.engine.planner import Seq

if TYPE_CHECKING:
    from r3jax.engine.loop import Job


def settle(future, *, result=None, error: BaseException | None = None) -> None:
    from r3jax.engine.loop import _settle  # the loop's helper (imported late: loop imports this module)

    _settle(future, result=result, error=error)


class Admission:
    """Mixin of :class:`r3jax.engine.loop.Loop` (its ``engine``, ``waiting``, ``seqs``, ``free_slots``,
    ``inflight``, ``cond``; ``_prepare``, ``_process``, ``_retire``)."""

    def _preempted(self) -> bool:
        """Whether a preempted request waits to be admitted again (it is at the front of the queue)."""
        with self.cond:
            return bool(self.waiting) and self.waiting[0].resume is not None

    def _fail_preempted(self, err: BaseException) -> None:
        with self.cond:
            jobs = [j for j in self.waiting if j.resume is not None]
            self.waiting = collections.deque(j for j in self.waiting if j.resume is None)
        for job in jobs:
            self.engine._counters["aborted"] += 1
            settle(job.future, error=err)

    def _admit(self, resumed_only: bool = False) -> None:
        eng, pool = self.engine, self.engine.pool
        if eng.static and self.seqs:
            return
        while self.free_slots:
            with self.cond:
                if not self.waiting or (resumed_only and self.waiting[0].resume is None):
                    return
                job = self.waiting[0]
            if job.future.done() or not self._prepare(job):
                with self.cond:
                    self.waiting.popleft()
                continue
            if self._prefill_pending(job):
                return  # its prompt's first page is being prefilled: admitted once that is dispatched, it shares it
            feed = job.prompt if job.resume is None or not job.resume[0] else \
                np.concatenate([job.prompt, np.asarray(job.resume[0], np.int32)])
            hit = pool.match(feed)
            need = pool.pages_for(len(feed)) - len(hit)
            # room for the next call of every running request too, so admitting this one preempts none
            room = sum(self._call_pages(seq, eng.decode_steps) for seq in self.seqs)
            if not pool.reserve(need + room):
                pool.release(hit)
                return  # waits for pages (in order: a long request is not overtaken forever)
            pool.unreserve(room)
            with self.cond:
                self.waiting.popleft()
            self.seqs.append(self._seq(job, feed, hit, need))

    def _seq(self, job: Job, feed: np.ndarray, hit: list[int], need: int) -> Seq:
        """The admitted request's host state; a preempted one keeps what it had received."""
        eng, ps = self.engine, self.engine.pool.page_size
        cfg, p = eng.config, len(job.prompt)
        cached = len(hit) * ps
        eng._counters["cached_tokens"] += cached
        seq = Seq(job, self.free_slots.pop(), list(hit), need, cached, None, feed, hit=cached)
        if job.resume is None:
            job.version, job.cached = eng.weight_version, cached
            # the hit's route rows are copied at the end (_finish): a page indexed while its step ran
            # gets them when that step's outputs arrive, which is before any step of this request's
            seq.routes = np.zeros((p + job.request.max_tokens, cfg.num_moe_layers, cfg.top_k), eng.route_dtype)
            return seq
        tokens, logprobs, routes = job.resume
        job.resume = None
        seq.routes, seq.tokens, seq.logprobs = routes, list(tokens), list(logprobs)
        if tokens:  # rows below p + g - 1 arrived before the preemption: every row of the hit among them
            seq.base, seq.final, seq.hit = len(tokens), p + len(tokens) - 1, 0
        return seq

    def _call_pages(self, seq: Seq, steps: int) -> int:
        """Pages seq's next decode call of at most ``steps`` positions needs beyond those it holds."""
        pos, n = seq.next_call(steps)
        if n == 0:
            return 0
        return max(0, self.engine.pool.pages_for(pos + n) - len(seq.pages) - seq.reserved)

    def _grow(self, decoding: list[Seq], steps: int) -> bool:
        """Reserve the pages the next call's decode rows reach. When the pool cannot give them: take in
        the steps in flight (requests that finished free theirs) or, with none in flight, preempt the
        most recently admitted request; False then, and the next turn plans again."""
        pool = self.engine.pool
        needs = [self._call_pages(seq, steps) for seq in decoding]
        if pool.reserve(sum(needs)):
            for seq, n in zip(decoding, needs):
                seq.reserved += n
            return True
        if self.inflight:
            while self.inflight:
                self._process(self.inflight.popleft())
        else:
            self._preempt(self.seqs[-1])
        return False

    def _preempt(self, seq: Seq) -> None:
        """Free seq's pages and slot and put its request back at the front of the queue with its tokens,
        logprobs and route rows (nothing is in flight: every row it was computed is on the host)."""
        eng, job = self.engine, seq.job
        self._hit_rows(seq)  # the hit's rows, as _finish copies them
        job.resume = (list(seq.tokens), list(seq.logprobs), seq.routes)
        self._retire(seq)
        eng._counters["preempted"] += 1
        with self.cond:
            self.waiting.appendleft(job)

    def _prefill_pending(self, job: Job) -> bool:
        """Whether an admitted request still prefilling starts with the same whole page as ``job``'s
        prompt (GRPO's samples of one prompt, submitted together): ``job`` then waits until those pages
        are dispatched and references them instead of prefilling the prompt again."""
        pool = self.engine.pool
        if not pool.prefix or len(job.prompt) <= pool.page_size:
            return False
        first = pool.keys(job.prompt, 1)[0]
        return any(s.prefilling and len(s.feed) > pool.page_size and pool.keys(s.feed, 1)[0] == first
                   for s in self.seqs)
