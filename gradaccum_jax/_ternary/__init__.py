"""Ternary compression's public names, above the codecs: `ternarize`,
`ternary_accumulate`, and the ternary codec's front doors
`ternary_average_across_devices` and `ternary_window_reduction`. The
quantizers themselves are kernels of `gradaccum_jax._codecs`.
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
