"""Multi-turn rollouts that build routed-expert traces incrementally (docs/design.md §3–§5).

``AgentLoop(generator, env_factory, ...).run(n_prompts, samples_per_prompt) -> list[Trajectory]``
against the in-process ``Engine`` or the ``RemoteInferenceClient``; built-in toy environments and
tokenizers; a deterministic :class:`FakeGenerator` for tests. One concept per module: ``episode``
(one trajectory in flight), ``batched`` / ``concurrent`` / ``demonstrations`` (the three drivers),
``sampling``, ``model_info``, ``chat`` (trajectories through an OpenAI chat endpoint), ``agent_loop``
(settings and driver choice).
"""

from r3jax.rollout.agent_loop import AgentLoop
from r3jax.rollout.chat import ChatEnv, ChatEpisode
from r3jax.rollout.env import Env, FullPrompt, PrefixMismatchError, check_prefix
from r3jax.rollout.envs import ENVS, ArithmeticEnv, ArithmeticState, GuessNumberEnv, GuessState, make_env
from r3jax.rollout.episode import Episode, MissingRoutesError
from r3jax.rollout.fake import FakeGenerator, positional_routes
from r3jax.rollout.model_info import describe
from r3jax.rollout.sampling import SamplingParams
from r3jax.rollout.tokenizer import ByteTokenizer, ChatTokenizer, HFChatTokenizer
from r3jax.rollout.trajectory import Trajectory, TurnStats

__all__ = ["AgentLoop", "ArithmeticEnv", "ArithmeticState", "ByteTokenizer", "ChatEnv", "ChatEpisode",
           "ChatTokenizer", "ENVS",
           "Env", "Episode", "FakeGenerator", "FullPrompt", "GuessNumberEnv", "GuessState", "HFChatTokenizer",
           "MissingRoutesError", "PrefixMismatchError", "SamplingParams", "Trajectory", "TurnStats",
           "check_prefix", "describe", "make_env", "positional_routes"]
