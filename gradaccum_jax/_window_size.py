"""A window size chosen from the gradient noise scale (`adaptive_every_k`).

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
arXiv:1812.06162): ``B_simple``, the simple noise scale the accumulator
estimates (`gradaccum_jax._noise_scale`), is about the critical batch size.
An `AdaptiveWindow` sets each next window to about that many examples.
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
    """

    def __init__(self, micro_batch_size: float, k_min: int, k_max: int):
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

    def initial_size(self) -> jax.Array:
        """The first window's size: ``k_min`` (no estimate yet)."""
        return jnp.asarray(self.k_min, jnp.int32)

    def next_size(self, size: jax.Array, noise: NoiseScaleEstimate) -> jax.Array:
        """``round(B_simple / micro_batch_size)`` in [k_min, k_max]; ``size`` if NaN."""
        wanted = noise.noise_scale / self.micro_batch_size
        bounded = jnp.clip(jnp.round(wanted), self.k_min, self.k_max)
        return jnp.where(jnp.isnan(wanted), size, bounded.astype(jnp.int32))

    def __repr__(self) -> str:
        return (
            f"adaptive_every_k(micro_batch_size={self.micro_batch_size}, "
            f"k_min={self.k_min}, k_max={self.k_max})"
        )


def adaptive_every_k(micro_batch_size: float, k_min: int, k_max: int) -> AdaptiveWindow:
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

    Args:
      micro_batch_size: the weight of one micro-batch, a positive number.
      k_min: the smallest (and first) window, an integer >= 1.
      k_max: the largest window, an integer >= ``k_min``.

    Returns:
      An `AdaptiveWindow`.
    """
    return AdaptiveWindow(micro_batch_size, k_min, k_max)
