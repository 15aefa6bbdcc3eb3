"""Gradient accumulation over windows of micro-batches.

`MultiSteps` is a drop-in replacement for `optax.MultiSteps`; `accumulate`
and `MultiSteps.gradient_transformation` give the same machinery as an
`AccumulationTransformation` for `optax.chain`. The engine (`_engine`)
reads as the algorithm and calls its parts through their protocols: the
window's storage and size (`gradaccum_jax._window`), the statistics
(`gradaccum_jax._statistic`). docs/architecture.md lists the modules.
"""

from gradaccum_jax._accumulation._accumulate import accumulate
from gradaccum_jax._accumulation._multisteps import MultiSteps
from gradaccum_jax._accumulation._skip import (
    ShouldSkipUpdateFunction,
    skip_large_updates,
    skip_not_finite,
)
from gradaccum_jax._accumulation._state import AccumulationStats, MultiStepsState
from gradaccum_jax._accumulation._transformation import AccumulationTransformation

__all__ = [
    "AccumulationStats",
    "AccumulationTransformation",
    "MultiSteps",
    "MultiStepsState",
    "ShouldSkipUpdateFunction",
    "accumulate",
    "skip_large_updates",
    "skip_not_finite",
]
