"""Data parallelism by engine cores: ``data`` :class:`r3jax.engine.Engine` s behind one engine's surface.

Each core owns ``tensor * expert`` devices (its own ``(data=1, tensor, expert)`` mesh), its own copy of
the weights, page pool and scheduler thread, so cores decode side by side and tokens/s adds up with
the devices (vLLM's data-parallel deployment: one engine core per data-parallel rank). A request
lives on one core:

- a prompt whose leading whole pages a core has seen before (the samples of one GRPO prompt, the
  next turn of a session) goes to that core, where its prefix pages are (or are being) computed,
  unless that core holds more than one batch (``max_batch_size``) above the least loaded one;
- any other prompt goes to the least loaded core (requests running plus queued);
- a core that failed gets nothing more; the group fails when every core has.

Requests without a seed get one drawn here, so an answer does not depend on the core that ran it.
Weight updates reach every core (in parallel, each by its own mode) and number them alike.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import threading
import time
from typing import Sequence

import jax
import numpy as np

from r3jax.checks import FieldError, check_int
from r3jax.engine.engine import Engine
from r3jax.engine.errors import EngineFailedError
from r3jax.engine.request import GenerateOutput, GenerateRequest, each_checked, generate_all
from r3jax.engine.sharding import make_mesh

AFFINITY_ENTRIES = 1 << 16  # page-prefix keys remembered for routing (oldest forgotten first)


class EngineGroup:
    """``data`` engine cores over ``data * tensor * expert`` devices, with :class:`Engine`'s methods.

    Args:
      model: the model; every core copies its parameters onto its own devices.
      data: engine cores (>= 1).
      tensor, expert: each core's mesh (its devices: ``devices[i * tensor * expert:(i + 1) * tensor * expert]``).
      devices: default ``jax.local_devices()``; the first ``data * tensor * expert`` are used.
      seed: seeds the draws of per-request seeds for requests with ``seed=None``.
      **engine_kwargs: every core's :class:`Engine` arguments (``max_batch_size``, ``num_pages`` and the
        other sizes are per core; not ``mesh`` or ``seed``).
    """

    def __init__(self, model, *, data: int, tensor: int = 1, expert: int = 1, devices=None, seed: int | None = None,
                 **engine_kwargs):
        for name, value in (("data", data), ("tensor", tensor), ("expert", expert)):
            check_int(name, value, lo=1)
        if "mesh" in engine_kwargs:
            raise FieldError("mesh", engine_kwargs["mesh"], "not given: each core's mesh comes from tensor and expert",
                             "EngineGroup mesh: not accepted (each core gets a (data=1, tensor, expert) mesh of its "
                             "own devices); give tensor= and expert=")
        devices = list(jax.local_devices() if devices is None else devices)
        per = tensor * expert
        if data * per > len(devices):
            raise FieldError("data", data, f"data * tensor * expert <= {len(devices)} devices",
                             f"EngineGroup data={data}: data * tensor * expert = {data * per} devices, "
                             f"only {len(devices)} given")
        self.data, self.tensor, self.expert = data, tensor, expert
        self.cores: list[Engine] = []
        try:
            for i in range(data):
                mesh = make_mesh(data=1, tensor=tensor, expert=expert, devices=devices[i * per:(i + 1) * per])
                self.cores.append(Engine(model, mesh=mesh, **engine_kwargs))
        except BaseException:
            for core in self.cores:
                core.close()
            raise
        first = self.cores[0]
        self.config, self.max_seq_len, self.route_dtype = first.config, first.max_seq_len, first.route_dtype
        self.block_size, self.decode_steps = first.block_size, first.decode_steps
        self.max_batch_size = first.max_batch_size * data  # requests running at once over every core
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._affinity: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._routed = [0] * data
        self._affine = 0

    # ---- Engine's surface ------------------------------------------------------------------------
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.cores[0].moe_layer_ids

    @property
    def weight_version(self) -> int:
        return max(core.weight_version for core in self.cores)

    @property
    def warmed_up(self) -> bool:
        return all(core.warmed_up for core in self.cores)

    @property
    def failure(self) -> str | None:
        """Why the group serves no more requests (every core failed), or None while one core serves."""
        failures = [core.failure for core in self.cores]
        if all(f is not None for f in failures):
            return "; ".join(f"core {i}: {f}" for i, f in enumerate(failures))
        return None

    @property
    def stats(self) -> dict:
        """The cores' counters summed (``compiled_programs`` too: each core compiles for its devices),
        TTFT percentiles over every core, and per core: ``cores`` (each core's own stats), ``routed``
        (requests sent to it); ``affine``: requests routed by a page prefix a core had seen."""
        per = [core.stats for core in self.cores]
        out = {}
        for key, value in per[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not key.startswith("ttft_"):
                out[key] = sum(s[key] for s in per)
        ttft = np.asarray(self.recent_ttft()) if any(core.recent_ttft(1) for core in self.cores) else None
        out["ttft_p50_s"] = None if ttft is None else float(np.percentile(ttft, 50))
        out["ttft_p99_s"] = None if ttft is None else float(np.percentile(ttft, 99))
        out["failure"] = self.failure
        out["failed_cores"] = sum(s["failure"] is not None for s in per)
        with self._lock:
            out["routed"], out["affine"] = list(self._routed), self._affine
        out["data"], out["cores"] = self.data, per
        return out

    def recent_ttft(self, n: int = 1024) -> list[float]:
        """Seconds from submit to first token of the last ``n`` requests of each core, together."""
        return [t for core in self.cores for t in core.recent_ttft(n)]

    def submit(self, request: GenerateRequest, on_token=None) -> concurrent.futures.Future:
        """:meth:`Engine.submit` on the core this request is routed to (module docstring)."""
        request, on_token, prompt = self._place(request, on_token)
        return self.cores[self._route(prompt)].submit(request, on_token)

    def submit_many(self, requests: Sequence[GenerateRequest], on_tokens=None) -> list[concurrent.futures.Future]:
        """:meth:`Engine.submit_many` over the cores: all validated before any is queued, each routed
        counting the load the batch's earlier requests add (samples of one prompt follow its pages to
        one core), then each core's share queued together (admitted in one step). When a core refuses
        its share (it failed or closed since routing), the shares already queued are cancelled and its
        error raised: none of the batch runs."""
        placed = each_checked(requests, on_tokens, self._place)
        added = [0] * len(self.cores)
        share: dict[int, list[int]] = {}
        for i, (_, _, prompt) in enumerate(placed):
            core = self._route(prompt, added)
            added[core] += 1
            share.setdefault(core, []).append(i)
        futures: list = [None] * len(placed)
        try:
            for core, idx in share.items():
                got = self.cores[core].submit_many([placed[i][0] for i in idx], [placed[i][1] for i in idx])
                for i, f in zip(idx, got):
                    futures[i] = f
        except BaseException:  # a core that failed or closed since routing: all or none of the batch runs
            for f in futures:
                if f is not None:
                    f.cancel()
            with self._lock:
                for core, idx in share.items():
                    self._routed[core] -= len(idx)
            raise
        return futures

    def _place(self, request: GenerateRequest, on_token):
        """Validated, with a seed drawn by the group when it has none (the same on whichever core)."""
        prompt = self.cores[0]._validate(request)
        if request.seed is None:
            request = dataclasses.replace(request, seed=int(self._rng.integers(1 << 63)))
        return request, on_token, prompt

    async def submit_async(self, request: GenerateRequest) -> GenerateOutput:
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Continue every request (validated before any is queued); outputs in request order."""
        return generate_all(requests, self.cores[0]._validate, self.submit_many)

    def set_weights(self, params_state, abort_in_flight: bool = False, *, mode: str | None = None,
                    version: int | None = None) -> int:
        """:meth:`Engine.set_weights` on every core that serves, at once, each swapping by ``mode`` for
        its own requests; all take the same version (``version``, or one above the highest core's).
        Returns it. A failed core is left as it is (it serves nothing)."""
        if version is None:
            version = self.weight_version + 1
        check_int("version", version, self.weight_version + 1)
        live = [core for core in self.cores if core.failure is None]
        if not live:
            raise EngineFailedError(self.failure)
        with concurrent.futures.ThreadPoolExecutor(len(live)) as pool:
            futures = [pool.submit(core.set_weights, params_state, abort_in_flight, mode=mode, version=version)
                       for core in live]
            versions = [f.result() for f in futures]
        return versions[0]

    def warmup(self) -> dict:
        """Every core's :meth:`Engine.warmup`, side by side; programs, new, loaded and compiled summed,
        seconds of the whole."""
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(self.cores)) as pool:
            results = list(pool.map(lambda core: core.warmup(), self.cores))
        out = {k: sum(r[k] for r in results) for k in ("programs", "new", "loaded", "compiled")}
        return {**out, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        for core in self.cores:
            core.close()

    # ---- routing -----------------------------------------------------------------------------------
    def _keys(self, prompt: np.ndarray) -> list[bytes]:
        """Hash-chain keys of the prompt's whole pages (as the page pools key their prefix pages)."""
        out, parent, ps = [], b"", self.block_size
        for j in range(len(prompt) // ps):
            parent = hashlib.blake2b(parent + np.ascontiguousarray(prompt[j * ps:(j + 1) * ps], np.int32).tobytes(),
                                     digest_size=16).digest()
            out.append(parent)
        return out

    def _route(self, prompt: np.ndarray, added: Sequence[int] = ()) -> int:
        """The core for ``prompt``; ``added``: requests per core routed earlier in the same batch (not
        yet queued, so not yet in the cores' loads)."""
        keys = self._keys(prompt)
        added = list(added) or [0] * len(self.cores)
        loads = [np.inf if core.failure is not None else core._sched.live + core._sched.queued + extra
                 for core, extra in zip(self.cores, added)]
        if all(np.isinf(loads)):
            return 0  # every core failed: its submit raises EngineFailedError
        with self._lock:
            least = int(np.argmin(loads))
            choice = least
            for key in reversed(keys):  # the longest page prefix a core has seen
                core = self._affinity.get(key)
                if core is not None:
                    if loads[core] <= loads[least] + self.cores[core].max_batch_size:
                        choice = core
                        self._affine += 1
                    break
            for key in keys:
                self._affinity[key] = choice
                self._affinity.move_to_end(key)
            while len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
            self._routed[choice] += 1
        return choice
