"""`accumulate`: the accumulation engine as a transformation for `optax.chain`."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import optax

from gradaccum_jax import _checks
from gradaccum_jax._accumulation._configuration import configure
from gradaccum_jax._accumulation._multisteps import configured_transformation
from gradaccum_jax._accumulation._skip import ShouldSkipUpdateFunction
from gradaccum_jax._accumulation._transformation import AccumulationTransformation
from gradaccum_jax._reduction import WindowReduction
from gradaccum_jax._statistic import WindowStatistic
from gradaccum_jax._window._size import Schedule


def accumulate(
    opt: optax.GradientTransformation,
    every_k: Schedule,
    *,
    use_grad_mean: bool = True,
    should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
    skip_nonfinite: bool = False,
    count_skipped: bool = True,
    accumulator_dtype: Any = jnp.float32,
    unreduced_axes: str | Sequence[str] = (),
    window_reduction: WindowReduction | None = None,
    track_noise_scale: bool = False,
    noise_scale_decay: float = 0.95,
    noise_scale_estimator: str = "sampled",
    statistics: Mapping[str, WindowStatistic] | None = None,
    average: bool | None = None,
) -> AccumulationTransformation:
    """Accumulation as a transformation, for use inside `optax.chain`.

    ``chain(clip_by_global_norm(c), accumulate(optax.adam(lr), k))`` clips
    each micro-batch and then accumulates; the machinery, the keywords and
    the guarantees are those of `MultiSteps`. The one default that differs
    is ``count_skipped=True``: a transformation in a chain most often runs
    under pmap / shard_map, where devices must close their windows together.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = optax.chain(ga.clip_by_global_norm(10.0), ga.accumulate(optax.sgd(1.0), 2))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for g in (1.0, 3.0):
    ...     updates, state = tx.update({"w": jnp.full(2, g)}, state)
    >>> updates["w"]  # the second micro-batch closes the window: -mean
    Array([-2., -2.], dtype=float32)

    Args:
      opt: the optimizer run on each window's gradient.
      every_k: micro-batches per update (int >= 1 or a schedule).
      use_grad_mean: emit the (weighted) mean if True, the sum otherwise.
      should_skip_update_fn: as in `MultiSteps`.
      skip_nonfinite: shorthand for ``should_skip_update_fn=skip_not_finite``.
      count_skipped: as in `MultiSteps`; True here, so skipped micro-batches
        keep their place in the window and devices stay in step.
      accumulator_dtype: floating dtype of the window sum (narrower than
        float32: of a running mean, see
        `gradaccum_jax.extend.float_accumulator`).
      unreduced_axes: as in `MultiSteps`: mesh axes over which gradients
        arrive unreduced, reduced once per window; checkpoint
        ``reduce_window(state)``, not the state (whose unreduced arrays
        orbax cannot save).
      window_reduction: as in `MultiSteps`: how the window's per-device
        terms are summed (``unreduced_axes`` only; None: one float32
        all-reduce).
      track_noise_scale: as in `MultiSteps`: estimate the gradient noise
        scale (`stats`).
      noise_scale_decay: as in `MultiSteps`.
      noise_scale_estimator: as in `MultiSteps`: ``"sampled"`` or ``"all"``.
      statistics: as in `MultiSteps`: more window statistics, by name.
      average: deprecated spelling of ``use_grad_mean``.

    Returns:
      An `AccumulationTransformation` accepting ``weight=``.
    """
    if average is not None:
        warnings.warn(
            "accumulate(average=...) is deprecated: use use_grad_mean=..., the "
            "keyword MultiSteps and ternary_accumulate take too.",
            DeprecationWarning,
            stacklevel=2,
        )
        use_grad_mean = _checks.boolean("average", average)
    config = configure(
        opt,
        every_k,
        every_k_argument="every_k",
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        skip_nonfinite=skip_nonfinite,
        count_skipped=count_skipped,
        accumulator_dtype=accumulator_dtype,
        unreduced_axes=unreduced_axes,
        window_reduction=window_reduction,
        track_noise_scale=track_noise_scale,
        noise_scale_decay=noise_scale_decay,
        noise_scale_estimator=noise_scale_estimator,
        statistics=statistics,
    )
    return configured_transformation(config)
