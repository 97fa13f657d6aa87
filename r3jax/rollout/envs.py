"""Built-in toy multi-turn environments: no download, deterministic seeds, learnable by a tiny model.

Each turn's expected action is one digit followed by the stop token; rewards lie in [0, 1] over a
whole episode, with partial credit. Every environment exposes ``state`` (a frozen dataclass) and
``reference_action(state)``: the oracle's action tokens (stop token included) that a supervised
warm-up can imitate (see :func:`r3jax.rollout.demonstrations`).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from r3jax.rollout.tokenizer import ByteTokenizer, ChatTokenizer


class _TokenEnv:
    """Shared plumbing: a chat tokenizer, its stop/eos ids, and action parsing."""

    def __init__(self, tokenizer: ChatTokenizer | None):
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.stop_token_ids = tuple(self.tokenizer.stop_token_ids)
        self.eos_id = self.stop_token_ids[0]
        self._state = None

    @property
    def state(self):
        if self._state is None:
            raise ValueError(f"{type(self).__name__}.state: call reset(seed) first")
        return self._state

    def _digit(self, action: Sequence[int]) -> int | None:
        """The action as one digit 0..9 (surrounding spaces ignored), else None."""
        text = self.tokenizer.decode(list(action), skip_special_tokens=True).strip()
        return int(text) if len(text) == 1 and text.isdigit() else None

    def _say(self, digit: int) -> list[int]:
        return self.tokenizer.encode(str(digit)) + [self.eos_id]


@dataclasses.dataclass(frozen=True)
class ArithmeticState:
    total: int      # the running total the model should have
    addend: int     # the number asked about this turn
    turn: int       # 0-based turn index
    num_turns: int


class ArithmeticEnv(_TokenEnv):
    """A running-sum dialogue modulo 10: ``"3+4="`` → ``"7"``, then ``"7+2="`` → ``"9"``, ...

    Each question starts from the *correct* previous total, so a wrong answer is corrected by the
    next question. Per turn: 1 for the right digit, 0.2 for a wrong digit (format credit), 0
    otherwise; scaled by ``1 / num_turns`` so an episode's reward is in [0, 1]. Addends are drawn
    from ``0..max_addend``; ``max_addend=0`` is the "echo" task (repeat the running total), which a
    tiny model learns by RL within a few dozen steps.
    """

    def __init__(self, tokenizer: ChatTokenizer | None = None, *, num_turns: int = 3, max_addend: int = 9):
        if isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 1:
            raise ValueError(f"num_turns={num_turns!r}: expected an int >= 1")
        if isinstance(max_addend, bool) or not isinstance(max_addend, int) or not 0 <= max_addend <= 9:
            raise ValueError(f"max_addend={max_addend!r}: expected an int in [0, 9]")
        super().__init__(tokenizer)
        self.num_turns, self.max_addend = num_turns, max_addend
        self._rng = random.Random(0)

    @staticmethod
    def question(state: ArithmeticState) -> str:
        return f"{state.total}+{state.addend}="

    def reset(self, seed: int) -> list[int]:
        self._rng = random.Random(seed)
        self._state = ArithmeticState(self._rng.randrange(10), self._rng.randrange(self.max_addend + 1), 0,
                                     self.num_turns)
        return self.tokenizer.initial_prompt(self.question(self._state))

    def reference_action(self, state: ArithmeticState | None = None) -> list[int]:
        s = self.state if state is None else state
        return self._say((s.total + s.addend) % 10)

    def step(self, action: Sequence[int]) -> tuple[list[int], float, bool]:
        s = self.state
        answer, got = (s.total + s.addend) % 10, self._digit(action)
        credit = 0.0 if got is None else (1.0 if got == answer else 0.2)
        turn = s.turn + 1
        self._state = ArithmeticState(answer, self._rng.randrange(self.max_addend + 1), turn, s.num_turns)
        if turn == s.num_turns:
            return [], credit / s.num_turns, True
        return self.tokenizer.observation(self.question(self._state)), credit / s.num_turns, False


@dataclasses.dataclass(frozen=True)
class GuessState:
    secret: int
    low: int        # the secret is known to lie in [low, high]
    high: int
    guesses: int    # guesses made so far
    max_guesses: int


class GuessNumberEnv(_TokenEnv):
    """Guess a secret digit 0..9 with higher/lower feedback: the reply is ``"h"`` (higher),
    ``"l"`` (lower) or ``"?"`` (not a digit).

    Reward (at the end): ``1 - 0.1 * (guesses - 1)`` when found; otherwise
    ``0.3 * (1 - |last digit guessed - secret| / 9)`` (0 if no digit was ever guessed). Binary
    search (the oracle) always finds it within 4 guesses.
    """

    def __init__(self, tokenizer: ChatTokenizer | None = None, *, max_guesses: int = 4):
        if isinstance(max_guesses, bool) or not isinstance(max_guesses, int) or max_guesses < 1:
            raise ValueError(f"max_guesses={max_guesses!r}: expected an int >= 1")
        super().__init__(tokenizer)
        self.max_guesses = max_guesses
        self._last: int | None = None

    def reset(self, seed: int) -> list[int]:
        self._state = GuessState(random.Random(seed).randrange(10), 0, 9, 0, self.max_guesses)
        self._last = None
        return self.tokenizer.initial_prompt("guess 0-9")

    def reference_action(self, state: GuessState | None = None) -> list[int]:
        s = self.state if state is None else state
        return self._say((s.low + s.high) // 2)

    def step(self, action: Sequence[int]) -> tuple[list[int], float, bool]:
        s = self.state
        got = self._digit(action)
        low, high, n = s.low, s.high, s.guesses + 1
        if got is not None:
            self._last = got
            if got < s.secret:
                low = max(low, got + 1)
            elif got > s.secret:
                high = min(high, got - 1)
        self._state = GuessState(s.secret, low, high, n, s.max_guesses)
        if got == s.secret:
            return [], 1.0 - 0.1 * (n - 1), True
        if n == s.max_guesses:
            partial = 0.0 if self._last is None else 0.3 * (1 - abs(self._last - s.secret) / 9)
            return [], partial, True
        reply = "?" if got is None else ("h" if got < s.secret else "l")
        return self.tokenizer.observation(reply), 0.0, False


def EchoEnv(tokenizer: ChatTokenizer | None = None, *, num_turns: int = 3) -> ArithmeticEnv:
    """The running-sum dialogue with every addend 0: repeat the total (the demo's default task)."""
    return ArithmeticEnv(tokenizer, num_turns=num_turns, max_addend=0)


ENVS = {"arithmetic": ArithmeticEnv, "echo": EchoEnv, "guess_number": GuessNumberEnv}


def make_env(name: str, tokenizer: ChatTokenizer | None = None, **kwargs):
    """A built-in environment by name: ``"arithmetic"``, ``"echo"`` or ``"guess_number"``."""
    if name not in ENVS:
        raise ValueError(f"env={name!r}: expected one of {sorted(ENVS)}")
    return ENVS[name](tokenizer, **kwargs)
