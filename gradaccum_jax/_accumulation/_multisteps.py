"""`MultiSteps`: configuration of the accumulation engine, and delegation to it.

`MultiSteps` is a drop-in replacement for `optax.MultiSteps` with the same
constructor, state field names, methods, results and dtypes. It holds the
engine's `Configuration` (built by `_configuration.configure` from its
arguments) and calls the engine; the algorithm itself reads in `_engine`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks, _placement, _reduction
from gradaccum_jax._accumulation import _engine
from gradaccum_jax._accumulation._configuration import Configuration, configure
from gradaccum_jax._accumulation._skip import ShouldSkipUpdateFunction
from gradaccum_jax._accumulation._state import (
    AccumulationStats,
    MultiStepsState,
    check_state,
    initial_state,
    stats_of,
    stored,
)
from gradaccum_jax._accumulation._transformation import AccumulationTransformation
from gradaccum_jax._statistic import WindowStatistic
from gradaccum_jax._window._accumulator import WindowAccumulator
from gradaccum_jax._window._size import Schedule


class MultiSteps:
    """Accumulates gradients over k micro-batches, then runs the optimizer once.

    A drop-in replacement for `optax.MultiSteps`: same arguments, state field
    names, methods and results. Each call to `update` adds one micro-batch's
    gradient to the window; the call that completes the window passes the
    window's mean (or sum) to the inner optimizer and returns its updates,
    every other call returns zeros in the dtype the inner optimizer returns.

    Differences from optax, all of them additions:

    * the inner optimizer runs only on the emitting call, so a micro-step
      costs one pass over the gradients instead of a full optimizer update;
    * ``update(..., weight=w)`` weighs micro-batches: the emitted gradient is
      ``sum(w_i g_i) / sum(w_i)``, the big-batch gradient when micro-batch i
      holds w_i examples. At the emitting call the window's total weight is
      passed to the inner optimizer as the extra argument ``weight`` (so an
      `average_across_devices` in the inner chain weighs devices by what
      they saw), unless it rejects one (`optax.lbfgs`' line search);
    * a window of zero total weight emits zeros without stepping the inner
      optimizer (adam's moments are kept; `has_updated` is False), and
      devices that average inside ``opt`` decide alike (accumulation guide);
    * the accumulator is really reset, not multiplied by zero, so a
      non-finite micro-batch does not enter the next window's sum. It does
      make its own window's update non-finite, which adam keeps in its
      moments: drop it with ``skip_nonfinite=True`` or wrap the accumulation
      in `optax.apply_if_finite`;
    * `has_updated` is exact; `flush`, `reset`, `stats` handle partial windows.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from gradaccum_jax import MultiSteps
      >>> opt = MultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = opt.init(params)
      >>> micro_batches = [(jnp.array([1.0, 2.0]), 3), (jnp.array([5.0, 6.0]), 1)]
      >>> for grad, n_examples in micro_batches:
      ...     updates, state = opt.update({"w": grad}, state, params, weight=n_examples)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"]  # minus the weighted mean (3 * [1, 2] + [5, 6]) / 4
      Array([-2., -3.], dtype=float32)

    Data parallelism under jax.jit: with per-device gradients from
    `local_value_and_grad` and ``unreduced_axes``, the window keeps one
    term per device across jitted calls and is reduced once, at the
    emitting call (see the data-parallel guide). The state keeps the terms
    as ordinary arrays, one block of rows per device; ``reduce_window(state)``
    gives the window's sum shaped like the params.
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: Schedule,
        use_grad_mean: bool = True,
        should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
        accumulator_dtype: Any = jnp.float32,
        *,
        skip_nonfinite: bool = False,
        count_skipped: bool = False,
        window_accumulator: WindowAccumulator | None = None,
        unreduced_axes: str | Sequence[str] = (),
        window_reduction: _reduction.WindowReduction | None = None,
        track_noise_scale: bool = False,
        noise_scale_decay: float = 0.95,
        noise_scale_estimator: str = "sampled",
        statistics: Mapping[str, WindowStatistic] | None = None,
    ):
        """Builds the wrapper.

        Args:
          opt: the wrapped optimizer.
          every_k_schedule: micro-batches per update, as an int in
            [1, 2**31 - 1] or a function of the gradient step returning one
            (a batch-size schedule). A schedule value below 1 counts as 1
            (optax's MultiSteps stops emitting instead).
          use_grad_mean: emit the (weighted) mean of the window's gradients
            if True, their (weighted) sum otherwise.
          should_skip_update_fn: optional ``fn(grads, gradient_step, params)
            -> (skip, skip_state)``, e.g. `skip_not_finite`; a skipped
            micro-batch leaves the state as if it never happened, except
            ``skip_state``.
          accumulator_dtype: floating dtype of the window sum (a running
            mean below float32).
          skip_nonfinite: skip micro-batches whose gradients hold NaN or Inf
            (``should_skip_update_fn=skip_not_finite``).
          count_skipped: if False (optax's behaviour), a skipped micro-batch
            is as if it never happened; if True, it takes its place in the
            window with weight 0, so every window closes after exactly k
            calls, as devices that reduce across each other in ``opt`` need.
          window_accumulator: how the window sum is stored (`extend.WindowAccumulator`);
            overrides ``accumulator_dtype``. With ``unreduced_axes`` (one mesh axis)
            each device keeps its own window, decoded and reduced when it emits.
          unreduced_axes: mesh axes over which the gradients arrive as
            per-device terms (`local_value_and_grad`): the window is reduced
            once, at the emitting call. Not with a skip function. Between
            jitted calls each term is kept as an ordinary array, one block
            of rows per device: the state is saved as it is (orbax).
          window_reduction: how the per-device terms are summed at the
            emitting call (``unreduced_axes`` only): None for one exact float32
            all-reduce, or e.g. `gradaccum_jax.ternary_window_reduction`.
          track_noise_scale: estimate the gradient noise scale from the
            micro-batch and window gradient norms (McCandlish et al. 2018,
            see `stats` and the noise-scale guide). With ``unreduced_axes``
            each device's micro-batch counts as a small batch of its own.
          noise_scale_decay: decay in [0, 1) of the moving averages of the
            ``|G|^2`` and ``tr(S)`` estimates (bias-corrected; 0 keeps the
            last window's).
          noise_scale_estimator: ``"sampled"`` (default): one micro-batch's
            squared norm per window, drawn uniformly, times the window's size
            (unbiased, cheaper, noisier); ``"all"``: every micro-batch's.
          statistics: more window statistics, by name
            (``{name: gradaccum_jax.extend.WindowStatistic}``, see
            ``docs/architecture.md``, "Write your own part"); each one's
            state is kept in ``MultiStepsState.statistics[name]``.
        """
        self._config = configure(
            opt,
            every_k_schedule,
            use_grad_mean=use_grad_mean,
            should_skip_update_fn=should_skip_update_fn,
            skip_nonfinite=skip_nonfinite,
            accumulator_dtype=accumulator_dtype,
            count_skipped=count_skipped,
            window_accumulator=window_accumulator,
            unreduced_axes=unreduced_axes,
            window_reduction=window_reduction,
            track_noise_scale=track_noise_scale,
            noise_scale_decay=noise_scale_decay,
            noise_scale_estimator=noise_scale_estimator,
            statistics=statistics,
        )

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer (with extra-argument support)."""
        return self._config.opt

    def init(self, params: optax.Params) -> MultiStepsState:
        """Returns the state of an empty first window."""
        return initial_state(self._config, params)

    def update(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        *,
        weight: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        """Adds one micro-batch; emits the inner optimizer's update when due.

        Args:
          updates: this micro-batch's gradients.
          state: the current state.
          params: the current params, passed on to the inner optimizer.
          weight: optional scalar weight of this micro-batch, e.g. its
            number of examples or valid tokens (default 1).
          **extra_args: passed on to the inner optimizer at the emitting call
            (e.g. ``value`` for `optax.polyak_sgd`, ``value``, ``grad``,
            ``value_fn`` for `optax.lbfgs`).

        Returns:
          ``(updates, state)``: the inner optimizer's updates on the emitting
          call, zeros of the same dtypes otherwise.
        """
        check_state(state, "update")
        _checks.floating_leaves(updates, "gradients")
        layout = self._config.layout()
        _checks.gradients_as_terms(updates, params, layout)
        if params is not None:
            # Where params are given, the window reduction's state must be
            # the one its init makes (not another reduction's, restored).
            _checks.made_like(
                state.reduction_state,
                jax.eval_shape(
                    lambda params: self._config.reduction.init(params, layout),
                    params,
                ),
                "MultiSteps.update: the state's reduction_state",
                "window_reduction",
            )
        weight = layout.as_weight(weight, "MultiSteps.update")
        state = _engine.load(self._config, state, layout, updates)
        state, full = _engine.add_micro_batch(
            self._config, state, updates, weight, params, layout
        )
        updates, state = _engine.emit_if(
            self._config, full, state, updates, params, extra_args, layout, updates
        )
        return updates, stored(self._config, state, layout)

    def flush(
        self,
        state: MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        """Emits the partial window now, e.g. at the end of an epoch.

        The (weighted) mean of the micro-batches the window holds; an empty
        window emits zeros and leaves the inner optimizer untouched.

        Args:
          state: the current state.
          params: the current params; the window's gradient is cast to their
            dtypes (else kept in ``accumulator_dtype``, at least float32).
          **extra_args: passed on to the inner optimizer.

        Returns:
          ``(updates, state)`` with a fresh window in ``state``.
        """
        check_state(state, "flush")
        return _engine.flush(self._config, state, params, extra_args)

    def reset(self, state: MultiStepsState) -> MultiStepsState:
        """Drops the partial window; the inner optimizer state is kept."""
        check_state(state, "reset")
        return _engine.reset(self._config, state)

    def stats(self, state: MultiStepsState) -> AccumulationStats:
        """Micro-batches seen, updates emitted, the window, the noise scale.

        With ``track_noise_scale=True``, ``grad_sq_norm``, ``noise_trace``
        and ``noise_scale`` are the moving averages of each window's
        unbiased estimates of ``|G|^2`` and ``tr(S)`` and their ratio
        ``B_simple`` (McCandlish et al. 2018, appendix A), in units of
        ``weight`` (examples, or micro-batches without weights); NaN until
        a window of two or more weighted micro-batches closes, or when not
        tracked. The noise-scale guide has the formulas and their caveats.
        (They are what the window statistics report,
        `gradaccum_jax.extend.WindowStatistic.report`: a statistic of your
        own may fill them instead.)
        Works on a state of per-device terms inside or outside
        ``jax.set_mesh`` (the weight is summed on its arrays' mesh).
        """
        check_state(state, "stats")
        return stats_of(self._config, state)

    def has_updated(self, state: MultiStepsState | optax.OptState) -> jax.Array:
        """Whether the call that produced ``state`` emitted an update."""
        emitted = getattr(state, "emitted", None)
        if emitted is not None:
            return jnp.asarray(emitted)
        # A foreign state (e.g. optax's own): optax's approximation.
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> AccumulationTransformation:
        """``(init, update)`` for `optax.chain`: an `AccumulationTransformation`
        (it takes ``weight=``) with this object's window methods."""
        return AccumulationTransformation(self)

    def reduce_window(self, state: MultiStepsState) -> MultiStepsState:
        """Returns ``state`` with its window summed over ``unreduced_axes``.

        The window's sum, its weight and the statistics' window terms, each
        shaped like the params (or a scalar), where the state keeps them as
        rows, one block per device (a per-device ``window_accumulator``'s
        windows stay stacked, each device's own). One fused all-reduce.
        Read the window's sum shaped like the params here, not from the
        rows; `update` accepts the result back, split into terms again
        without moving data, and the window goes on exactly. Without
        ``unreduced_axes``: ``state`` as is.
        """
        with _placement.on_mesh_of(state.acc_weight):
            return _engine.reduce(self._config, state, self._config.layout())


def configured_transformation(config: Configuration) -> AccumulationTransformation:
    """The engine of ``config`` (built by `configure`) as a transformation:
    what `accumulate` and `ternary_accumulate` return."""
    multi_steps = MultiSteps.__new__(MultiSteps)
    multi_steps._config = config
    return multi_steps.gradient_transformation()
