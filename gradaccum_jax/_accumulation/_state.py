"""The state of an accumulation and what `stats` reports of it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np


class MultiStepsState(NamedTuple):
    """State of `MultiSteps` (the first five fields are optax's).

    Attributes:
      mini_step: micro-batches accepted in the current window.
      gradient_step: windows closed so far (updates emitted, plus windows
        of zero weight, which emit none).
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: the window's accumulated (weighted) gradient sum, in the
        layout of the `gradaccum_jax.extend.WindowAccumulator` (a tree like
        the params by default, a `gradaccum_jax.extend.RunningMean` for a
        float16 or bfloat16 ``accumulator_dtype``).
        Meaningful while ``mini_step > 0``: after an emission it holds the
        emitted updates until the next micro-batch resets it.
      skip_state: what ``should_skip_update_fn`` returned last.
      acc_weight: the window's total weight, float32.
      micro_steps: micro-batches accepted since init.
      emitted: whether the last call emitted an update.
      reduction_state: the ``window_reduction``'s state (``()`` for the
        default float all-reduce; the PRNG counter of
        `gradaccum_jax.ternary_window_reduction`).
      noise: the gradient noise scale's
        `gradaccum_jax.extend.NoiseScaleState` with
        ``track_noise_scale=True``, else ``()``.
      window_size: the current window's size with an `adaptive_every_k`
        schedule (int32), else ``()``.
      statistics: the states of the ``statistics=`` passed to the
        accumulator (`gradaccum_jax.extend.WindowStatistic`), in their order.
    """

    mini_step: Any
    gradient_step: Any
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()
    acc_weight: Any = np.zeros((), np.float32)
    micro_steps: Any = np.zeros((), np.int32)
    emitted: Any = np.zeros((), np.bool_)
    reduction_state: Any = ()
    noise: Any = ()
    window_size: Any = ()
    statistics: Any = ()


class AccumulationStats(NamedTuple):
    """Progress of an accumulation, as returned by `MultiSteps.stats`.

    Attributes:
      micro_steps: micro-batches accepted since init.
      gradient_steps: updates emitted since init.
      window_fill: micro-batches in the current, unfinished window.
      window_size: micro-batches per window at the current gradient step.
      window_weight: total weight of the current window.
      grad_sq_norm: smoothed estimate of the true gradient's squared norm
        ``|G|^2`` (``track_noise_scale``; NaN when not tracked or before
        the first window of two or more weighted micro-batches).
      noise_trace: smoothed estimate of ``tr(S)``, the trace of the
        per-example gradient covariance (NaN likewise).
      noise_scale: ``B_simple = noise_trace / grad_sq_norm`` (McCandlish et
        al. 2018), in units of weight (examples, or micro-batches without
        weights); NaN likewise, +inf when ``grad_sq_norm <= 0``.
    """

    micro_steps: jax.Array
    gradient_steps: jax.Array
    window_fill: jax.Array
    window_size: jax.Array
    window_weight: jax.Array
    grad_sq_norm: jax.Array
    noise_trace: jax.Array
    noise_scale: jax.Array
