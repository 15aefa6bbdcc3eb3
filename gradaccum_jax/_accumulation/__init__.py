"""Gradient accumulation over windows of micro-batches.

`MultiSteps` is a drop-in replacement for `optax.MultiSteps`; `accumulate`
and `MultiSteps.gradient_transformation` give the same machinery as an
`AccumulationTransformation` for `optax.chain`. The package is split by job:

* `_state`: the state and the `stats` it reports;
* `_configuration`: the engine's `Configuration`, built once from the
  arguments `MultiSteps`, `accumulate` and `ternary_accumulate` share;
* `_multisteps`: `MultiSteps`, which holds one and delegates;
* `_engine`: the micro-step, the emission and the window as a whole
  (reset, reduce, lift), composed of parts;
* `_inner_step`: the inner optimizer's step in the window's own buffers;
* `_skip`: which micro-batches the window takes;
* `_transformation`, `_accumulate`: the optax-transformation forms.

The window's parts (its storage and its size policies) are in
`gradaccum_jax._window`, the statistics' protocol in
`gradaccum_jax._statistic`.
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
