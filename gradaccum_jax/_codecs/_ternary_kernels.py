"""Ternary quantizers: TernGrad's stochastic rounding and TWN's threshold.

A ternary code stores each gradient element as one of {-1, 0, +1} times one
float32 scale per tensor. Two quantizers are provided:

- stochastic (TernGrad; Wen et al., "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017): an unbiased
  randomized rounding, used when the codes are summed (across devices or
  micro-steps), because unbiased errors average out;
- deterministic (TWN; Li & Liu, "Ternary Weight Networks", 2016): a fixed
  threshold, lower variance but biased, used with error feedback.

The building blocks (one-pass scale and clipping bound, codes from
counter-based random bits) are shared by `ternarize`, the device mean and
the accumulator.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks
from gradaccum_jax._compression import _blocks, _random
from gradaccum_jax._control import run_if

# TWN (Li & Liu 2016): delta = 0.7 * E|x| approximates the threshold that
# minimizes the L2 error of a ternary code for uniform or Gaussian values.
_TWN_THRESHOLD = 0.7


def validate_clip_sigma(value: Any) -> float | None:
    """Validates ``clip_sigma``: None (no clipping) or a positive finite float."""
    if value is None:
        return None
    return _checks.positive_finite("clip_sigma", value)


def checked_arguments(
    seed: Any, clip_sigma: Any, min_size: Any
) -> tuple[int, float | None, int]:
    """Validates the arguments every ternary transformation takes."""
    return (
        _checks.prng_seed("seed", seed),
        validate_clip_sigma(clip_sigma),
        _checks.nonnegative_int("min_size", min_size),
    )


def biased(stochastic: bool, clip_sigma: float | None) -> bool:
    """Whether ternary codes have a bias for error feedback to keep: TWN's
    and nearest codes always, TernGrad's when it clips (unclipped, it sends
    its input in expectation; see `gradaccum_jax._compression._error_feedback`)."""
    return not stochastic or clip_sigma is not None


def scale_and_bound(
    x: jax.Array,
    clip_sigma: float | None,
    weight: jax.Array | None = None,
    *,
    tight: bool = False,
    split: _blocks.Split = _blocks.WHOLE,
    recheck_overflow: bool = True,
    per_layer: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The scale and clipping bound of ``v``, and whether v is all finite.

    ``v = weight * x`` (``x`` itself when ``weight`` is None). The codes of
    ``v`` are drawn against ``scale`` after clipping to [-bound, bound], so
    any ``scale >= max|clip(v)|`` keeps them unbiased; the smaller the
    scale, the smaller their variance.

    With clipping, ``bound = clip_sigma * rms(v)``. The standard deviation
    is taken about zero (the root mean square): TernGrad's sigma for
    zero-mean gradients, and never 0 for a non-zero tensor, so
    ``clip_sigma >= 1`` never clips one to zeros. The scale is then:

    - ``tight``: TernGrad's ``max|clip(v)| = min(max|v|, bound)``, which
      takes a second reduction, max|v|: what `ternary_quantize` and
      `ternarize` promise. A finite ``x`` whose sum of squares overflows
      float32 (rms above ~1.8e19 / sqrt(size)) has an infinite bound and is
      merely not clipped.
    - otherwise, the bound itself: the same number whenever some element
      reaches the bound, which for a gradient-like tensor of a thousand
      elements or more is all but certain (each element of a Gaussian one
      exceeds 2.5 rms with probability 1.2 %), in one reduction, a whole
      pass over ``x`` fewer on every step. Only a tensor with no outlier at
      all (a constant one, say) gets a larger scale than TernGrad's, hence
      a larger variance, never a bias. Where the sum of squares overflows
      (rms above ~1.8e19 / sqrt(size)), and only there, ``max|x|`` is read
      as well and the scale is the tight one, unclipped: a finite ``x``
      stays finite, at no cost to the common path. (``recheck_overflow=
      False`` leaves that to the caller, which marks such an ``x`` as not
      finite: the ternary codec rechecks after its devices' pmax, where the
      question is the same on every device.)

    Without clipping the scale is ``max|v|`` and the bound +inf.

    Whether v is finite comes from the same reductions: a NaN makes the sum
    of squares NaN, an infinity makes it +inf (XLA's CPU max reduction may
    drop a NaN, a sum cannot). The weight is applied to the scalars, not to
    ``x``: XLA:CPU's reductions do not fuse an elementwise producer, so
    reducing ``weight * x`` would first write it out, a parameter-sized
    temporary and a whole extra pass. ``max|w x| = |w| max|x|`` exactly
    (rounding is monotone), and ``rms(w x) = |w| rms(x)`` up to rounding.

    ``x`` may be one device's block of the tensor, split as ``split`` over
    manual mesh axes (see `_blocks`): the sum and the maximum then cover
    the whole tensor, one scalar collective each.

    With ``per_layer``, ``x`` (of rank 2 or more) is a stack of layers
    along its leading axis (the params of a ``jax.lax.scan`` over layers):
    each layer gets a scale and a bound of its own, as separate leaves
    would, shaped ``(layers, 1, ...)`` to broadcast against ``x``, and
    ``finite`` says whether every layer is (the ternary codec's rule; a
    leaf coded alone, by `ternary_quantize`, `ternarize` or
    `ternary_accumulate`, has one scale).
    """
    within = tuple(range(1, x.ndim)) if per_layer else None
    # A layer is reduced over the blocks of its other dimensions.
    over = (None, *split[1:]) if per_layer and split else split
    sum_sq = _blocks.total(jnp.sum(jnp.square(x), axis=within), over)
    magnitude = jnp.float32(1.0) if weight is None else jnp.abs(weight)
    layer = jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if per_layer else x
    count = element_count(layer, over)
    bound = (
        jnp.full(jnp.shape(sum_sq), jnp.inf, jnp.float32)
        if clip_sigma is None
        else clip_sigma * magnitude * jnp.sqrt(sum_sq / count)
    )

    def tight_scale(_: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        # Two plain reductions, not one variadic (max, sum) reduce: XLA:CPU
        # runs plain ones as fast kernels, a variadic one through its
        # generic reduction loop, slower than both plain ones together.
        largest = jnp.max(jnp.abs(x), axis=within, initial=0.0)
        max_abs = magnitude * _blocks.maximum(largest, over)
        # A non-finite weight makes v non-finite; |w| * max|x| is then inf
        # or NaN, and NaN is not finite either. An overflowed sum of squares
        # (inf) leaves an infinite bound: no clipping.
        finite = ~jnp.isnan(sum_sq) & jnp.isfinite(max_abs)
        return jnp.minimum(max_abs, bound), bound, finite

    if clip_sigma is not None and not tight and (per_layer or not recheck_overflow):
        scale, bound, finite = bound, bound, jnp.isfinite(bound)
    elif clip_sigma is not None and not tight:
        # The sum of squares is +inf for an infinite x and for a finite one
        # that overflows it: only then is max|x| read, to tell them apart.
        # A cond of scalars (a select of both where its predicate is mapped
        # over workers: no collective decides it), not `run_if`'s loop,
        # whose predicate a map over workers all-reduces.
        loose = (bound, bound, jnp.isfinite(bound))
        return run_if(jnp.isinf(sum_sq), tight_scale, loose)
    else:
        scale, bound, finite = tight_scale(None)
    if not per_layer:
        return scale, bound, finite
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return scale.reshape(shape), bound.reshape(shape), jnp.all(finite)


def element_count(x: Any, split: _blocks.Split = _blocks.WHOLE) -> jax.Array:
    """The number of elements of the leaf whose block is ``x``, as float32
    (at least 1, the divisor of a mean over them).

    A float32, not the Python int: JAX turns a Python int operand into an
    int32, which a leaf of 2**31 elements or more (8 GiB of float32, one
    stacked weight of a 70B-class model) overflows, an OverflowError when
    the step is traced. The count's float32 rounding (a relative 6e-8) is
    far below that of the float32 sum it divides.
    """
    return jnp.float32(max(_blocks.size(x.size, split), 1))


def clip(x: jax.Array, bound: jax.Array) -> jax.Array:
    """``x`` clipped to [-bound, bound] (bound may be +inf)."""
    return jnp.clip(x, -bound, bound)


def code_thresholds(x: jax.Array, scale: jax.Array, bound: jax.Array) -> jax.Array:
    """`_random.threshold` of P(code != 0) = |clip(x, bound)| / scale.

    Requires ``scale >= max|clip(x, bound)|``; scale 0 gives all-zero
    thresholds. Two scalars are computed once so that each element costs a
    multiply, a minimum and a conversion.
    """
    positive = scale > 0
    per_unit = jnp.where(
        positive, _random.PROBABILITY_ONE / jnp.where(positive, scale, 1), 0
    )
    cap = jnp.minimum(bound * per_unit, _random.PROBABILITY_ONE)
    # = _random.threshold(p), with 2**24 / scale folded into one multiply.
    # |x * per_unit| rather than |x| * per_unit: XLA would share |x| with the
    # max|x| reduction by writing it out, a whole extra pass over x.
    return jnp.minimum(jnp.abs(x * per_unit), cap).astype(jnp.int32)


def codes_from_bits(
    x: jax.Array, scale: jax.Array, bound: jax.Array, random_bits: jax.Array
) -> jax.Array:
    """Int8 codes with P(code = sign(x)) = |clip(x, bound)| / scale, else 0.

    ``random_bits`` holds independent uint32 draws shaped like ``x`` (see
    `_random.bits`). Requires ``scale >= max|clip(x, bound)|``. The
    probability is resolved to 2**-24 (`_random.bernoulli`), so
    ``E[code * scale]`` is within ``scale * 2**-24`` of ``clip(x)``; scale
    0 gives all-zero codes.
    """
    fires = _random.bernoulli(random_bits, code_thresholds(x, scale, bound))
    sign = jnp.where(x > 0, jnp.int8(1), jnp.int8(-1))
    return jnp.where(fires, sign, jnp.int8(0))


def stochastic_codes(
    x: jax.Array,
    scale: jax.Array,
    bound: jax.Array,
    stream: jax.Array,
    split: _blocks.Split = _blocks.WHOLE,
) -> jax.Array:
    """`codes_from_bits` with the draws of a `_random.stream` (``x`` a block
    split as ``split``: its elements' draws in the whole tensor)."""
    return codes_from_bits(x, scale, bound, _random.bits(stream, x, split))


def poison_if_nonfinite(finite: jax.Array, scale: jax.Array) -> jax.Array:
    """Makes ``scale`` NaN unless ``finite`` (x held no NaN or infinity).

    Every dequantized element is then NaN (0 * NaN = NaN), so a non-finite
    gradient stays visible to e.g. `skip_not_finite` instead of being
    silently rounded to finite codes.
    """
    return jnp.where(finite, scale, jnp.nan)


def ternary_quantize(
    x: jax.Array,
    key: jax.Array | None = None,
    *,
    clip_sigma: float | None = 2.5,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes a tensor to ternary codes and one float32 scale.

    With a ``key``, TernGrad's stochastic ternarization (Wen et al., NeurIPS
    2017): ``x`` is clipped to ``clip_sigma`` standard deviations (taken about
    zero, see below), ``scale = max|clipped x|``, and each code is
    ``sign(x)`` with probability ``|clipped x| / scale``, else 0. Hence
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
    (`ternary_accumulate` and `ternary_average_across_devices` take the
    clipping bound itself as the scale: the same number whenever an element
    reaches the bound, one pass over the gradient fewer.)

    An all-zero ``x`` gives all-zero codes and scale 0 (no NaN). A ``x``
    holding any NaN or infinity gives ``scale = NaN`` and codes that are
    still valid values in {-1, 0, 1} but carry no meaning: the dequantized
    tensor is all NaN, so the non-finite input stays visible downstream.

    Example:

    >>> import jax.numpy as jnp
    >>> from gradaccum_jax import ternary_dequantize, ternary_quantize
    >>> codes, scale = ternary_quantize(jnp.array([0.9, -0.1, -1.1, 0.05]))  # TWN
    >>> codes, scale
    (Array([ 1,  0, -1,  0], dtype=int8), Array(1., dtype=float32))
    >>> ternary_dequantize(codes, scale)
    Array([ 1.,  0., -1.,  0.], dtype=float32)

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
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise ValueError(
            f"ternary_quantize: `x` has dtype {x.dtype.name}: a complex array "
            "has no ternary code (a sign and a real scale), and casting it to "
            "float32 would drop its imaginary part. Quantize jnp.real(x) and "
            "jnp.imag(x) separately."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"ternary_quantize: `x` must be a floating-point array, got dtype "
            f"{x.dtype.name}; cast it first (x.astype(jnp.float32))."
        )
    x = x.astype(jnp.float32)
    if key is None:
        magnitude = jnp.abs(x)
        support = magnitude > _TWN_THRESHOLD * jnp.mean(magnitude)
        # Counted in float32: an int32 count wraps past 2**31 elements.
        count = jnp.sum(support, dtype=jnp.float32)
        scale = jnp.sum(jnp.where(support, magnitude, 0.0)) / jnp.maximum(count, 1)
        codes = jnp.where(support, jnp.sign(x), 0.0).astype(jnp.int8)
        finite = jnp.all(jnp.isfinite(x))
    else:
        scale, bound, finite = scale_and_bound(x, clip_sigma, tight=True)
        codes = stochastic_codes(x, scale, bound, _random.stream_from_key(key))
    return codes, poison_if_nonfinite(finite, scale.astype(jnp.float32))


def ternary_dequantize(
    codes: jax.Array, scale: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """Reconstructs ``codes * scale``, the inverse of `ternary_quantize`.

    Also reconstructs summed codes (e.g. a window's or the devices' sums,
    any integer dtype) against their shared scale.

    Example:

    >>> import jax.numpy as jnp
    >>> from gradaccum_jax import ternary_dequantize
    >>> summed = jnp.array([3, 0, -2], jnp.int16)  # e.g. codes summed over a window
    >>> ternary_dequantize(summed, jnp.float32(0.5), dtype=jnp.bfloat16)
    Array([1.5, 0, -1], dtype=bfloat16)

    Args:
      codes: integer codes (int8 from `ternary_quantize`, or their sums).
      scale: the float32 scale (a scalar, or anything that broadcasts).
      dtype: the floating dtype of the result.

    Returns:
      ``codes * scale`` in ``dtype``.
    """
    product = jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return product.astype(dtype)
