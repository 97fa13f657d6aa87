"""A finished multi-turn rollout: tokens, masks, rollout logprobs, reward and per-token routes.

Every per-token field is indexed by the absolute position i in ``tokens = prompt_ids +
response_ids`` (N tokens), the same index as row i of ``routes`` (docs/design.md §3), which is what
:func:`r3jax.batch.collate` reads: ``tokens``, ``loss_mask``, ``rollout_logprobs``, ``advantage``,
``routes`` and ``captured``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from r3jax.trace import token_versions


@dataclasses.dataclass(frozen=True)
class TurnStats:
    """Accounting of one generator call of a trajectory.

    ``routes_start``: the ``routed_experts_prompt_start`` sent; ``route_rows`` / ``route_bytes``:
    rows received and their raw size (``rows * L * K * itemsize``); ``prompt_tokens``: tokens sent;
    ``cached_tokens``: of those, served from the generator's prefix cache (None: not reported); ``generated_tokens``;
    ``observation_tokens``: appended after this turn (0 on the last); ``synthetic_eos``: an EOS
    was appended (loss-masked) because the turn hit ``max_tokens``. ``rerendered_from``: chat turns
    only, the token d at which the server's rendering of the conversation first differed from the tokens
    already in the trajectory (a template that is not prefix-stable): those tokens were replaced and
    the rows from ``min(d, rows held)`` asked for again (``routes_start``); None when the rendering
    kept every earlier token.
    """

    routes_start: int
    route_rows: int
    route_bytes: int
    prompt_tokens: int
    cached_tokens: int | None
    generated_tokens: int
    observation_tokens: int
    finish_reason: str
    weight_version: int
    reward: float
    synthetic_eos: bool
    rerendered_from: int | None = None
    weight_versions: tuple = ()  # the call's ((first token index, version), ...) spans; () when not said


@dataclasses.dataclass
class Trajectory:
    """One rollout. Arrays: ``prompt_ids [P0]`` int32 (the environment's first prompt);
    ``response_ids [R]`` int32 (generated and observation tokens interleaved, synthetic EOS too);
    ``response_loss_mask [R]`` f32 (1 on generated tokens, 0 on observations and synthetic EOS);
    ``response_logprobs [R]`` f32 (rollout logprob of each generated token, 0 elsewhere);
    ``routes [N, L, K]`` in ``route_dtype(E)`` and ``captured [N]`` bool from
    :meth:`RoutedExpertTrace.finalize` (N = P0 + R); ``route_versions [N]`` int32: the weight version
    whose forward pass produced each captured row (:meth:`RoutedExpertTrace.row_versions`; -1 on
    uncaptured rows), each turn's rows keeping the version of the call that returned them.

    ``reward``: sum of the environment's step rewards; ``advantage``: set by the trainer
    (default 0). ``weight_version``: the version that sampled the first turn;
    ``weight_version_changed``: True if later turns were sampled by another version (the
    trajectory crosses a weight update). ``finish_reason``: ``"done"`` (environment),
    ``"max_turns"`` or ``"max_seq_len"`` (truncated: the next turn did not fit).
    ``group``: the prompt index (samples of one prompt share it, for group-normalised advantages).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_loss_mask: np.ndarray
    response_logprobs: np.ndarray
    routes: np.ndarray
    captured: np.ndarray
    reward: float
    turn_rewards: tuple[float, ...]
    turns: tuple[TurnStats, ...]
    weight_version: int
    weight_version_changed: bool
    finish_reason: str
    group: int = 0
    sample: int = 0
    env_seed: int = 0
    moe_layer_ids: tuple[int, ...] = ()
    advantage: float = 0.0
    route_versions: np.ndarray | None = None

    # ---- the full-sequence view that collate reads -------------------------------------------
    @property
    def tokens(self) -> np.ndarray:
        """``[N]`` int32: prompt_ids + response_ids."""
        return np.concatenate([self.prompt_ids, self.response_ids]).astype(np.int32)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_mask(self) -> np.ndarray:
        """``[N]`` f32: 0 on the prompt, then ``response_loss_mask``."""
        return np.concatenate([np.zeros(len(self.prompt_ids), np.float32), self.response_loss_mask])

    @property
    def rollout_logprobs(self) -> np.ndarray:
        """``[N]`` f32: 0 on the prompt, then ``response_logprobs``."""
        return np.concatenate([np.zeros(len(self.prompt_ids), np.float32), self.response_logprobs])

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "max_seq_len"

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def route_rows(self) -> int:
        """Route rows received over all turns (N - 1 when incremental and nothing was appended
        after the last call)."""
        return sum(t.route_rows for t in self.turns)

    @property
    def route_bytes(self) -> int:
        return sum(t.route_bytes for t in self.turns)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache over all turns; None if any turn's is unknown."""
        counts = [t.cached_tokens for t in self.turns]
        return None if None in counts else sum(counts)

    @property
    def starts(self) -> list[int]:
        """The ``routed_experts_prompt_start`` sent on each turn."""
        return [t.routes_start for t in self.turns]

    @property
    def token_versions(self) -> np.ndarray:
        """``[N]`` int32: the weight version that sampled each generated token (from each call's
        ``weight_versions`` spans, or its ``weight_version`` when the generator gave none); -1 on every
        token the loss does not train (prompt, observations, synthetic EOS)."""
        out = np.full(self.num_tokens, -1, np.int32)
        for t in self.turns:
            spans = t.weight_versions or ((0, t.weight_version),)
            out[t.prompt_tokens:t.prompt_tokens + t.generated_tokens] = token_versions(spans, t.generated_tokens)
        out[self.loss_mask == 0] = -1
        return out

    @property
    def rerendered_turns(self) -> int:
        """Chat turns whose rendered conversation differed from the tokens already recorded."""
        return sum(t.rerendered_from is not None for t in self.turns)
