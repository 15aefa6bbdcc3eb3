"""How many micro-batches each window holds: the window-size policies.

A policy (`WindowSize`) is the part of the engine that sizes windows: fixed
or a function of the gradient step (`ScheduledSize`), or chosen from the
gradient noise scale at each window's close (`adaptive_every_k`,
`AdaptiveSize`). A policy that reads a window statistic declares it
(`WindowSize.statistics`): the engine keeps it with the others under its
name and hands the policy their states when a window closes.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
arXiv:1812.06162): ``B_simple``, the simple noise scale the accumulator
estimates (`gradaccum_jax._noise_scale`), is about the critical batch size.
An `AdaptiveWindow` sets each next window to about that many examples.

A size that is a function of the gradient step is the same on every device.
An adaptive size follows the noise scale, which each device estimates from
its own gradients under ``jax.pmap`` / ``jax.shard_map``: with an
`average_across_devices` (or any collective) in the inner optimizer, every
device must choose the same size, or a device that closes its window first
would wait in the inner all-reduce for the others forever. ``axis_name``
makes the estimate one for all devices (each window's estimate is averaged
over that axis before it enters the moving averages), and `AdaptiveSize`
refuses, at trace time, an adaptive window without it whose inner
optimizer communicates over an axis.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks
from gradaccum_jax._noise_scale import STATISTIC, NoiseScaleEstimate
from gradaccum_jax._statistic import WindowStatistic


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


Schedule = int | Callable[[jax.Array], jax.Array] | AdaptiveWindow


class WindowSize:
    """A window-size policy: how many micro-batches each window holds.

    Its state is the ``window_size`` field of the accumulator's state.

    Attributes:
      statistics: the window statistics the policy reads, by name: the
        engine keeps them with the others and hands `next` their states.
    """

    statistics: Mapping[str, WindowStatistic] = {}

    def initial(self) -> Any:
        """The state's ``window_size`` field before the first window."""
        raise NotImplementedError

    def current(self, window_size: Any, gradient_step: jax.Array) -> jax.Array:
        """The current window's size (int32, >= 1)."""
        raise NotImplementedError

    def next(self, window_size: Any, statistics: Mapping[str, Any]) -> Any:
        """The ``window_size`` field after a window closes, given the
        statistics' states (by name) that the closing window left."""
        raise NotImplementedError

    def check_inner_update(self, inner_update: Callable[..., Any], *args: Any) -> None:
        """Raises at trace time if ``inner_update(*args)`` cannot run under
        this policy; nothing by default."""
        del inner_update, args


class ScheduledSize(WindowSize):
    """A window size that is a function of the gradient step (an int: constant).

    A schedule returning k <= 0 is a bug that a traced k cannot report.
    optax's MultiSteps then never emits again: training silently stops while
    the window's sum grows without bound. Here such a k counts as 1 (every
    micro-batch is its own window), the nearest window that has a meaning,
    and `stats` reports that 1. Every device computes the same size.
    """

    def __init__(self, schedule: Callable[[Any], Any]):
        self._schedule = schedule

    def initial(self) -> Any:
        """Nothing: the size is a function of the gradient step."""
        return ()

    def current(self, window_size: Any, gradient_step: jax.Array) -> jax.Array:
        del window_size
        return jnp.maximum(self._schedule(gradient_step), 1)

    def next(self, window_size: Any, statistics: Mapping[str, Any]) -> Any:
        del statistics
        return window_size


class AdaptiveSize(WindowSize):
    """A window size kept in the state, chosen from the noise scale at each close.

    Args:
      adaptive: the user's `AdaptiveWindow`.
      noise_scale: the gradient noise scale's `WindowStatistic` for a mapped
        axis (or None), configured as the accumulator's noise-scale options
        say; the policy reads it under the name ``track_noise_scale`` gives it.
      unreduced_axes: the accumulator's, checked against ``axis_name``.
    """

    def __init__(
        self,
        adaptive: AdaptiveWindow,
        noise_scale: Callable[[Any], WindowStatistic],
        unreduced_axes: frozenset[str],
    ):
        if unreduced_axes and adaptive.axis_name is not None:
            raise ValueError(
                "`axis_name` of adaptive_every_k cannot be combined with "
                "`unreduced_axes`: the window's per-device terms are summed over "
                "the mesh before the noise scale is estimated, so the estimate "
                "is already one for all devices. Use axis_name=None (it is for "
                "pmap / shard_map with an average_across_devices inside)."
            )
        self._adaptive = adaptive
        self._noise_scale = noise_scale(adaptive.axis_name)
        self.statistics = {STATISTIC: self._noise_scale}

    def initial(self) -> jax.Array:
        return self._adaptive.initial_size()

    def current(self, window_size: jax.Array, gradient_step: jax.Array) -> jax.Array:
        del gradient_step
        return window_size

    def next(self, window_size: jax.Array, statistics: Mapping[str, Any]) -> jax.Array:
        report = self._noise_scale.report
        assert report is not None  # the noise scale reports its estimate
        estimate = NoiseScaleEstimate(**report(statistics[STATISTIC]))
        return self._adaptive.next_size(window_size, estimate)

    def check_inner_update(self, inner_update: Callable[..., Any], *args: Any) -> None:
        """Raises if ``inner_update(*args)`` communicates over a mapped axis
        while the noise scale is this device's own (no ``axis_name``).

        Read from the update's jaxpr at trace time: its collectives, nested
        ones included (a ``jit``, a ``cond``, a loop).
        """
        axis_name = self._adaptive.axis_name
        if axis_name is not None:
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
    every_k_schedule: Schedule,
    noise_scale: Callable[[Any], WindowStatistic],
    unreduced_axes: frozenset[str],
    argument: str = "every_k_schedule",
) -> WindowSize:
    """The policy for ``every_k_schedule``, validated (a ValueError naming
    ``argument``); ``noise_scale(axis_name)`` builds the noise scale an
    adaptive window reads."""
    if isinstance(every_k_schedule, AdaptiveWindow):
        return AdaptiveSize(every_k_schedule, noise_scale, unreduced_axes)
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
