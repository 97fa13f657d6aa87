"""Weight-only int8 and fp8 fake quantisation: the CPU stand-ins for the FP8 rollouts of production RL
stacks.

``quantize_int8(params)`` rounds every matmul weight to symmetric int8 (``quantize_fp8(params)``: to
float8_e4m3fn) with one scale per output channel and dequantizes it back to the parameter's dtype, so
the result drops into
``Engine.set_weights`` (same shapes and dtypes) and the rollout computes with the rounded weights.
What a serving stack keeps in high precision stays exact: embeddings, the LM head, norm scales and
every other 1-D parameter (biases included). The router is quantized only when asked
(``quantize_router=True``); FP8 serving usually keeps it in bf16, the default here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.stacking import is_stacked, path_names

INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn (1.75 * 2**8; the format has no inf)
_KEEP = ("embed", "lm_head")  # path parts never quantized (vocab tables)


def is_router_path(path) -> bool:
    """True for parameters of a router (any path part containing "router")."""
    return any("router" in n for n in path_names(path))


def quantized_leaf(path, x, *, quantize_router: bool) -> bool:
    """Whether :func:`quantize_int8` / :func:`quantize_fp8` round the leaf at ``path``: a matmul weight
    (ndim >= 2, not counting the leading layer axis of stacked layers) that is not an embedding / LM
    head, and not a router unless ``quantize_router``."""
    names = path_names(path)
    if jnp.ndim(x) - is_stacked(path) < 2 or not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        return False
    if any(n in _KEEP for n in names):
        return False
    return quantize_router or not is_router_path(path)


def fake_quant_int8(w: jax.Array) -> jax.Array:
    """Symmetric per-output-channel int8 round trip of a weight ``[..., in, out]`` (``x @ w``).

    One scale per output channel (and per leading index, e.g. per expert of ``[E, D, I]``, per layer
    of stacked layers):
    ``s = max|w[..., :, j]| / 127``, ``w' = clip(round(w / s), -127, 127) * s`` in w's dtype. An
    all-zero channel stays zero.
    """
    w32 = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2, keepdims=True)  # [..., 1, out]
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -INT8_MAX, INT8_MAX)
    return (q * scale).astype(jnp.asarray(w).dtype)


def fake_quant_fp8(w: jax.Array) -> jax.Array:
    """Per-output-channel float8_e4m3fn round trip of a weight ``[..., in, out]`` (``x @ w``).

    One scale per output channel (and per leading index, as :func:`fake_quant_int8`):
    ``s = max|w[..., :, j]| / 448``, ``w' = e4m3(w / s) * s`` in w's dtype, the cast rounding to
    nearest even. e4m3 keeps 3 mantissa bits, so a scaled value in the normal range loses at most half
    a step, ``2**-4`` of its magnitude; below 2**-6 (subnormals) the step is 2**-9, so
    ``|w - w'| <= max(2**-4 |w|, 2**-10 s)``. An all-zero channel stays zero.
    """
    w32 = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2, keepdims=True)  # [..., 1, out]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    # clip: w / s may round just past 448, and e4m3fn turns overflow into NaN, not the max
    q = jnp.clip(w32 / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * scale).astype(jnp.asarray(w).dtype)


def _quantize(fake_quant, params, quantize_router: bool):
    def q(path, x):
        return fake_quant(x) if quantized_leaf(path, x, quantize_router=quantize_router) else x

    return jax.tree_util.tree_map_with_path(q, params)


def quantize_int8(params, *, quantize_router: bool = False):
    """The parameter pytree (e.g. ``nnx.State`` of ``nnx.Param``) with every matmul weight int8
    fake-quantized by :func:`fake_quant_int8`; other leaves are returned unchanged (same objects).

    Pure: ``params`` is not modified. Shapes and dtypes are kept, so
    ``engine.set_weights(quantize_int8(params))`` gives int8 weight-only rollouts.
    """
    return _quantize(fake_quant_int8, params, quantize_router)


def quantize_fp8(params, *, quantize_router: bool = False):
    """:func:`quantize_int8` with :func:`fake_quant_fp8`: the same leaves rounded (matmul weights; not
    the embedding, LM head, 1-D parameters, nor the router unless ``quantize_router``), to
    float8_e4m3fn with per-output-channel scales. ``engine.set_weights(quantize_fp8(params))`` gives fp8
    weight-only rollouts."""
    return _quantize(fake_quant_fp8, params, quantize_router)
