"""A window size chosen from the gradient noise scale (`adaptive_every_k`).

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
arXiv:1812.06162): ``B_simple``, the simple noise scale the accumulator
estimates (`gradaccum_jax._noise_scale`), is about the critical batch size.
An `AdaptiveWindow` sets each next window to about that many examples.

Under ``jax.pmap`` / ``jax.shard_map`` with an `average_across_devices` (or
any collective) in the inner optimizer, every device must choose the same
size: a device that closes its window first would wait in the inner
all-reduce for the others forever. ``axis_name`` makes the estimate one
for all devices (each window's estimate is averaged over that axis before
it enters the moving averages), and the engine refuses, at trace time, an
adaptive window without it whose inner optimizer communicates over an axis.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks
from gradaccum_jax._noise_scale import NoiseScaleEstimate


class AdaptiveWindow:
    """A window size chosen from the estimated critical batch size.

    Built by `adaptive_every_k`; pass it as ``every_k_schedule`` (or
    ``every_k``). The engine keeps the current window size in its state and,
    at each emission, asks `next_size` for the next one, so the size changes
    only at window boundaries, is a pure function of the state (a restored
    checkpoint goes on identically) and costs a few scalar operations.
    ``axis_name`` (or None) is the mapped axis whose devices share one
    estimate, hence one window size.
    """

    def __init__(
        self,
        micro_batch_size: float,
        k_min: int,
        k_max: int,
        axis_name: str | tuple[str, ...] | None = None,
    ):
        if isinstance(micro_batch_size, bool) or not isinstance(
            micro_batch_size, numbers.Real
        ):
            raise ValueError(
                "`micro_batch_size` must be a positive finite number (the "
                f"weight of one micro-batch), got {micro_batch_size!r}."
            )
        self.micro_batch_size: float = _checks.positive_finite(
            "micro_batch_size", micro_batch_size
        )
        self.k_min: int = _checks.window_size("k_min", k_min)
        self.k_max: int = _checks.window_size("k_max", k_max)
        if self.k_max < self.k_min:
            raise ValueError(
                f"`k_max` must be an integer >= k_min ({self.k_min}), got {k_max}."
            )
        self.axis_name: str | tuple[str, ...] | None = (
            None if axis_name is None else _checks.axis_name("axis_name", axis_name)
        )

    def initial_size(self) -> jax.Array:
        """The first window's size: ``k_min`` (no estimate yet)."""
        return jnp.asarray(self.k_min, jnp.int32)

    def next_size(self, size: jax.Array, noise: NoiseScaleEstimate) -> jax.Array:
        """``round(B_simple / micro_batch_size)`` in [k_min, k_max]; ``size`` if NaN."""
        wanted = noise.noise_scale / self.micro_batch_size
        bounded = jnp.clip(jnp.round(wanted), self.k_min, self.k_max)
        return jnp.where(jnp.isnan(wanted), size, bounded.astype(jnp.int32))

    def __repr__(self) -> str:
        axis = "" if self.axis_name is None else f", axis_name={self.axis_name!r}"
        return (
            f"adaptive_every_k(micro_batch_size={self.micro_batch_size}, "
            f"k_min={self.k_min}, k_max={self.k_max}{axis})"
        )


def adaptive_every_k(
    micro_batch_size: float,
    k_min: int,
    k_max: int,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> AdaptiveWindow:
    """A window size that follows the critical batch size (McCandlish et al. 2018).

    At each emission the next window holds
    ``clip(round(B_simple / micro_batch_size), k_min, k_max)`` micro-batches,
    ``B_simple`` being the accumulator's smoothed noise scale (so the
    window's batch is about the critical batch size). Until the first
    estimate (and while it is undefined) the window keeps its size, starting
    at ``k_min``; ``k_min >= 2`` is needed for any estimate at all (a window
    of one micro-batch measures nothing). Pass it as ``every_k_schedule``
    to `MultiSteps` (``every_k`` to `accumulate`, `ternary_accumulate`):
    it turns ``track_noise_scale`` on.

    Units: ``B_simple`` is in units of the micro-batch weights. With
    ``update(..., weight=n_examples)``, ``micro_batch_size`` is the
    (typical) number of examples in a micro-batch; without weights
    ``B_simple`` counts micro-batches, and ``micro_batch_size`` must be 1.

    Under data parallelism ``micro_batch_size`` is global: the weight of one
    ``update`` call summed over all devices (8 devices of 32 examples each:
    256), since the window's batch is that of all devices together.
    Without weights, where each call weighs 1 whatever the number of
    devices, it is 1 again.

    Under ``jax.pmap`` / ``jax.shard_map``, where each device accumulates
    its own gradients and an `average_across_devices` (or
    `ternary_average_across_devices`) in the inner optimizer averages the
    windows, pass that axis as ``axis_name``: each window's estimate is then
    averaged over the devices before it enters the moving averages (two
    scalars in one all-reduce per window), so every device picks the same
    next size. Without it each device would estimate from its own gradients
    and pick its own size, and the devices that close first would wait in
    the inner all-reduce forever; the accumulator refuses that at trace time
    (a ValueError naming ``axis_name``). Not needed, and refused, with
    ``unreduced_axes`` under ``jax.jit``: there the window's terms are
    already summed over the devices before the estimate.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> opt = ga.MultiSteps(optax.sgd(0.1), ga.adaptive_every_k(1, k_min=2, k_max=16))
    >>> state = opt.init({"w": jnp.zeros(3)})
    >>> opt.stats(state).window_size  # k_min until the first estimate
    Array(2, dtype=int32)

    Args:
      micro_batch_size: the weight of one micro-batch, a positive number.
      k_min: the smallest (and first) window, an integer >= 1.
      k_max: the largest window, an integer >= ``k_min``.
      axis_name: the pmap / shard_map axis (or tuple of axes) over which
        the devices share one estimate and one window size, or None.

    Returns:
      An `AdaptiveWindow`.
    """
    return AdaptiveWindow(micro_batch_size, k_min, k_max, axis_name)
