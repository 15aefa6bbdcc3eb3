"""gradaccum_jax: gradient accumulation, averaging, clipping and ternary
compression as pure optax transformations for JAX.

Every public name is an ``optax.GradientTransformation`` (or a helper around
one) over pytrees with an immutable NamedTuple state: jit-able, scan-able,
pmap-able and checkpointable, and chainable with any optax optimizer.
"""

# --- accumulation (DESIGN.md section 1) ---
from gradaccum_jax._accumulation import (
    AccumulationStats,
    MultiSteps,
    MultiStepsState,
    ShouldSkipUpdateFunction,
    WindowAccumulator,
    accumulate,
    float_accumulator,
    skip_large_updates,
    skip_not_finite,
)

# --- clipping (DESIGN.md section 2) ---
from gradaccum_jax._clipping import (
    ClipByGlobalNormState,
    clip,
    clip_by_global_norm,
    global_norm,
)

# --- averaging across devices (DESIGN.md section 3) ---
from gradaccum_jax._averaging import average_across_devices

# --- ternary compression (DESIGN.md section 4) ---
from gradaccum_jax._ternary import (
    TernaryAccumulatorState,
    TernaryState,
    all_reduce_nbytes,
    state_nbytes,
    ternarize,
    ternary_accumulate,
    ternary_average_across_devices,
    ternary_dequantize,
    ternary_quantize,
)

# --- micro-batching inside one step (DESIGN.md section 5) ---
from gradaccum_jax._microbatching import microbatched_value_and_grad

__version__ = "0.1.0"

__all__ = [
    "accumulate",
    "AccumulationStats",
    "all_reduce_nbytes",
    "average_across_devices",
    "clip",
    "clip_by_global_norm",
    "ClipByGlobalNormState",
    "float_accumulator",
    "global_norm",
    "microbatched_value_and_grad",
    "MultiSteps",
    "MultiStepsState",
    "ShouldSkipUpdateFunction",
    "skip_large_updates",
    "skip_not_finite",
    "state_nbytes",
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_dequantize",
    "ternary_quantize",
    "TernaryAccumulatorState",
    "TernaryState",
    "WindowAccumulator",
]
