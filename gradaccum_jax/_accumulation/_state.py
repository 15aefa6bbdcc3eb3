"""The state of an accumulation and what `stats` reports of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import _placement, _tree
from gradaccum_jax._accumulation import _skip
from gradaccum_jax._accumulation._configuration import Configuration
from gradaccum_jax._partials import TermsLayout
from gradaccum_jax._statistic import map_window_terms, reports


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
        default float all-reduce; a `gradaccum_jax.extend.CodecState`
        for `gradaccum_jax.ternary_window_reduction` and
        `gradaccum_jax.compressed_window_reduction`).
      window_size: the current window's size with an `adaptive_every_k`
        schedule (int32), else ``()``.
      statistics: each window statistic's state, by the statistic's name (a
        dict): the ``statistics=`` passed to the accumulator
        (`gradaccum_jax.extend.WindowStatistic`) and, with
        ``track_noise_scale=True`` or an `adaptive_every_k` window, the
        noise scale's `gradaccum_jax.extend.NoiseScaleState` under
        ``"noise_scale"``; ``{}`` without statistics.
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
    window_size: Any = ()
    statistics: Any = {}  # noqa: RUF012 (a pytree field, never mutated)


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


# The fields of `AccumulationStats` that window statistics report
# (`WindowStatistic.report`), NaN where none does.
REPORTED = AccumulationStats._fields[5:]


def initial_state(config: Configuration, params: optax.Params) -> MultiStepsState:
    """The state of an empty first window: each part's initial state,
    placed as a jitted step returns it (so that its second call does not
    compile again)."""
    layout = config.layout()
    state = MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=config.opt.init(params),
        acc_grads=config.store.accumulator.init(params),
        skip_state=_skip.initial_skip_state(config.should_skip_update_fn, params),
        acc_weight=layout.zeros(jnp.zeros([], jnp.float32)),
        micro_steps=jnp.zeros([], jnp.int32),
        emitted=jnp.zeros([], jnp.bool_),
        # Per-device states (a codec's residuals, stacked) are not laid out
        # like the params: no partitioning metadata of theirs (flax's boxes).
        reduction_state=_tree.unboxed(config.reduction.init(params, layout)),
        window_size=config.window_size.initial(),
        statistics={
            name: stat.init(params, layout) for name, stat in config.statistics.items()
        },
    )
    return _placement.as_jit_returns(stored(config, state, layout))


def stored(
    config: Configuration, state: MultiStepsState, layout: TermsLayout
) -> MultiStepsState:
    """``state`` as it leaves a jitted call: its window's per-device terms
    as ordinary arrays (`TermsLayout.stored`; no unreduced array crosses a
    jit boundary). `_engine.load` inverts it."""
    if not layout.holds_terms(state.acc_weight, jnp.zeros([])):
        return state
    return map_window(
        config,
        state,
        lambda terms: jax.tree.map(layout.stored, _tree.unboxed(terms)),
        lambda acc, layout: config.store.stored(_tree.unboxed(acc), layout),
        layout,
    )


def map_window(
    config: Configuration,
    state: MultiStepsState,
    terms_fn: Callable[[Any], Any],
    window_fn: Callable[[Any, TermsLayout], Any],
    layout: TermsLayout,
) -> MultiStepsState:
    """``terms_fn`` on the weight and window terms, ``window_fn`` on the window."""
    return state._replace(
        acc_grads=window_fn(state.acc_grads, layout),
        acc_weight=terms_fn(state.acc_weight),
        statistics=map_window_terms(config.statistics, state.statistics, terms_fn),
    )


def stats_of(config: Configuration, state: MultiStepsState) -> AccumulationStats:
    """`MultiSteps.stats`: the window's progress and what the statistics
    report (`WindowStatistic.report`), NaN for a field none reports."""
    with _placement.on_mesh_of(state.acc_weight):
        layout = config.layout()
        devices = layout.stored_devices(state.acc_weight)
        if devices is None:
            window_weight = layout.total(state.acc_weight, jnp.zeros([]))
        else:
            window_weight = layout.rows_total(state.acc_weight, devices)
    window_size = config.window_size.current(state.window_size, state.gradient_step)
    reported = reports(config.statistics, state.statistics)
    unknown = sorted(set(reported) - set(REPORTED))
    if unknown:
        raise ValueError(
            f"A window statistic reports {unknown[0]!r}, which is not a field "
            f"of AccumulationStats: a statistic reports some of {REPORTED} "
            "(read anything else from MultiStepsState.statistics)."
        )
    nan = jnp.full([], jnp.nan, jnp.float32)
    return AccumulationStats(
        micro_steps=state.micro_steps,
        gradient_steps=state.gradient_step,
        window_fill=state.mini_step,
        window_size=jnp.asarray(window_size, jnp.int32),
        window_weight=window_weight,
        **{field: reported.get(field, nan) for field in REPORTED},
    )


def check_state(state: Any, method: str) -> None:
    """Raises unless ``state`` looks like a `MultiStepsState`."""
    if not all(hasattr(state, field) for field in ("mini_step", "acc_grads")):
        raise ValueError(
            f"MultiSteps.{method}: `state` must be the MultiStepsState returned "
            "by `init(params)` (or by the previous update), got "
            f"{type(state).__name__}. Call `init` first and pass its result."
        )
