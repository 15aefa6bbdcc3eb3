"""`codecs.quantized`: block-scaled stochastic rounding to 8 or 4 bits.

Each block of `BLOCK` consecutive elements of a leaf has one power-of-two
scale, the same on every device (a pmax of the devices' int8 exponents, the
E8M0 scales of the OCP microscaling formats). Each device rounds its input
over the scale stochastically (unbiased) onto the format's grid and the
integer codes of every device are summed exactly by one packed integer
all-reduce (`_packing`).

- 8 bits: the integers in [-127, 127].
- 4 bits: E2M1, the 4-bit float of the microscaling formats and of
  Streaming DiLoCo: {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives, sent
  doubled (integers in [-12, 12]). Against int4 ([-7, 7]) on blocks of
  32 at the same wire bytes, its rounding noise is smaller, on Gaussian
  and on heavy-tailed blocks (``python benchmarks/bench_codecs.py
  formats``; the low-communication guide has the figures): a block's
  values are mostly small next to its largest, where E2M1's grid is finer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks
from gradaccum_jax._codecs import _packing
from gradaccum_jax._codecs._protocol import (
    Codec,
    CodecSum,
    Wire,
    as_rows,
    at_least,
    from_rows,
    no_state,
)
from gradaccum_jax._compression import _random
from gradaccum_jax._compression._leaves import DEFAULT_MIN_SIZE

# Elements per scale: the microscaling formats' block.
BLOCK = 32

# Per format: the largest code (in grid units) and how many grid units make 1.
_FORMATS = {8: (127, 1), 4: (12, 2)}

# An int8 exponent that marks a block some device could not code.
_NOT_FINITE = 127


def quantized(*, bits: int = 8, min_size: int = DEFAULT_MIN_SIZE) -> Codec:
    """Block-scaled stochastic rounding to ``bits`` (8: int8, 4: E2M1) per element.

    Every block of 32 consecutive elements has one power-of-two scale,
    shared by the devices; each device rounds stochastically (unbiased)
    and the codes are summed by one packed integer all-reduce: with 8
    devices 2 int8 codes or 4 E2M1 codes per uint32 word (the sums need
    headroom: 8 devices' codes add up), plus one byte per block for the
    scales. With error feedback the whole rounding error is kept (it is
    small next to the input: the residual stays bounded). Why E2M1 for 4
    bits: the module's docstring, from a measurement.

    Example:

    >>> from gradaccum_jax import codecs
    >>> codecs.quantized(bits=4)
    quantized(bits=4, min_size=256)

    Args:
      bits: 8 or 4.
      min_size: leaves with fewer elements are summed exactly in float32.

    Returns:
      A `gradaccum_jax.extend.Codec`.
    """
    bits = _checks.integer_in("bits", bits, tuple(_FORMATS))
    min_size = _checks.nonnegative_int("min_size", min_size)
    top, units = _FORMATS[bits]

    def codec_sum(inputs: list[jax.Array], state: Any, key: jax.Array, wire: Wire):
        blocks = [as_rows(x, BLOCK) for x in inputs]
        local = [_exponent(b, top / units) for b in blocks]
        exponents = _pmax(local, wire.axis)
        codes, sums, sent, finite = [], [], [], []
        for j, (x, b, e) in enumerate(zip(inputs, blocks, exponents, strict=True)):
            power = _power(e)
            scale = power / units  # of one code unit
            stream = _random.stream(key, wire.leaves[j], wire.device)
            uniform = _uniform(as_rows(_random.bits(stream, x, wire.splits[j]), BLOCK))
            codes.append(_round(b / power, uniform, top, units))
            sent.append(from_rows(codes[-1].astype(jnp.float32) * scale, x))
            finite.append(jnp.all(e != _NOT_FINITE))
        code_sums = _packing.packed_sum(codes, wire.axis, wire.num_devices, top)
        for c, e, x in zip(code_sums, exponents, inputs, strict=True):
            scale = _power(e) / units
            sums.append(from_rows(c.astype(jnp.float32) * scale, x))
        return CodecSum(sums, sent, finite, state)

    return Codec(
        f"quantized(bits={bits}, min_size={min_size})",
        at_least(min_size),
        no_state,
        codec_sum,
    )


def _power(exponents: jax.Array) -> jax.Array:
    """``2**e`` per block, shaped to scale the block's row."""
    return jnp.ldexp(jnp.float32(1.0), exponents.astype(jnp.int32))[:, None]


def _exponent(blocks: jax.Array, top: float) -> jax.Array:
    """Int8 per block: the least e with ``max|block| <= top * 2**e``
    (`_NOT_FINITE` where the block is not finite)."""
    largest = jnp.max(jnp.abs(blocks), axis=1)
    mantissa, exponent = jnp.frexp(largest / top)  # largest/top = m 2**e, m in [.5, 1)
    # 2**e >= largest / top, and the least such power unless m is exactly 1/2.
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = jnp.where(largest > 0, exponent, -127)
    exponent = jnp.clip(exponent, -127, _NOT_FINITE - 1)
    return jnp.where(jnp.isfinite(largest), exponent, _NOT_FINITE).astype(jnp.int8)


def _pmax(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    """pmax of several arrays in one (variadic) all-reduce."""
    return list(jax.lax.pmax(values, axis)) if values else []


def _uniform(bits: jax.Array) -> jax.Array:
    """Uniform floats in [0, 1) from the top 24 of 32 random bits."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _round(scaled: jax.Array, uniform: jax.Array, top: int, units: int) -> jax.Array:
    """``scaled`` (in [-top/units, top/units]) rounded stochastically onto the
    grid, as int8 grid units: unbiased, ``E[code] = units * scaled``.

    The 8-bit grid has unit steps; E2M1's, in half units, steps of 1 up to
    4, of 2 up to 8 and of 4 up to 12 (0.5, 1 and 2 in real units).
    """
    magnitude = jnp.minimum(jnp.abs(scaled) * units, top)
    if units == 1:
        step = inverse = jnp.ones_like(magnitude)
    else:
        step = jnp.where(magnitude < 4, 1.0, jnp.where(magnitude < 8, 2.0, 4.0))
        inverse = jnp.where(magnitude < 4, 1.0, jnp.where(magnitude < 8, 0.5, 0.25))
    # Times the inverse step (a power of two: the same floats as a
    # division), which XLA recomputes in each pass that reads the codes;
    # a division it computed once and kept, a float32 buffer the leaf's size.
    low = jnp.floor(magnitude * inverse) * step
    up = uniform * step < magnitude - low
    code = jnp.minimum(low + jnp.where(up, step, 0.0), top)
    return (jnp.sign(scaled) * code).astype(jnp.int8)
