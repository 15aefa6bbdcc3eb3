"""How many micro-batches the next window holds: fixed, scheduled or adaptive.

A size that is a function of the gradient step is the same on every device.
An adaptive size follows the noise scale, which each device estimates from
its own gradients under ``jax.pmap`` / ``jax.shard_map``: unless the
estimate is shared over the mapped axis (``adaptive_every_k(axis_name=)``),
the devices may choose different sizes, and an inner optimizer that
communicates at the emission (`average_across_devices`) would then wait
forever for the devices still filling their windows. `AdaptiveSize`
refuses that at trace time.
"""

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
    axis_name = None

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

    def check_inner_update(self, inner_update: Callable[..., Any], *args: Any) -> None:
        """Nothing to check: every device computes the same size."""
        del inner_update, args


class AdaptiveSize:
    """A window size kept in the state, chosen from the noise scale at each close."""

    needs_noise_scale = True

    def __init__(self, adaptive: AdaptiveWindow):
        self._adaptive = adaptive
        self.axis_name = adaptive.axis_name

    def initial(self) -> jax.Array:
        return self._adaptive.initial_size()

    def current(self, window_size: jax.Array, gradient_step: jax.Array) -> jax.Array:
        del gradient_step
        return window_size

    def next(self, window_size: jax.Array, noise: Any) -> jax.Array:
        return self._adaptive.next_size(window_size, _noise_scale.estimate(noise))

    def check_inner_update(self, inner_update: Callable[..., Any], *args: Any) -> None:
        """Raises if ``inner_update(*args)`` communicates over a mapped axis
        while the noise scale is this device's own (no ``axis_name``).

        Read from the update's jaxpr at trace time: its collectives, nested
        ones included (a ``jit``, a ``cond``, a loop).
        """
        if self.axis_name is not None:
            return
        axes = sorted(_collective_axes(jax.make_jaxpr(inner_update)(*args).jaxpr))
        if axes:
            shown = axes[0] if len(axes) == 1 else tuple(axes)
            raise ValueError(
                "adaptive_every_k: the inner optimizer communicates over the "
                f"mapped axis {shown!r} at each emission (e.g. "
                "average_across_devices), but without `axis_name` each device "
                "estimates the noise scale from its own gradients and picks "
                "its own next window size: the devices that close a window "
                "first would wait in that collective forever. Pass "
                f"adaptive_every_k(..., axis_name={shown!r}) to share one "
                "estimate, and one window size, over the devices."
            )


# Primitives through which devices wait for each other.
_COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "ppermute",
        "psum_scatter",
        "reduce_scatter",
    }
)


def _collective_axes(jaxpr: Any) -> set[str]:
    """The named axes the collectives of ``jaxpr`` (and its sub-jaxprs) use."""
    axes: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _COLLECTIVES:
            names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            names = names if isinstance(names, tuple | list) else (names,)
            axes.update(name for name in names if isinstance(name, str))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    axes |= _collective_axes(inner)
    return axes


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
