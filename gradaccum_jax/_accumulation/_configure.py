"""Building the engine's parts from `MultiSteps`' arguments, validated."""

from __future__ import annotations

from typing import Any

import optax

from gradaccum_jax import _checks, _noise_scale, _reduction
from gradaccum_jax._accumulation import _skip
from gradaccum_jax._accumulation._parts import Parts
from gradaccum_jax._accumulation._size_policy import window_size_policy
from gradaccum_jax._accumulation._store import DecodedWindow, SharedWindow
from gradaccum_jax._statistic import WindowStatistic
from gradaccum_jax._window import (
    WindowAccumulator,
    float_accumulator,
    per_device_accumulator,
)


def engine_parts(
    opt,
    every_k_schedule,
    *,
    use_grad_mean,
    should_skip_update_fn,
    skip_nonfinite,
    accumulator_dtype,
    count_skipped,
    window_accumulator,
    unreduced_axes,
    window_reduction,
    track_noise_scale,
    noise_scale_decay,
    noise_scale_estimator,
    statistics,
) -> Parts:
    """The engine's parts for `MultiSteps`' arguments, validated."""
    window_size = window_size_policy(every_k_schedule)
    should_skip_update_fn = _skip.skip_function(should_skip_update_fn, skip_nonfinite)
    unreduced_axes = _checks.axis_names("unreduced_axes", unreduced_axes)
    track_noise_scale = window_size.needs_noise_scale or _checks.boolean(
        "track_noise_scale", track_noise_scale
    )
    noise_scale_decay = _checks.decay_rate("noise_scale_decay", noise_scale_decay)
    estimator = _checks.one_of(
        "noise_scale_estimator", noise_scale_estimator, _noise_scale.ESTIMATORS
    )
    if unreduced_axes and should_skip_update_fn is not None:
        raise ValueError(
            "`unreduced_axes` cannot be combined with `should_skip_update_fn` "
            "or `skip_nonfinite`: an unreduced gradient is a partial sum, so "
            "testing it takes an all-reduce on every micro-step. Test each "
            "device's gradients inside the shard_map instead and give a "
            "non-finite micro-batch weight 0 there."
        )
    if unreduced_axes and window_size.axis_name is not None:
        raise ValueError(
            "`axis_name` of adaptive_every_k cannot be combined with "
            "`unreduced_axes`: the window's per-device terms are summed over "
            "the mesh before the noise scale is estimated, so the estimate "
            "is already one for all devices. Use axis_name=None (it is for "
            "pmap / shard_map with an average_across_devices inside)."
        )
    statistics = _statistics(statistics)
    noise: tuple[WindowStatistic, ...] = ()
    if track_noise_scale:
        noise = (
            _noise_scale.noise_scale_statistic(
                noise_scale_decay, estimator, window_size.axis_name
            ),
        )
    return Parts(
        opt=optax.with_extra_args_support(_checks.transformation("opt", opt)),
        store=_store(accumulator_dtype, window_accumulator, unreduced_axes),
        reduction=_window_reduction(window_reduction, unreduced_axes),
        statistics=noise + statistics,
        statistic_fields=("noise",) * len(noise) + ("statistics",) * len(statistics),
        window_size=window_size,
        should_skip_update_fn=should_skip_update_fn,
        use_grad_mean=_checks.boolean("use_grad_mean", use_grad_mean),
        count_skipped=_checks.boolean("count_skipped", count_skipped),
        unreduced_axes=unreduced_axes,
    )


def _store(
    accumulator_dtype: Any,
    window_accumulator: WindowAccumulator | None,
    unreduced_axes: frozenset[str],
) -> SharedWindow | DecodedWindow:
    """The window's storage: a float window, or a per-device one decoded."""
    accumulator_dtype = _checks.float_dtype("accumulator_dtype", accumulator_dtype)
    if window_accumulator is None:
        return SharedWindow(float_accumulator(accumulator_dtype, unreduced_axes))
    if not isinstance(window_accumulator, WindowAccumulator):
        raise ValueError(
            "`window_accumulator` must be None or a WindowAccumulator, "
            f"got {window_accumulator!r}."
        )
    if not unreduced_axes:
        return SharedWindow(window_accumulator)
    # Per-device gradient terms: each device keeps its own window, decoded
    # and reduced once, at the emission.
    if len(unreduced_axes) != 1:
        raise ValueError(
            "`unreduced_axes` with a `window_accumulator` takes one mesh "
            "axis (each device's window is stacked on a leading axis "
            f"sharded over it), got {sorted(unreduced_axes)}."
        )
    return DecodedWindow(per_device_accumulator(window_accumulator, unreduced_axes))


def _statistics(statistics: Any) -> tuple[WindowStatistic, ...]:
    """The validated ``statistics``: a sequence of `WindowStatistic` s."""
    if isinstance(statistics, WindowStatistic) or not all(
        isinstance(stat, WindowStatistic) for stat in statistics
    ):
        raise ValueError(
            "`statistics` must be a sequence of WindowStatistic (e.g. "
            f"[my_statistic]), got {statistics!r}."
        )
    return tuple(statistics)


def _window_reduction(
    reduction: _reduction.WindowReduction | None, unreduced_axes: frozenset[str]
) -> _reduction.WindowReduction:
    """The validated ``window_reduction``; the float all-reduce for None."""
    if reduction is None:
        return _reduction.float_window_reduction()
    if not isinstance(reduction, _reduction.WindowReduction):
        raise ValueError(
            "`window_reduction` must be None or a WindowReduction (e.g. "
            f"ternary_window_reduction(seed=0)), got {reduction!r}."
        )
    if not unreduced_axes:
        raise ValueError(
            "`window_reduction` needs `unreduced_axes`: without per-device "
            "terms the window has nothing to reduce across devices (put "
            "ternary_average_across_devices in the inner chain under "
            "shard_map instead)."
        )
    return reduction


def check_state(state: Any, method: str) -> None:
    """Raises unless ``state`` looks like a `MultiStepsState`."""
    if not all(hasattr(state, field) for field in ("mini_step", "acc_grads")):
        raise ValueError(
            f"MultiSteps.{method}: `state` must be the MultiStepsState returned "
            "by `init(params)` (or by the previous update), got "
            f"{type(state).__name__}. Call `init` first and pass its result."
        )
