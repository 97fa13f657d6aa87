"""The multi-turn agent loop: many trajectories in flight, routes gathered incrementally.

:class:`AgentLoop` holds the settings and picks a driver; the pieces live in their own modules:
an :class:`~r3jax.rollout.episode.Episode` is one trajectory in flight (requests, the growing
trace, the environment); :mod:`~r3jax.rollout.batched` drives episodes against the in-process
engine (the turns of all live trajectories in one batch per round); :mod:`~r3jax.rollout.concurrent`
drives them against ``RemoteInferenceClient.agenerate`` (each trajectory an asyncio task, at most
``max_concurrency`` requests in flight; the server batches them); :mod:`~r3jax.rollout.demonstrations`
plays the environment's oracle for supervised warm-up data; with ``chat=True``, :mod:`~r3jax.rollout.chat`
drives :class:`~r3jax.rollout.chat.ChatEnv` environments through the server's ``/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from r3jax.rollout.batched import drive_batched, generate_in_chunks
from r3jax.rollout.chat import ON_PREFIX_BREAK, ChatEpisode, drive_chat
from r3jax.rollout.concurrent import drive_concurrently
from r3jax.rollout.demonstrations import oracle_generate
from r3jax.rollout.env import Env
from r3jax.rollout.episode import Episode, MissingRoutesError
from r3jax.rollout.model_info import describe
from r3jax.rollout.sampling import SamplingParams, request_seed
from r3jax.rollout.trajectory import Trajectory

__all__ = ["AgentLoop", "MissingRoutesError", "SamplingParams", "describe"]


class AgentLoop:
    """Runs multi-turn rollouts of ``env_factory()`` environments against ``generator``.

    generator: the in-process ``Engine`` or a ``RemoteInferenceClient`` (or anything with the
    same ``generate``/``agenerate``). ``mode``: ``"auto"`` (async if the generator has
    ``agenerate``), ``"batched"`` or ``"async"``. ``max_seq_len`` bounds each trajectory (<= the
    generator's). ``seed`` fixes env seeds and per-request sampling seeds, so a run's random draws
    are the same whatever the batching; its logits can differ in their last bits with the steps each
    turn shared, so async runs of one seed agree in distribution, not bit for bit (docs/models.md,
    "What a seed fixes"). ``return_routed_experts=False`` samples without routes (captured all
    False).

    ``chat=True``: ``env_factory()`` gives :class:`~r3jax.rollout.chat.ChatEnv` environments (messages
    in, messages out) and each turn goes through the server's ``/v1/chat/completions`` (the generator
    must be a ``RemoteInferenceClient``). The server renders the conversation; a rendering that
    rewrites earlier tokens gets their rows again (``on_prefix_break="resend"``, noted in
    ``TurnStats.rerendered_from``) or raises ``PrefixMismatchError`` (``"raise"``).
    """

    def __init__(self, generator: Any, env_factory: Callable[[], Env], *, max_turns: int,
                 max_seq_len: int, sampling: SamplingParams | dict | None = None,
                 full_regather: bool = False, return_routed_experts: bool = True,
                 max_concurrency: int = 64, mode: str = "auto", seed: int = 0,
                 session_prefix: str = "r3", chat: bool = False, on_prefix_break: str = "resend"):
        for name, v in (("max_turns", max_turns), ("max_seq_len", max_seq_len),
                        ("max_concurrency", max_concurrency)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "max_seq_len" else 1):
                raise ValueError(f"{name}={v!r}: expected an int >= {2 if name == 'max_seq_len' else 1}")
        if mode not in ("auto", "batched", "async"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'batched' or 'async'")
        if mode == "async" and not hasattr(generator, "agenerate"):
            raise ValueError(f"mode='async': generator {type(generator).__name__} has no agenerate")
        if on_prefix_break not in ON_PREFIX_BREAK:
            raise ValueError(f"on_prefix_break={on_prefix_break!r}: expected one of {ON_PREFIX_BREAK}")
        if chat and not (hasattr(generator, "achat") and hasattr(generator, "atokenize_chat")):
            raise ValueError(f"chat=True: generator {type(generator).__name__} has no achat / atokenize_chat "
                             "(use a RemoteInferenceClient of a server with a chat template)")
        if chat and mode == "batched":
            raise ValueError("chat=True drives each trajectory as its own task: mode must be 'auto' or 'async'")
        self.chat, self.on_prefix_break = bool(chat), on_prefix_break
        self.generator, self.env_factory = generator, env_factory
        self.max_turns, self.max_seq_len = max_turns, max_seq_len
        if isinstance(sampling, dict):
            sampling = SamplingParams(**sampling)
        self.sampling = sampling or SamplingParams()
        self.full_regather, self.return_routed_experts = full_regather, return_routed_experts
        self.max_concurrency, self.seed, self.session_prefix = max_concurrency, seed, session_prefix
        self.mode = ("async" if hasattr(generator, "agenerate") else "batched") if mode == "auto" else mode
        self._info: dict | None = None
        self._next_group = 0
        self._aio: asyncio.AbstractEventLoop | None = None

    @property
    def info(self) -> dict:
        """The generator's model info (fetched once; ``max_seq_len`` checked against ours)."""
        if self._info is None:
            info = describe(self.generator)
            if self.max_seq_len > info["max_seq_len"]:
                raise ValueError(f"max_seq_len={self.max_seq_len}: expected <= the generator's "
                                 f"max_seq_len={info['max_seq_len']}")
            self._info = info
        return self._info

    def _episodes(self, n_prompts: int, samples_per_prompt: int, env_seeds,
                  with_routes: bool) -> list[Episode]:
        for name, v in (("n_prompts", n_prompts), ("samples_per_prompt", samples_per_prompt)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an int >= 1")
        if env_seeds is not None and len(env_seeds) != n_prompts:
            raise ValueError(f"env_seeds has {len(env_seeds)} seeds: expected n_prompts={n_prompts}")
        groups = range(self._next_group, self._next_group + n_prompts)
        self._next_group += n_prompts
        seeds = env_seeds if env_seeds is not None else [request_seed(self.seed, 1 << 30, g) for g in groups]
        self.info  # fetch (and check) before building environments
        kind = ChatEpisode if self.chat else Episode
        return [kind(self, g, s, int(es), with_routes) for g, es in zip(groups, seeds)
                for s in range(samples_per_prompt)]

    def run(self, n_prompts: int, samples_per_prompt: int = 1, *,
            env_seeds: Sequence[int] | None = None) -> list[Trajectory]:
        """``n_prompts`` environments × ``samples_per_prompt`` samples each, ordered by prompt then
        sample (samples of a prompt share ``group`` and env seed). New env seeds every call unless
        ``env_seeds`` is given. Not callable from a running event loop: use :meth:`arun` there."""
        if self.mode == "async":
            # One event loop for all runs, so the client's per-loop HTTP connections are reused.
            if self._aio is None or self._aio.is_closed():
                self._aio = asyncio.new_event_loop()
            return self._aio.run_until_complete(self.arun(n_prompts, samples_per_prompt, env_seeds=env_seeds))
        episodes = self._episodes(n_prompts, samples_per_prompt, env_seeds, self.return_routed_experts)
        drive_batched(episodes, lambda live, requests: generate_in_chunks(self.generator, requests))
        return [e.result() for e in episodes]

    async def arun(self, n_prompts: int, samples_per_prompt: int = 1, *,
                   env_seeds: Sequence[int] | None = None) -> list[Trajectory]:
        """:meth:`run` from inside an event loop (requires ``agenerate``)."""
        if not hasattr(self.generator, "agenerate"):
            raise ValueError(f"arun: generator {type(self.generator).__name__} has no agenerate")
        if self._info is None:
            self._info = await asyncio.to_thread(lambda: self.info)
        episodes = self._episodes(n_prompts, samples_per_prompt, env_seeds, self.return_routed_experts)
        if self.chat:
            await drive_chat(episodes, self.generator, self.max_concurrency)
        else:
            await drive_concurrently(episodes, self.generator.agenerate, self.max_concurrency)
        return [e.result() for e in episodes]

    def demonstrations(self, n_prompts: int, *, env_seeds: Sequence[int] | None = None) -> list[Trajectory]:
        """Oracle trajectories for a supervised warm-up: each turn's action is the environment's
        ``reference_action()`` (cut at ``max_tokens``), in the same token format as :meth:`run`.
        ``loss_mask`` is 1 on the oracle's tokens; logprobs are 0 and no routes are captured."""
        if self.chat:
            raise ValueError("demonstrations: not for chat=True (the oracle speaks tokens)")
        episodes = self._episodes(n_prompts, 1, env_seeds, with_routes=False)
        drive_batched(episodes, oracle_generate)
        return [e.result() for e in episodes]

    def close(self) -> None:
        """Close the event loop :meth:`run` uses in async mode, and the generator's connections
        opened from it (``aclose``); the generator stays usable."""
        if self._aio is not None and not self._aio.is_closed():
            if hasattr(self.generator, "aclose"):
                self._aio.run_until_complete(self.generator.aclose())
            self._aio.close()

    def __enter__(self) -> "AgentLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
