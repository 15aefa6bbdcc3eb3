"""Ternary compression's public names, above the codecs.

- `_ternarize`: `ternarize`, each update replaced by its ternary
  reconstruction, with error feedback (`TernaryState`);
- `_accumulator`: `ternary_accumulate`, an int8 window accumulator;
- `_reductions`: `ternary_average_across_devices` and
  `ternary_window_reduction`, front doors over
  `gradaccum_jax.compressed_average_across_devices` and
  `gradaccum_jax.compressed_window_reduction` with the ternary codec and
  TernGrad's rounding.

The quantizers themselves (`ternary_quantize`, `ternary_dequantize`, the
scales, the roundings) are kernels of `gradaccum_jax._codecs`.
"""

from gradaccum_jax._codecs._ternary_kernels import ternary_dequantize, ternary_quantize
from gradaccum_jax._ternary._accumulator import (
    TernaryAccumulatorState,
    ternary_accumulate,
)
from gradaccum_jax._ternary._reductions import (
    ternary_average_across_devices,
    ternary_window_reduction,
)
from gradaccum_jax._ternary._ternarize import TernaryState, ternarize

__all__ = [
    "TernaryAccumulatorState",
    "TernaryState",
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_dequantize",
    "ternary_quantize",
    "ternary_window_reduction",
]
