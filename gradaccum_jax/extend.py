"""What an extension author writes against: the engine's protocols and the
parts' state types.

A new part of the accumulation engine is an object, not a branch in it: a
`WindowAccumulator` stores a window's sum (`float_accumulator` is the
default), a `WindowReduction` sums a window's per-device terms at its
emission, a `WindowStatistic` observes each micro-batch and each closed
window at a `WindowPosition`; the `TermsLayout` the engine hands them says
where per-device terms live. `RunningMean`, `NoiseScaleState` and
`TernaryAccumulatorState` are the states the built-in parts keep in a
`gradaccum_jax.MultiStepsState`. A `Codec` is what a compressed
cross-device sum sends (`gradaccum_jax.codecs` builds them): it sums each
device's input as a `CodecSum`, told where it runs by a `Wire` (a sum
made from small parts may be made after the residual, from `made_after`
its parts); its users keep a `CodecState`. docs/architecture.md, "Write your own
part", shows each protocol at work.
"""

from gradaccum_jax._codecs._protocol import (
    Codec,
    CodecState,
    CodecSum,
    Wire,
    made_after,
)
from gradaccum_jax._noise_scale import NoiseScaleState
from gradaccum_jax._partials import TermsLayout
from gradaccum_jax._reduction import WindowReduction
from gradaccum_jax._statistic import WindowPosition, WindowStatistic
from gradaccum_jax._ternary import TernaryAccumulatorState
from gradaccum_jax._window._accumulator import (
    RunningMean,
    WindowAccumulator,
    float_accumulator,
)

__all__ = [
    "Codec",
    "CodecState",
    "CodecSum",
    "NoiseScaleState",
    "RunningMean",
    "TermsLayout",
    "TernaryAccumulatorState",
    "WindowAccumulator",
    "WindowPosition",
    "WindowReduction",
    "WindowStatistic",
    "Wire",
    "float_accumulator",
    "made_after",
]
