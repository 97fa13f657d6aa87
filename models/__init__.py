"""Flax NNX Mixture-of-Experts transformer that exposes and replays its routes."""

from models.cache import KVCache
from models.config import MoeConfig
from models.replay import Replay, validate_replay
from models.transformer import ModelOutput, MoeTransformer

__all__ = ["KVCache", "ModelOutput", "MoeConfig", "MoeTransformer", "Replay", "validate_replay"]
