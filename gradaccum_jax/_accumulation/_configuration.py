"""The engine's configuration, built once from an accumulator's arguments.

`configure` turns the keywords that `MultiSteps`, `accumulate` and
`ternary_accumulate` share into one `Configuration`, each argument
validated by the part it configures (a ValueError naming it); the engine
(`_engine`) reads nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from gradaccum_jax import _checks, _noise_scale
from gradaccum_jax._accumulation import _skip
from gradaccum_jax._partials import TermsLayout, terms_layout
from gradaccum_jax._reduction import WindowReduction, float_window_reduction
from gradaccum_jax._statistic import WindowStatistic, named_statistics
from gradaccum_jax._window._accumulator import WindowAccumulator
from gradaccum_jax._window._size import Schedule, WindowSize, window_size_policy
from gradaccum_jax._window._store import WindowStore, window_store


class Configuration(NamedTuple):
    """The engine's parts and the choices between them.

    Attributes:
      opt: the inner optimizer (with extra-argument support).
      store: the window's storage (a `WindowStore`).
      reduction: the window's cross-device reduction.
      statistics: the window statistics, by the name their state is kept
        under in ``MultiStepsState.statistics``.
      window_size: the window-size policy.
      should_skip_update_fn: the skip function, or None.
      use_grad_mean: emit the window's mean (else its sum).
      count_skipped: a skipped micro-batch takes its place in the window.
      unreduced_axes: the mesh axes of per-device terms.
    """

    opt: optax.GradientTransformationExtraArgs
    store: WindowStore
    reduction: WindowReduction
    statistics: Mapping[str, WindowStatistic]
    window_size: WindowSize
    should_skip_update_fn: _skip.ShouldSkipUpdateFunction | None
    use_grad_mean: bool
    count_skipped: bool
    unreduced_axes: frozenset[str]

    def layout(self) -> TermsLayout:
        """Where per-device terms live on the current mesh: decided here."""
        return terms_layout(self.unreduced_axes)


def configure(
    opt: Any,
    every_k_schedule: Schedule,
    *,
    every_k_argument: str = "every_k_schedule",
    use_grad_mean: Any = True,
    should_skip_update_fn: Any = None,
    skip_nonfinite: Any = False,
    count_skipped: Any = False,
    accumulator_dtype: Any = jnp.float32,
    window_accumulator: WindowAccumulator | None = None,
    unreduced_axes: Any = (),
    window_reduction: Any = None,
    track_noise_scale: Any = False,
    noise_scale_decay: Any = 0.95,
    noise_scale_estimator: Any = "sampled",
    statistics: Any = None,
) -> Configuration:
    """The `Configuration` for an accumulator's arguments, validated.

    The keywords are `MultiSteps`'; ``every_k_argument`` is the name the
    caller gives ``every_k_schedule`` (``"every_k"`` for `accumulate`).
    """
    should_skip_update_fn = _skip.skip_function(should_skip_update_fn, skip_nonfinite)
    unreduced_axes = _checks.axis_names("unreduced_axes", unreduced_axes)
    if unreduced_axes and should_skip_update_fn is not None:
        raise ValueError(
            "`unreduced_axes` cannot be combined with `should_skip_update_fn` "
            "or `skip_nonfinite`: an unreduced gradient is a partial sum, so "
            "testing it takes an all-reduce on every micro-step. Test each "
            "device's gradients inside the shard_map instead and give a "
            "non-finite micro-batch weight 0 there."
        )
    # `track_noise_scale=True` is sugar: the noise scale, one statistic
    # among the others, kept under its name (the window-size policy's, if
    # an adaptive window already reads it).
    noise_scale = _noise_scale.configured(noise_scale_decay, noise_scale_estimator)
    window_size = window_size_policy(
        every_k_schedule, noise_scale, unreduced_axes, every_k_argument
    )
    tracked = _checks.boolean("track_noise_scale", track_noise_scale)
    sugar = {_noise_scale.STATISTIC: noise_scale(None)} if tracked else {}
    return Configuration(
        opt=optax.with_extra_args_support(_checks.transformation("opt", opt)),
        store=window_store(accumulator_dtype, window_accumulator, unreduced_axes),
        reduction=_window_reduction(window_reduction, unreduced_axes),
        statistics=named_statistics(
            statistics,
            (f"`{every_k_argument}`", window_size.statistics),
            ("`track_noise_scale=True`", sugar),
        ),
        window_size=window_size,
        should_skip_update_fn=should_skip_update_fn,
        use_grad_mean=_checks.boolean("use_grad_mean", use_grad_mean),
        count_skipped=_checks.boolean("count_skipped", count_skipped),
        unreduced_axes=unreduced_axes,
    )


def _window_reduction(
    reduction: WindowReduction | None, unreduced_axes: frozenset[str]
) -> WindowReduction:
    """The validated ``window_reduction``; the float all-reduce for None."""
    if reduction is None:
        return float_window_reduction()
    if not isinstance(reduction, WindowReduction):
        raise ValueError(
            "`window_reduction` must be None or a WindowReduction "
            "(ternary_window_reduction(seed=0), or compressed_window_reduction("
            f"codec) for a codec of gradaccum_jax.codecs), got {reduction!r}."
        )
    if not unreduced_axes:
        raise ValueError(
            "`window_reduction` needs `unreduced_axes`: without per-device "
            "terms the window has nothing to reduce across devices (put "
            "ternary_average_across_devices or compressed_average_across_devices "
            "in the inner chain under shard_map instead)."
        )
    return reduction
