"""How many micro-batches the next window holds: fixed, scheduled or adaptive."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks, _noise_scale
from gradaccum_jax._window_size import AdaptiveWindow

Schedule = int | Callable[[jax.Array], jax.Array] | AdaptiveWindow


class ScheduledSize:
    """A window size that is a function of the gradient step (an int: constant).

    A schedule returning k <= 0 is a bug that a traced k cannot report.
    optax's MultiSteps then never emits again: training silently stops while
    the window's sum grows without bound. Here such a k counts as 1 (every
    micro-batch is its own window), the nearest window that has a meaning,
    and `stats` reports that 1.
    """

    needs_noise_scale = False

    def __init__(self, schedule: Callable[[Any], Any]):
        self._schedule = schedule

    def initial(self) -> Any:
        """The state's ``window_size`` field: nothing, it is a function."""
        return ()

    def current(self, window_size: Any, gradient_step: jax.Array) -> jax.Array:
        """The current window's size, >= 1."""
        del window_size
        return jnp.maximum(self._schedule(gradient_step), 1)

    def next(self, window_size: Any, noise: Any) -> Any:
        """The ``window_size`` field after a window closes."""
        del noise
        return window_size


class AdaptiveSize:
    """A window size kept in the state, chosen from the noise scale at each close."""

    needs_noise_scale = True

    def __init__(self, adaptive: AdaptiveWindow):
        self._adaptive = adaptive

    def initial(self) -> jax.Array:
        return self._adaptive.initial_size()

    def current(self, window_size: jax.Array, gradient_step: jax.Array) -> jax.Array:
        del gradient_step
        return window_size

    def next(self, window_size: jax.Array, noise: Any) -> jax.Array:
        return self._adaptive.next_size(window_size, _noise_scale.estimate(noise))


def window_size_policy(
    every_k_schedule: Schedule, argument: str = "every_k_schedule"
) -> ScheduledSize | AdaptiveSize:
    """The policy for ``every_k_schedule``, validated (a ValueError naming it)."""
    if isinstance(every_k_schedule, AdaptiveWindow):
        return AdaptiveSize(every_k_schedule)
    if isinstance(every_k_schedule, int | np.integer) and not isinstance(
        every_k_schedule, bool
    ):
        every_k = _checks.window_size(argument, every_k_schedule)
        return ScheduledSize(lambda step: every_k)
    if callable(every_k_schedule):
        return ScheduledSize(every_k_schedule)
    raise ValueError(
        f"`{argument}` must be an integer >= 1, a function of the "
        "gradient step returning one or an adaptive_every_k, got "
        f"{every_k_schedule!r}."
    )
