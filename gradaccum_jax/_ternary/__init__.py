"""Ternary gradient compression, one module per job.

- `_quantize`: the quantizers (TernGrad, TWN) and their building blocks;
- `_random`: counter-based random bits, a hash of (seed, step, leaf,
  device, element);
- `_leaves`: which leaves are compressed, and the tree plumbing;
- `_error_feedback`: the residual state shared by the next two;
- `_ternarize`: `ternarize`, compression of each update;
- `_device_mean`: `ternary_average_across_devices`, codes on the wire (the
  ternary codec of `gradaccum_jax._codecs` with TernGrad's rounding);
- `_accumulator`: `ternary_accumulate`, an int8 window accumulator;
- `_window_reduction`: `ternary_window_reduction`, a per-device window
  summed with codes on the wire (the same codec, in
  `gradaccum_jax.compressed_window_reduction`'s map).
"""

from gradaccum_jax._ternary._accumulator import (
    TernaryAccumulatorState,
    ternary_accumulate,
)
from gradaccum_jax._ternary._device_mean import ternary_average_across_devices
from gradaccum_jax._ternary._error_feedback import TernaryState
from gradaccum_jax._ternary._leaves import DEFAULT_MIN_SIZE
from gradaccum_jax._ternary._quantize import ternary_dequantize, ternary_quantize
from gradaccum_jax._ternary._ternarize import ternarize
from gradaccum_jax._ternary._window_reduction import ternary_window_reduction

__all__ = [
    "DEFAULT_MIN_SIZE",
    "TernaryAccumulatorState",
    "TernaryState",
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_dequantize",
    "ternary_quantize",
    "ternary_window_reduction",
]
