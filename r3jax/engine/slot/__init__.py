"""The previous engine (fixed decode slots with contiguous caches), kept for side-by-side measurements."""

from r3jax.engine.slot.engine import SlotEngine

__all__ = ["SlotEngine"]
