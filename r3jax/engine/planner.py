"""Host-side plan of each mixed step: which requests decode, which prompt chunks prefill, and the index
arrays (:class:`r3jax.engine.step.StepInputs`) that say so.

A request (:class:`Seq`) moves through: waiting -> admitted (its prompt's pages reserved, prefix pages
referenced) -> prefilling (its prompt fed in chunks of ``prefill_len`` tokens, possibly several per step)
-> decoding (one token per step, or a decode loop's budget per call; pages reserved call by call as its
positions reach them) -> finished. A request preempted for pages (:meth:`r3jax.engine.loop.Loop._preempt`)
is admitted again later with its prompt and the tokens it had sampled as its ``feed``, and goes on
sampling where it stopped. The host knows every position it feeds in advance (a step adds one
token to each decoding request), so it plans step n + 1 before it has read step n's tokens; a request
that sampled a stop token in step n is then fed once more in step n + 1 and that extra token is dropped.

Prefill rows are shared out fairly: every prefilling request gets one row per step (oldest first)
before the oldest takes the rest, so a short prompt admitted behind a long one starts decoding after
one step instead of waiting for the long prompt to finish.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.paged import RaggedLayout
from r3jax.engine.pages import PagePool


@dataclasses.dataclass(eq=False)
class Seq:
    """One admitted request's host state. ``job``: the scheduler's record (request, prompt, seed,
    future, ...); ``slot``: its row of the device's ``last`` tokens; ``pages``: its pages in position
    order (prefix hits first); ``reserved``: pages promised to it and not taken yet; ``computed``: tokens
    of ``feed`` whose keys are written or in a dispatched step; ``planned``: tokens generated once every
    dispatched step has run; ``tokens``/``logprobs``: the ones received; ``routes`` [P + max_tokens, L, K]:
    route rows by position as they arrive.

    ``feed``: what prefill feeds, the prompt; after a preemption the prompt and the ``base`` tokens
    sampled before it (their logprobs and the route rows below ``final`` were received then and are
    kept: the recomputation writes no row below ``final``). ``hit``: tokens of this admission's prefix
    hit whose route rows are copied from the pool when the request finishes."""

    job: object
    slot: int
    pages: list[int]
    reserved: int
    computed: int
    routes: np.ndarray
    feed: np.ndarray
    hit: int = 0
    base: int = 0
    final: int = 0
    planned: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False
    stopped: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt)

    @property
    def max_new(self) -> int:
        return int(self.job.request.max_tokens)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.feed)

    def next_call(self, steps: int) -> tuple[int, int]:
        """(first position, positions) its next decode call feeds, with at most ``steps`` per call."""
        planned = max(self.planned, self.base + 1)  # a request still prefilling samples token base first
        return self.prompt_len + planned - 1, max(0, min(steps, self.max_new - planned))

    @property
    def decodable(self) -> bool:
        """Needs a decode row in the next step (its first token is sampled and more may follow)."""
        return not self.finished and not self.prefilling and 1 <= self.planned < self.max_new


@dataclasses.dataclass
class RowPlan:
    """What a row of a step does: seq; ``row``: its index in R; ``at``: its first token's index in N;
    ``lo``/``hi``: the positions it feeds (decode: one, or a decode loop's budget); samples: whether it
    samples seq's next token (a decode loop's row: one per position); ``pending``: prompt pages indexed
    when this row was dispatched, whose route rows its outputs complete."""

    seq: Seq
    row: int
    at: int
    lo: int
    hi: int
    samples: bool
    pending: list = dataclasses.field(default_factory=list)  # (j, page, key): pages whose rows this row completes


def _page_at(pool: PagePool, seq: Seq, position: int) -> tuple[int, int]:
    """(page, offset) of ``position`` in seq's pages, taking a page from its reservation when reached."""
    j, off = divmod(position, pool.page_size)
    while len(seq.pages) <= j:
        seq.pages.append(pool.take())
        seq.reserved -= 1
    return seq.pages[j], off


def choose_chunks(prefilling: list[Seq], rows: int, prefill_len: int) -> list[tuple[Seq, int, int]]:
    """Up to ``rows`` chunks ``(seq, lo, hi)``: one per prefilling request (oldest first), then the
    oldest requests' following chunks."""
    todo = {id(s): s.computed for s in prefilling}
    out = []

    def one(seq):
        lo = todo[id(seq)]
        if lo >= len(seq.feed) or len(out) >= rows:
            return False
        hi = min(len(seq.feed), lo + prefill_len)
        out.append((seq, lo, hi))
        todo[id(seq)] = hi
        return True

    for seq in prefilling:
        one(seq)
    for seq in prefilling:
        while one(seq):
            pass
    return out


def build(pool: PagePool, decoding: list[Seq], chunks: list[tuple[Seq, int, int]], layout: RaggedLayout, *,
          slots: int, steps: int = 1, cap: int | None = None) -> tuple[dict[str, np.ndarray], list[RowPlan]]:
    """The step's :class:`StepInputs` arrays (as numpy) and its rows. Takes pages from the requests'
    reservations and advances ``computed`` / ``planned`` (the step is about to be dispatched).

    ``steps`` > 1 (no chunks): a decode loop of that many steps; each decode row feeds the positions
    ``[lo, hi)`` (its budget, ``hi - lo`` <= steps: fewer where max_tokens comes first), its table holds
    the pages of all of them, and ``planned`` advances by the budget. ``cap``: most steps any row's
    budget takes (the call then ends sooner), default ``steps``."""
    if steps > 1 and chunks:
        raise RuntimeError(f"a {steps}-step decode loop has no prefill rows: {len(chunks)} chunks given")
    n, r, pmax, d = layout.tokens, layout.rows, layout.pages_per_row, layout.decode_rows
    x = dict(tokens=np.zeros(n, np.int32), from_slot=np.full(n, -1, np.int32), positions=np.zeros(n, np.int32),
             page=np.zeros(n, np.int32), offset=np.zeros(n, np.int32), table=np.zeros((r, pmax), np.int32),
             kv_len=np.ones(r, np.int32), sample_at=np.zeros(r, np.int32), slot=np.full(r, slots, np.int32),
             key_data=np.zeros((r, 2), np.uint32), index=np.zeros(r, np.int32), temperature=np.zeros(r, np.float32),
             top_k=np.zeros(r, np.int32), top_p=np.ones(r, np.float32), processed=np.zeros(r, bool))
    rows: list[RowPlan] = []

    def sampling(i, seq, gen):
        p = seq.job.row
        x["slot"][i] = seq.slot
        x["key_data"][i], x["index"][i] = p["key_data"], gen
        x["temperature"][i], x["top_k"][i], x["top_p"][i] = p["temperature"], p["top_k"], p["top_p"]
        x["processed"][i] = p["processed"]

    if len(decoding) > d or len(chunks) > layout.prefill_rows:
        raise RuntimeError(f"{len(decoding)} decode rows and {len(chunks)} chunks do not fit {layout}")
    for i, seq in enumerate(decoding):
        pos = seq.prompt_len + seq.planned - 1  # feeds output token planned-1 (on device in last[slot])
        budget = min(steps if cap is None else cap, seq.max_new - seq.planned)
        _page_at(pool, seq, pos + budget - 1)  # every page the call may write
        page, off = _page_at(pool, seq, pos)
        x["from_slot"][i], x["positions"][i], x["page"][i], x["offset"][i] = seq.slot, pos, page, off
        x["table"][i, :len(seq.pages)] = seq.pages
        x["kv_len"][i] = pos + 1
        x["sample_at"][i] = i
        sampling(i, seq, seq.planned)
        rows.append(RowPlan(seq, i, i, pos, pos + budget, True))
        seq.planned += budget
    for c, (seq, lo, hi) in enumerate(chunks):
        i, t0 = d + c, d + c * layout.prefill_len
        prompt = seq.feed
        for j, pos in enumerate(range(lo, hi)):
            x["page"][t0 + j], x["offset"][t0 + j] = _page_at(pool, seq, pos)
        k = hi - lo
        x["tokens"][t0:t0 + k] = prompt[lo:hi]
        x["positions"][t0:t0 + k] = np.arange(lo, hi)
        x["positions"][t0 + k:t0 + layout.prefill_len] = hi - 1  # padding: sees what the last real token sees
        x["table"][i, :len(seq.pages)] = seq.pages
        x["kv_len"][i] = hi
        seq.computed = hi
        last = hi == len(prompt)
        if last:  # samples token base (0, or the next one of a preempted request)
            x["sample_at"][i] = t0 + k - 1
            sampling(i, seq, seq.base)
            seq.planned = seq.base + 1
        rows.append(RowPlan(seq, i, t0, lo, hi, last))
    return x, rows
