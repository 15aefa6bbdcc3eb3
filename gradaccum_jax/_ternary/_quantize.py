"""Ternary quantizers: TernGrad's stochastic rounding and TWN's threshold.

A ternary code stores each gradient element as one of {-1, 0, +1} times one
float32 scale per tensor. Two quantizers are provided:

- stochastic (TernGrad; Wen et al., "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017): an unbiased
  randomized rounding, used when the codes are summed (across devices or
  micro-steps), because unbiased errors average out;
- deterministic (TWN; Li & Liu, "Ternary Weight Networks", 2016): a fixed
  threshold, lower variance but biased, used with error feedback.

The building blocks (clipping, codes from given uniforms, stochastic
rounding) are shared by `ternarize`, the device mean and the accumulator.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks

# TWN (Li & Liu 2016): delta = 0.7 * E|x| approximates the threshold that
# minimizes the L2 error of a ternary code for uniform or Gaussian values.
_TWN_THRESHOLD = 0.7


def validate_clip_sigma(value: Any) -> float | None:
    """Validates ``clip_sigma``: None (no clipping) or a positive finite float."""
    if value is None:
        return None
    return _checks.positive_finite("clip_sigma", value)


def _max_abs_and_rms(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns max|x| and sqrt(mean(x**2)) of a float32 array.

    The root mean square is computed on x / max|x| so that x**2 cannot
    overflow float32 for large (but finite) gradients.
    """
    max_abs = jnp.max(jnp.abs(x), initial=0.0)
    safe_max = jnp.where(max_abs > 0, max_abs, 1.0)
    rms = max_abs * jnp.sqrt(jnp.mean(jnp.square(x / safe_max)))
    return max_abs, rms


def clip_to_sigma(x: jax.Array, clip_sigma: float | None) -> jax.Array:
    """TernGrad's gradient clipping to ``clip_sigma`` standard deviations.

    The standard deviation is taken about zero (the root mean square): it is
    the paper's sigma for zero-mean gradients, and unlike the deviation about
    the mean it is not 0 for a constant non-zero tensor (which would
    otherwise be clipped to all zeros).
    """
    if clip_sigma is None:
        return x
    _, rms = _max_abs_and_rms(x)
    bound = clip_sigma * rms
    return jnp.clip(x, -bound, bound)


def codes_from_uniform(x: jax.Array, scale: jax.Array, uniform: jax.Array) -> jax.Array:
    """Int8 codes with P(code = sign(x)) = |x| / scale, else 0.

    ``uniform`` holds independent U[0, 1) draws shaped like ``x``. Requires
    |x| <= scale. E[code * scale] = x exactly (up to the 2**-23 resolution
    of a float32 uniform draw), and scale = 0 gives all-zero codes.
    """
    safe_scale = jnp.where(scale > 0, scale, 1.0)
    probability = jnp.where(scale > 0, jnp.abs(x) / safe_scale, 0.0)
    return jnp.where(uniform < probability, jnp.sign(x), 0.0).astype(jnp.int8)


def stochastic_codes(x: jax.Array, scale: jax.Array, key: jax.Array) -> jax.Array:
    """`codes_from_uniform` with fresh draws from ``key``."""
    return codes_from_uniform(x, scale, jax.random.uniform(key, x.shape))


def stochastic_round(x: jax.Array, uniform: jax.Array) -> jax.Array:
    """Rounds to floor(x) or floor(x) + 1 with E[result] = x (float32 out)."""
    low = jnp.floor(x)
    return low + (uniform < x - low)


def poison_if_nonfinite(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Makes ``scale`` NaN when ``x`` holds any NaN or infinity.

    Every dequantized element is then NaN (0 * NaN = NaN), so a non-finite
    gradient stays visible to e.g. `skip_not_finite` instead of being
    silently rounded to finite codes.
    """
    return jnp.where(jnp.all(jnp.isfinite(x)), scale, jnp.nan)


def ternary_quantize(
    x: jax.Array,
    key: jax.Array | None = None,
    *,
    clip_sigma: float | None = 2.5,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes a tensor to ternary codes and one float32 scale.

    With a ``key``, TernGrad's stochastic ternarization (Wen et al., NeurIPS
    2017): ``x`` is clipped to ``clip_sigma`` standard deviations (taken about
    zero, see below), ``scale = max|clipped x|``, and each code is ``sign(x)``
    with probability ``|clipped x| / scale``, else 0. Hence
    ``E[dequantize(codes, scale)] = clipped x``: exactly unbiased for ``x``
    when ``clip_sigma=None``; clipping trades a small bias on the outliers
    for a smaller scale, hence much less variance on everything else.

    Without a key, TWN's deterministic threshold (Li & Liu, "Ternary Weight
    Networks", 2016): ``delta = 0.7 * mean|x|``, ``codes = sign(x)`` where
    ``|x| > delta`` else 0, and ``scale`` the mean of ``|x|`` over those
    elements (the L2-optimal scale for that support). Biased but
    low-variance; use it with error feedback. ``clip_sigma`` is ignored:
    the threshold is already robust to outliers.

    The standard deviation used for clipping is the root mean square of
    ``x``: the paper's sigma for zero-mean gradients, and never zero for a
    non-zero tensor, so ``clip_sigma >= 1`` never clips a tensor to zeros.

    An all-zero ``x`` gives all-zero codes and scale 0 (no NaN). A ``x``
    holding any NaN or infinity gives ``scale = NaN`` and codes that are
    still valid values in {-1, 0, 1} but carry no meaning: the dequantized
    tensor is all NaN, so the non-finite input stays visible downstream.

    Args:
      x: a floating-point array of any shape (computed in float32).
      key: a PRNG key (typed or raw uint32) for stochastic rounding, or None
        for the deterministic threshold.
      clip_sigma: clip to this many standard deviations before stochastic
        rounding; None disables clipping. Must be > 0.

    Returns:
      ``(codes, scale)``: int8 codes in {-1, 0, 1} shaped like ``x``, and a
      float32 scalar scale; ``ternary_dequantize(codes, scale)`` reconstructs.
    """
    clip_sigma = validate_clip_sigma(clip_sigma)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"ternary_quantize: `x` must be a floating-point array, got dtype "
            f"{x.dtype.name}; cast it first (x.astype(jnp.float32))."
        )
    x = x.astype(jnp.float32)
    if key is None:
        magnitude = jnp.abs(x)
        support = magnitude > _TWN_THRESHOLD * jnp.mean(magnitude)
        count = jnp.sum(support)
        scale = jnp.sum(jnp.where(support, magnitude, 0.0)) / jnp.maximum(count, 1)
        codes = jnp.where(support, jnp.sign(x), 0.0).astype(jnp.int8)
    else:
        clipped = clip_to_sigma(x, clip_sigma)
        scale = jnp.max(jnp.abs(clipped), initial=0.0)
        codes = stochastic_codes(clipped, scale, key)
    return codes, poison_if_nonfinite(x, scale.astype(jnp.float32))


def ternary_dequantize(
    codes: jax.Array, scale: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """Reconstructs ``codes * scale``, the inverse of `ternary_quantize`.

    Also reconstructs summed codes (e.g. a window's or the devices' sums,
    any integer dtype) against their shared scale.

    Args:
      codes: integer codes (int8 from `ternary_quantize`, or their sums).
      scale: the float32 scale (a scalar, or anything that broadcasts).
      dtype: the floating dtype of the result.

    Returns:
      ``codes * scale`` in ``dtype``.
    """
    product = jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return product.astype(dtype)
