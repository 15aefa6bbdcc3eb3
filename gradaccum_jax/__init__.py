"""gradaccum_jax: gradient accumulation, averaging, clipping and ternary
compression as pure optax transformations for JAX.

Every public name is an ``optax.GradientTransformation`` (or a helper around
one) over pytrees with an immutable NamedTuple state: jit-able, scan-able,
pmap-able and checkpointable, and chainable with any optax optimizer.

The top level holds what a user trains with. Three submodules hold the
rest: `gradaccum_jax.codecs`, the compression codecs;
`gradaccum_jax.extend`, the accumulation engine's extension protocols and
the parts' state types; `gradaccum_jax.measure`, what reads compiled
programs and states.
"""

# --- accumulation ---
from gradaccum_jax._accumulation import (
    AccumulationStats,
    AccumulationTransformation,
    MultiSteps,
    MultiStepsState,
    ShouldSkipUpdateFunction,
    accumulate,
    skip_large_updates,
    skip_not_finite,
)

# --- gradient noise scale ---
from gradaccum_jax._noise_scale import NoiseScaleEstimate
from gradaccum_jax._window._size import AdaptiveWindow, adaptive_every_k

# --- clipping ---
from gradaccum_jax._clipping import (
    ClipByGlobalNormState,
    clip,
    clip_by_global_norm,
    global_norm,
)

# --- averaging across devices ---
from gradaccum_jax._averaging import average_across_devices

# --- ternary compression ---
from gradaccum_jax._ternary import (
    TernaryState,
    ternarize,
    ternary_accumulate,
    ternary_average_across_devices,
    ternary_dequantize,
    ternary_quantize,
    ternary_window_reduction,
)

# --- compression codecs on the wire of a device mean or a window's sum ---
from gradaccum_jax._codecs._average import compressed_average_across_devices
from gradaccum_jax._codecs._window import compressed_window_reduction

# --- submodules: the codecs; the engine's protocols and the parts' state
# types; what reads compiled programs and states ---
from gradaccum_jax import codecs, extend, measure

# --- data parallelism under jax.jit: per-device gradients ---
from gradaccum_jax._local import local_value_and_grad

# --- DiLoCo: low-communication data parallelism ---
from gradaccum_jax._diloco import (
    DiLoCoState,
    anchor_params,
    diloco,
    stack_workers,
    worker_value_and_grad,
)

# --- micro-batching inside one step ---
from gradaccum_jax._microbatching import microbatched_value_and_grad

# Declared shardings: the state's, from the params'.
from gradaccum_jax._shardings import state_shardings

__version__ = "0.1.0"

__all__ = [
    "accumulate",
    "AccumulationStats",
    "AdaptiveWindow",
    "adaptive_every_k",
    "AccumulationTransformation",
    "anchor_params",
    "average_across_devices",
    "clip",
    "clip_by_global_norm",
    "compressed_average_across_devices",
    "compressed_window_reduction",
    "diloco",
    "DiLoCoState",
    "ClipByGlobalNormState",
    "global_norm",
    "local_value_and_grad",
    "microbatched_value_and_grad",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScaleEstimate",
    "ShouldSkipUpdateFunction",
    "skip_large_updates",
    "skip_not_finite",
    "stack_workers",
    "state_shardings",
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_dequantize",
    "ternary_quantize",
    "ternary_window_reduction",
    "TernaryState",
    "worker_value_and_grad",
]
