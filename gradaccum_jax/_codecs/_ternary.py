"""`codecs.ternary`: TernGrad's codes, or nearest codes with error feedback."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks
from gradaccum_jax._codecs import _packing
from gradaccum_jax._codecs._protocol import Codec, CodecSum, Wire, at_least, no_state
from gradaccum_jax._codecs._ternary_kernels import (
    biased,
    clip,
    scale_and_bound,
    stochastic_codes,
    validate_clip_sigma,
)
from gradaccum_jax._compression import _blocks, _random
from gradaccum_jax._compression._leaves import DEFAULT_MIN_SIZE
from gradaccum_jax._control import run_if

_ROUNDINGS = ("stochastic", "nearest")


def ternary(
    *,
    clip_sigma: float | None = 2.5,
    rounding: str | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
) -> Codec:
    """Ternary codes: each device sends {-1, 0, 1} per element, one scale per leaf.

    The devices agree on one scale per leaf (a pmax of their scales, their
    clipping bounds of ``clip_sigma`` root-mean-squares of their inputs,
    see the roundings below; one per layer
    of a leaf of rank 3 or more, a scanned stack of layers along its
    leading axis), code their
    inputs against it, and the codes of all devices are summed by one
    packed integer all-reduce (base-(2n + 1) digits in uint32 words: 7
    codes per word with 8 devices, 1/7 of the float32 bytes).

    Two roundings:

    - ``"stochastic"``: TernGrad's (Wen et al., NeurIPS 2017), unbiased for
      the clipped input. Error feedback keeps only the clipping error:
      feeding its rounding noise back makes a larger input, hence a larger
      scale, hence more noise (on constant inputs over 8 devices the
      running mean drifts away instead of converging).
    - ``"nearest"``: the code nearest to ``input / scale``, biased, and with
      error feedback its whole error is kept and sent later: the running
      mean of the sums tends to the true one like 1/T. Each device's scale
      is the smaller of its clipping bound and its largest magnitude (one
      more reduction of the leaf): against the bound alone, a leaf whose
      elements share one magnitude (the bound 2.5x it) would never be sent.

    The default (None) is ``"nearest"`` with error feedback and
    ``"stochastic"`` without.

    Example:

    >>> from gradaccum_jax import codecs
    >>> codecs.ternary(clip_sigma=None, rounding="stochastic")
    ternary(clip_sigma=None, rounding='stochastic', min_size=256)

    Args:
      clip_sigma: the clipping bound, in root-mean-squares of each device's
        input; None: no clipping (the scale is the largest magnitude). > 0.
      rounding: ``"stochastic"``, ``"nearest"`` or None (see above).
      min_size: leaves with fewer elements are summed exactly in float32.

    Returns:
      A `gradaccum_jax.extend.Codec`.
    """
    clip_sigma = validate_clip_sigma(clip_sigma)
    if rounding is not None:
        rounding = _checks.one_of("rounding", rounding, _ROUNDINGS)
    min_size = _checks.nonnegative_int("min_size", min_size)

    def codec_sum(inputs: list[jax.Array], state: Any, key: jax.Array, wire: Wire):
        stochastic = rounding == "stochastic" or (
            rounding is None and not wire.error_feedback
        )
        # Nearest codes fire where 2|x| >= scale: against the clipping bound
        # alone a leaf whose elements share one magnitude (the bound 2.5x
        # it) would never be sent, whatever error feedback adds to it.
        tight = not stochastic
        scales, bounds = _common_scales(inputs, clip_sigma, wire, tight)
        codes = []
        for j, x in enumerate(inputs):
            if stochastic:
                stream = _random.stream(key, wire.leaves[j], wire.device)
                codes.append(
                    stochastic_codes(x, scales[j], bounds[j], stream, wire.splits[j])
                )
            else:
                codes.append(_nearest_codes(x, scales[j], bounds[j]))
        code_sums = _packing.packed_sum(codes, wire.axis, wire.num_devices, 1)
        sums = [
            c.astype(jnp.float32) * s for c, s in zip(code_sums, scales, strict=True)
        ]
        if stochastic:  # the rounding noise is not fed back (see `ternary`)
            sent = [clip(x, b) for x, b in zip(inputs, bounds, strict=True)]
        else:
            sent = [
                c.astype(jnp.float32) * s for c, s in zip(codes, scales, strict=True)
            ]
        sq_excess = None
        if wire.report_sq_excess and stochastic:
            sq_excess = _sq_excess(inputs, scales, bounds, wire)
        finite = [jnp.all(jnp.isfinite(s)) for s in scales]
        return CodecSum(sums, sent, finite, state, sq_excess)

    return Codec(
        f"ternary(clip_sigma={clip_sigma}, rounding={rounding!r}, min_size={min_size})",
        at_least(min_size),
        no_state,
        codec_sum,
        reports_sq_excess=True,
        # With error feedback, the default rounding is nearest.
        keeps_residual=biased(rounding == "stochastic", clip_sigma),
    )


def _common_scales(
    inputs: list[jax.Array], clip_sigma: float | None, wire: Wire, tight: bool
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The scale every device codes each input against (the pmax of the
    devices' scales, +inf where any input is not finite, in one
    all-reduce), and this device's clipping bounds; per layer of a scanned
    leaf, shaped to broadcast against it. A device's scale is its clipping
    bound, or with ``tight`` the smaller of it and its largest magnitude."""
    if not inputs:
        return [], []

    def common(tight: bool) -> tuple[jax.Array, list[jax.Array]]:
        bounds, local_scales = [], []
        for x, split in zip(inputs, wire.splits, strict=True):
            scale, bound, finite = scale_and_bound(
                x,
                clip_sigma,
                tight=tight,
                split=split,
                recheck_overflow=False,
                per_layer=x.ndim >= 3,  # a scanned stack of layers
            )
            bounds.append(bound)
            # A non-finite input is marked +inf, not NaN: max is guaranteed
            # to propagate inf to every device.
            local_scales.append(jnp.reshape(jnp.where(finite, scale, jnp.inf), -1))
        return jax.lax.pmax(jnp.concatenate(local_scales), wire.axis), bounds

    flat, bounds = common(tight)
    if not tight and clip_sigma is not None:
        # A clipping bound is +inf for an input holding an infinity and for
        # a finite one whose sum of squares overflowed: only then (some
        # scale +inf on some device, which every device sees after the
        # pmax, so none decides alone) are the largest magnitudes read, and
        # every device codes against its tight scale, unclipped where its
        # sum overflowed.
        flat, bounds = run_if(
            jnp.any(jnp.isinf(flat)), lambda _: common(tight=True), (flat, bounds)
        )
    sizes = [int(np.size(bound)) for bound in bounds]
    scales = jnp.split(flat, np.cumsum(sizes)[:-1])
    return [
        jnp.reshape(scale, jnp.shape(bound))
        for scale, bound in zip(scales, bounds, strict=True)
    ], bounds


def _nearest_codes(x: jax.Array, scale: jax.Array, bound: jax.Array) -> jax.Array:
    """The code in {-1, 0, 1} nearest to ``clip(x, bound) / scale``."""
    fires = 2 * jnp.abs(clip(x, bound)) >= scale
    sign = jnp.where(x > 0, jnp.int8(1), jnp.int8(-1))
    return jnp.where(fires & (scale > 0), sign, jnp.int8(0))


def _sq_excess(
    inputs: list[jax.Array],
    scales: list[jax.Array],
    bounds: list[jax.Array],
    wire: Wire,
) -> jax.Array:
    """``E|sums|^2 - |exact sums|^2``: what stochastic codes add to the
    squared norm of the sums, given the inputs.

    A code of an input ``x`` clipped to ``c`` (``|c| <= s``) is ``s
    sign(c)`` with probability ``|c| / s``, else 0: unbiased for ``c`` with
    variance ``s |c| - c^2``. The devices draw independently, so their
    variances add up. Clipping takes ``x - c`` away: ``|x|^2 - |c|^2`` is
    what that removes from the squared norm of each device's input (the
    cross terms between devices' clipping errors, small next to it, are
    left out). Per element the excess is ``s |c| - x^2``; each device sums
    its own in float32 and one psum of a scalar adds them (a leaf held in
    blocks first sums its blocks' over their axes). On a closed-form
    regression (`tests/test_noise_scale.py`) it makes the ``|G|^2``
    estimated from a ternary window unbiased.
    """
    local = jnp.zeros([], jnp.float32)
    for x, scale, bound, split in zip(inputs, scales, bounds, wire.splits, strict=True):
        clipped = clip(x, bound)
        local += _blocks.total(jnp.sum(scale * jnp.abs(clipped) - jnp.square(x)), split)
    return jax.lax.psum(local, wire.axis)
