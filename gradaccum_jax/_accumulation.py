"""Gradient accumulation over windows of micro-batches.

`MultiSteps` is a drop-in replacement for `optax.MultiSteps` with the same
constructor, state field names, methods, results and dtypes, built so that

* the inner optimizer runs only on the step that emits, inside a 0/1-trip
  while loop (`_control.run_if`), so a non-emitting micro-step costs about
  one pass of ``acc += w * g`` and copies no optimizer state;
* the accumulator reset is a real reset, so a NaN micro-batch does not
  carry over into the next window's sum. It still makes its own window's
  update NaN, and a stateful inner optimizer keeps it: adam's moments turn
  NaN and every later update with them. Drop such micro-batches with
  ``skip_nonfinite=True`` (or ``should_skip_update_fn=skip_not_finite``),
  or wrap the accumulation in `optax.apply_if_finite`;
* micro-batches can be weighted (``update(..., weight=n_examples)``), which
  makes the window's gradient equal to the big-batch gradient when
  micro-batches hold different numbers of examples;
* a partial window can be emitted (`flush`) or dropped (`reset`).

How a window's sum is stored is pluggable (`WindowAccumulator`): the default
keeps it in ``accumulator_dtype``; `gradaccum_jax.ternary_accumulate` keeps
int8 codes instead, with the same engine.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import (
    _checks,
    _noise_scale,
    _partials,
    _tree,
    _weights,
    _window_size,
)
from gradaccum_jax._control import run_if
from gradaccum_jax._tree import any_mapped_axis_bound, varying_axes
from gradaccum_jax._window import (
    WindowAccumulator,
    float_accumulator,
    per_device_accumulator,
)


class ShouldSkipUpdateFunction(optax.ShouldSkipUpdateFunction, Protocol):
    """Decides whether a micro-batch is skipped: ``should_skip_update_fn=``.

    optax's protocol, with its signature:
    ``fn(updates, gradient_step, params) -> (skip, skip_state)``. ``updates``
    are the micro-batch's gradients, ``gradient_step`` the window count
    (`MultiStepsState.gradient_step`, e.g. for an annealed threshold) and
    ``params`` the current params (or None). ``skip`` is a boolean scalar
    array; ``skip_state`` any pytree, kept in `MultiStepsState.skip_state`
    for logging. `skip_not_finite` and `skip_large_updates` are two.
    """

    def __call__(
        self, updates: optax.Updates, gradient_step: jax.Array, params: Any
    ) -> tuple[jax.Array, Any]: ...


# The skip functions are optax's own: same signatures, same skip_state.
skip_not_finite = optax.skip_not_finite
skip_large_updates = optax.skip_large_updates

Schedule = int | Callable[[jax.Array], jax.Array] | _window_size.AdaptiveWindow


class MultiStepsState(NamedTuple):
    """State of `MultiSteps` (the first five fields are optax's).

    Attributes:
      mini_step: micro-batches accepted in the current window.
      gradient_step: windows closed so far (updates emitted, plus windows
        of zero weight, which emit none).
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: the window's accumulated (weighted) gradient sum, in the
        layout of the `WindowAccumulator` (a tree like the params by default,
        a `RunningMean` for a float16 or bfloat16 ``accumulator_dtype``).
        Meaningful while ``mini_step > 0``: after an emission it holds the
        emitted updates until the next micro-batch resets it.
      skip_state: what ``should_skip_update_fn`` returned last.
      acc_weight: the window's total weight, float32.
      micro_steps: micro-batches accepted since init.
      emitted: whether the last call emitted an update.
      reduction_state: the ``window_reduction``'s state (``()`` for the
        default float all-reduce; the PRNG counter of
        `gradaccum_jax.ternary_window_reduction`).
      noise: the gradient noise scale's `NoiseScaleState` with
        ``track_noise_scale=True``, else ``()``.
      window_size: the current window's size with an `adaptive_every_k`
        schedule (int32), else ``()``.
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
      holds w_i examples; a window of zero total weight emits zeros. At the
      emitting call the window's total weight is passed to the inner
      optimizer as the extra argument ``weight``, so an
      `average_across_devices` in the inner chain weighs devices by what
      they saw. An inner optimizer that rejects an extra ``weight`` (the
      line searches of `optax.lbfgs` pass every extra argument on to
      ``value_fn``) is called without it, decided at trace time;
    * a window of zero total weight (all its micro-batches skipped or of
      weight 0) closes without an update: zeros are emitted, the inner
      optimizer does not step (its state, adam's count and moments
      included, is kept) and `has_updated` is False; ``gradient_step``
      still advances, so a batch-size schedule and the devices stay in step.
      Under data parallelism every device must take the same decision, or
      devices that average inside ``opt`` diverge: inside ``shard_map``
      the window weight is summed over the mesh axes it varies over (one
      scalar psum at the emitting call, which therefore needs every device
      to close its windows at the same call, as the averaging already does:
      ``count_skipped=True``), so a device whose own window is empty still
      applies the averaged update of the others. Under ``pmap`` (and
      ``shard_map(check_vma=False)``) values carry no such type and no rule
      can know which devices average together: there every closing window
      steps the inner optimizer, as optax's does, so a device with an empty
      window applies the averaged update, and one that does not average
      steps on a zero gradient;
    * the accumulator is really reset, not multiplied by zero, so a
      non-finite micro-batch (without a skip function) does not enter the
      next window's sum. It does make its own window's update non-finite,
      and only a stateless inner optimizer (sgd) recovers from that: adam
      puts the NaN into its moments, and every later update is NaN. The
      remedies drop the micro-batch before it reaches the inner optimizer:
      ``skip_nonfinite=True`` (``should_skip_update_fn=skip_not_finite``),
      or `optax.apply_if_finite` around the accumulation::

        MultiSteps(optax.adam(1e-3), 4, skip_nonfinite=True)
        optax.apply_if_finite(
            MultiSteps(optax.adam(1e-3), 4).gradient_transformation(), 10)

    * `has_updated` is exact, also after a skipped micro-batch;
    * `flush`, `reset` and `stats` handle partial windows.

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

    Data parallelism under jax.jit: with a batch sharded over a mesh axis,
    ``jax.grad`` all-reduces the gradients on every call, k times per
    window. Take per-device gradients with `local_value_and_grad` instead
    and build the wrapper with ``unreduced_axes``: the window then keeps one
    term per device across jitted calls (unreduced arrays on an Explicit
    mesh, stacked on a leading axis on an Auto one) and is reduced once, in
    one fused all-reduce of the window and its weight, inside the emission
    loop; non-emitting micro-steps move nothing between devices::

      jax.set_mesh(mesh)  # before init: the window is built for it
      opt = MultiSteps(optax.adam(1e-3), 8, unreduced_axes="data")
      grad_fn = local_value_and_grad(loss_fn, "data", has_weight=True)
      (loss, w), grads = grad_fn(params, x, y, mask)  # inside jax.jit
      updates, state = opt.update(grads, state, params, weight=w)

    A per-device ``weight`` (as `local_value_and_grad` returns it) means
    the gradients are already weighted; the window is then exactly
    ``sum(w g) / sum(w)`` over all devices and micro-batches. Unreduced
    arrays cannot be fetched to the host: checkpoint
    ``reduce_window(state)``, which `update` accepts back.

    The window's all-reduce can send ternary codes instead of float32
    (about 1/7 of the bytes with 8 devices): each device ternarizes its own
    term with TernGrad's unbiased stochastic rounding against a scale shared
    by all devices, the codes are summed by one packed integer all-reduce,
    and every device gets the same dequantized sum::

      opt = MultiSteps(optax.adam(1e-3), 8, unreduced_axes="data",
                       window_reduction=ternary_window_reduction(seed=0))
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
        window_reduction: _partials.WindowReduction | None = None,
        track_noise_scale: bool = False,
        noise_scale_decay: float = 0.95,
        noise_scale_estimator: str = "sampled",
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
          accumulator_dtype: floating dtype of the window sum (narrower
            than float32: of a running mean, see `float_accumulator`).
          skip_nonfinite: shorthand for
            ``should_skip_update_fn=skip_not_finite``: micro-batches whose
            gradients hold NaN or Inf are skipped.
          count_skipped: if False (optax's behaviour), a skipped micro-batch
            is as if it never happened and the window waits for one more. If
            True, it takes its place in the window with weight 0, so every
            window closes after exactly k calls. Use True under pmap or
            shard_map with a cross-device reduction in ``opt``: devices that
            skip different micro-batches would otherwise emit at different
            calls and wait for each other in the reduction forever.
          window_accumulator: how the window sum is stored; overrides
            ``accumulator_dtype`` (see `WindowAccumulator`). With
            ``unreduced_axes`` (one mesh axis) each device runs it on its
            own window (`per_device_accumulator`: stacked on a leading
            device axis, no collective per micro-step), and the emitting
            call reduces the decoded per-device sums and the weight in one
            fused all-reduce (`ternary_accumulate(..., unreduced_axes=)`).
          unreduced_axes: mesh axes (of an Explicit mesh) over which the
            gradients arrive unreduced, e.g. ``("data",)`` for gradients from
            `local_value_and_grad`: the window and its weight are kept
            unreduced across calls and reduced once per window, in one fused
            all-reduce at the emitting call (see "Data parallelism under
            jax.jit" in the class docstring). Not with a skip function.
          window_reduction: how the window's per-device terms are summed
            at the emitting call, with ``unreduced_axes`` only: None for one
            exact float32 all-reduce, or e.g.
            `gradaccum_jax.ternary_window_reduction` (ternary codes on the
            wire; its state goes in ``MultiStepsState.reduction_state``).
            `reduce_window` (for checkpoints) always sums exactly.
          track_noise_scale: estimate the gradient noise scale from the
            micro-batch and window gradient norms (McCandlish et al. 2018,
            see `stats`): one squared norm of the gradients per window
            (``noise_scale_estimator``) or per micro-step, one of the window
            per emission. Under pmap / shard_map with an
            averaging inner chain the window is the device's own, so the
            estimate is the device-local one (batch sizes of one device). With
            ``unreduced_axes`` each device's gradient of each micro-batch
            is a small batch of its own: every device keeps its own terms
            of the sums (no collective on a micro-step), which join the
            window's one reduction at the emission as two scalars; a
            replicated ``weight`` counts as spread evenly over the devices.
          noise_scale_decay: decay in [0, 1) of the moving averages of the
            ``|G|^2`` and ``tr(S)`` estimates (bias-corrected; 0 keeps the
            last window's).
          noise_scale_estimator: how ``A = sum_i w_i |g_i|^2`` is measured.
            ``"sampled"`` (default): the squared norm of one micro-batch per
            window, drawn uniformly among its ``m`` slots from the window's
            index (no PRNG state; the same on every device and after a
            checkpoint), times ``m``: unbiased, one read of the gradients
            for the norm per window instead of per micro-step, but noisier
            (one window's ``tr(S)`` spreads about 4x as wide at m = 8); a
            window closed before its ``m`` slots are filled (`flush`) gives
            no estimate. ``"all"``: every micro-batch's squared norm.
        """
        self._adaptive = None
        self._every_k_schedule: Callable[[Any], Any]
        if isinstance(every_k_schedule, _window_size.AdaptiveWindow):
            self._adaptive = every_k_schedule
            track_noise_scale = True
            self._every_k_schedule = lambda step: every_k_schedule.k_min
        elif isinstance(every_k_schedule, int | np.integer) and not isinstance(
            every_k_schedule, bool
        ):
            every_k = _checks.window_size("every_k_schedule", every_k_schedule)
            self._every_k_schedule = lambda step: every_k
        elif callable(every_k_schedule):
            self._every_k_schedule = every_k_schedule
        else:
            raise ValueError(
                "`every_k_schedule` must be an integer >= 1, a function of the "
                "gradient step returning one or an adaptive_every_k, got "
                f"{every_k_schedule!r}."
            )
        self._track_noise = _checks.boolean("track_noise_scale", track_noise_scale)
        self._noise_decay = _checks.decay_rate("noise_scale_decay", noise_scale_decay)
        self._noise_estimator = _checks.one_of(
            "noise_scale_estimator", noise_scale_estimator, _noise_scale.ESTIMATORS
        )
        self._opt = optax.with_extra_args_support(_checks.transformation("opt", opt))
        self._use_grad_mean = _checks.boolean("use_grad_mean", use_grad_mean)
        self._should_skip_update_fn = _skip_function(
            should_skip_update_fn, skip_nonfinite
        )
        self._count_skipped = _checks.boolean("count_skipped", count_skipped)
        accumulator_dtype = _checks.float_dtype("accumulator_dtype", accumulator_dtype)
        self._unreduced_axes = _checks.axis_names("unreduced_axes", unreduced_axes)
        if self._unreduced_axes and self._should_skip_update_fn is not None:
            raise ValueError(
                "`unreduced_axes` cannot be combined with `should_skip_update_fn` "
                "or `skip_nonfinite`: an unreduced gradient is a partial sum, so "
                "testing it takes an all-reduce on every micro-step. Test each "
                "device's gradients inside the shard_map instead and give a "
                "non-finite micro-batch weight 0 there."
            )
        # A window accumulator with per-device gradient terms: each device
        # keeps its own window, decoded and reduced once, at the emission.
        self._per_device = window_accumulator is not None and bool(self._unreduced_axes)
        if window_accumulator is None:
            window_accumulator = float_accumulator(
                accumulator_dtype, self._unreduced_axes
            )
        elif not isinstance(window_accumulator, WindowAccumulator):
            raise ValueError(
                "`window_accumulator` must be None or a WindowAccumulator, "
                f"got {window_accumulator!r}."
            )
        if self._per_device:
            if len(self._unreduced_axes) != 1:
                raise ValueError(
                    "`unreduced_axes` with a `window_accumulator` takes one mesh "
                    "axis (each device's window is stacked on a leading axis "
                    f"sharded over it), got {sorted(self._unreduced_axes)}."
                )
            window_accumulator = per_device_accumulator(
                window_accumulator, self._unreduced_axes
            )
        self._accumulator = window_accumulator
        self._reduction = _window_reduction(window_reduction, self._unreduced_axes)

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer (with extra-argument support)."""
        return self._opt

    def init(self, params: optax.Params) -> MultiStepsState:
        """Returns the state of an empty first window."""
        gradient_step = jnp.zeros([], jnp.int32)
        skip_state = ()
        if self._should_skip_update_fn is not None:
            _, skip_state = self._should_skip_update_fn(
                optax.tree.zeros_like(params), gradient_step, params
            )
        return MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=self._accumulator.init(params),
            skip_state=skip_state,
            acc_weight=self._empty_window_weight(),
            micro_steps=jnp.zeros([], jnp.int32),
            emitted=jnp.zeros([], jnp.bool_),
            reduction_state=self._reduction.init(params),
            noise=_noise_scale.init(self._unreduced_axes) if self._track_noise else (),
            window_size=() if self._adaptive is None else self._adaptive.initial_size(),
        )

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
        _check_state(state, "update")
        _checks.floating_leaves(updates, "gradients")
        if params is not None:
            _checks.same_structure(
                updates, self._terms_shapes(params), "gradients", "params"
            )
        if (
            self._unreduced_axes
            and weight is not None
            and np.ndim(weight) == 1
            and _partials.is_stacked(self._unreduced_axes)
        ):
            # Per-device weights stacked like the gradients (Auto mesh).
            weight = jnp.asarray(weight, jnp.float32)
        else:
            weight = _weights.scalar_weight(weight, "MultiSteps.update")
        state = self._unreduce_window(state)

        if self._should_skip_update_fn is None:
            accept = jnp.asarray(True)
            skip_state = state.skip_state
        else:
            skip, skip_state = self._should_skip_update_fn(
                updates, state.gradient_step, params
            )
            skip = jnp.asarray(skip)
            if (skip.dtype, skip.shape) != (jnp.bool_, ()):
                raise ValueError(
                    "`should_skip_update_fn` must return a boolean scalar array "
                    f"first, got dtype {skip.dtype} and shape {skip.shape}."
                )
            accept = jnp.logical_not(skip)
            # A weight of zero adds nothing, not even the skipped NaNs.
            weight = jnp.where(accept, weight, 0.0)

        # The window is reset lazily, by its first micro-batch: after an
        # emission the accumulator's buffers may hold the emitted updates
        # (see `_emit_if`). The select fuses into the accumulation pass.
        window_is_empty = state.mini_step == 0
        acc = jax.tree.map(
            lambda fresh, old: jnp.where(window_is_empty, fresh, old),
            self._accumulator.reset(state.acc_grads),
            state.acc_grads,
        )
        acc = self._accumulator.add(acc, updates, weight)
        fills_window = accept if not self._count_skipped else jnp.asarray(True)
        if self._track_noise:  # no dependency on the add: siblings may fuse
            state = state._replace(
                noise=_noise_scale.observe(
                    state.noise,
                    updates,
                    weight,
                    slot=state.mini_step,
                    fills_slot=fills_window,
                    window_size=self._window_size(state),
                    gradient_step=state.gradient_step,
                    axes=self._unreduced_axes,
                    estimator=self._noise_estimator,
                )
            )
        mini_step = state.mini_step + fills_window.astype(jnp.int32)
        # `>=` rather than `==`: a schedule may shrink k mid-window.
        emit = jnp.logical_and(fills_window, mini_step >= self._window_size(state))
        state = state._replace(
            mini_step=mini_step,
            acc_grads=acc,
            acc_weight=state.acc_weight + self._as_window_sum(weight),
            skip_state=skip_state,
            micro_steps=jnp.where(
                accept, optax.safe_increment(state.micro_steps), state.micro_steps
            ),
        )
        return self._emit_if(emit, state, updates, params, extra_args, scratch=updates)

    def flush(
        self,
        state: MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        """Emits the partial window now, e.g. at the end of an epoch.

        The emitted gradient is the (weighted) mean of the micro-batches the
        window actually holds. An empty window emits zeros and leaves the
        inner optimizer untouched.

        Args:
          state: the current state.
          params: the current params. The window's gradient is cast to their
            dtypes; without params it is in the dtype of the accumulator's
            ``total`` (``accumulator_dtype``, float32 when that is narrower).
          **extra_args: passed on to the inner optimizer.

        Returns:
          ``(updates, state)`` with a fresh window in ``state``.
        """
        _check_state(state, "flush")
        state = self._unreduce_window(state)
        if self._per_device:  # only the dtypes are read: the zeros are dead
            grads_like = optax.tree.zeros_like(
                jax.eval_shape(self._accumulator.total, state.acc_grads)
            )
        else:
            grads_like = self._accumulator.total(state.acc_grads)
        if params is not None:
            grads_like = optax.tree.cast_like(grads_like, params)
        return self._emit_if(state.mini_step > 0, state, grads_like, params, extra_args)

    def reset(self, state: MultiStepsState) -> MultiStepsState:
        """Drops the partial window; the inner optimizer state is kept."""
        _check_state(state, "reset")
        return state._replace(
            mini_step=jnp.zeros_like(state.mini_step),
            acc_grads=self._accumulator.reset(state.acc_grads),
            acc_weight=_tree.zeros_like(state.acc_weight),
            emitted=jnp.zeros_like(state.emitted),
            noise=_noise_scale.empty_window(state.noise),
        )

    def stats(self, state: MultiStepsState) -> AccumulationStats:
        """Micro-batches seen, updates emitted, the window, the noise scale.

        With ``track_noise_scale=True``, ``grad_sq_norm``, ``noise_trace``
        and ``noise_scale`` are the moving averages of each window's
        unbiased estimates of ``|G|^2`` and ``tr(S)`` from the squared norms
        at two batch sizes, the micro-batch and the window, and their ratio
        ``B_simple`` (McCandlish et al. 2018, "An Empirical Model of
        Large-Batch Training", appendix A; see `gradaccum_jax._noise_scale`
        for the weighted formulas). Units: those of ``weight`` (examples
        when each micro-batch's weight is its number of examples and its
        gradient their mean; micro-batches without weights). A window of
        one micro-batch gives no estimate (one batch size measures
        nothing): they stay NaN until a window of two or more micro-batches
        of nonzero weight closes (with ``noise_scale_estimator="sampled"``,
        the default, a full one: a flushed window gives none, and ``A`` is
        the drawn micro-batch's ``m w_j |g_j|^2``, an unbiased estimate of
        the sum at a fraction of its cost and a larger variance). With
        ``ternary_accumulate`` the window's norm includes the compression's
        noise, so ``tr(S)`` is underestimated by the codes' variance. Not
        tracked: NaN.

        Works on a state of per-device terms (``unreduced_axes``) inside or
        outside ``jax.set_mesh``: the window weight is summed on the mesh
        its arrays lie on.
        """
        _check_state(state, "stats")
        noise = _noise_scale.estimate(getattr(state, "noise", ()))
        with _partials.on_mesh_of(state.acc_weight):
            window_weight = self._window_total(state.acc_weight)
        return AccumulationStats(
            micro_steps=state.micro_steps,
            gradient_steps=state.gradient_step,
            window_fill=state.mini_step,
            window_size=jnp.asarray(self._window_size(state), jnp.int32),
            window_weight=window_weight,
            grad_sq_norm=noise.grad_sq_norm,
            noise_trace=noise.noise_trace,
            noise_scale=noise.noise_scale,
        )

    def has_updated(self, state: MultiStepsState | optax.OptState) -> jax.Array:
        """Whether the call that produced ``state`` emitted an update."""
        emitted = getattr(state, "emitted", None)
        if emitted is not None:
            return jnp.asarray(emitted)
        # A foreign state (e.g. optax's own): optax's approximation.
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> AccumulationTransformation:
        """Returns ``(init, update)`` for use in `optax.chain` and friends.

        The result is an `optax.GradientTransformationExtraArgs` (so a chain
        passes ``weight=`` on to it) that also has this object's window
        methods: `flush`, `reset`, `stats`, `has_updated`.
        """
        return AccumulationTransformation(self.init, self.update)

    def reduce_window(self, state: MultiStepsState) -> MultiStepsState:
        """Returns ``state`` with its window summed over ``unreduced_axes``.

        The window's gradient sum and weight, and with ``track_noise_scale``
        its per-device noise-scale sums ``A`` and ``k`` too. A per-device
        ``window_accumulator``'s windows (stacked, sharded over the axis)
        are plain arrays already and stay as they are.

        An unreduced array cannot leave the devices (``jax.device_get``,
        ``np.asarray`` and checkpointers raise NotImplementedError on it):
        save ``reduce_window(state)`` instead, which costs one fused
        all-reduce of the window. `update` accepts the reduced state back
        and splits it into a sum again (whole on one device, zeros on the
        others) without moving data; the window goes on exactly. Without
        ``unreduced_axes`` the state is returned as is.
        """
        with _partials.on_mesh_of(state.acc_weight):
            return self._reduce_window(state)

    def _reduce_window(self, state: MultiStepsState) -> MultiStepsState:
        if not self._holds_terms(state.acc_weight):
            return state
        noise_terms = _noise_scale.window_terms(state.noise)
        if self._per_device:  # the windows are plain arrays already
            acc_grads = state.acc_grads
            acc_weight, noise = _partials.reduce(
                (state.acc_weight, noise_terms), self._unreduced_axes
            )
        else:
            acc_grads, acc_weight, noise = _partials.reduce(
                (state.acc_grads, state.acc_weight, noise_terms),
                self._unreduced_axes,
            )
        return state._replace(
            acc_grads=acc_grads,
            acc_weight=acc_weight,
            noise=_with_window_terms(state.noise, noise),
        )

    def _terms_shapes(self, params: optax.Params) -> Any:
        """The shapes gradients arrive in: the params', or stacked."""
        if not _partials.is_stacked(self._unreduced_axes):
            return params
        return jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(
                _partials.stacked_shape(np.shape(p), self._unreduced_axes),
                jnp.result_type(p),
            ),
            params,
        )

    def _holds_terms(self, weight: jax.Array) -> bool:
        """Whether ``weight`` is kept as per-device terms."""
        return _partials.is_terms(weight, jnp.zeros(()), self._unreduced_axes)

    def _window_total(self, acc_weight: jax.Array) -> jax.Array:
        """The window's total weight, summed over devices if need be."""
        if not self._holds_terms(acc_weight):
            return acc_weight
        return _partials.reduce(acc_weight, self._unreduced_axes)

    def _empty_window_weight(self) -> jax.Array:
        """A zero weight, as per-device terms where the window keeps them."""
        zero = jnp.zeros([], jnp.float32)
        if not self._unreduced_axes:
            return zero
        return _partials.zeros(zero, self._unreduced_axes)

    def _as_window_sum(self, value: jax.Array) -> jax.Array:
        """A weight as a term of the window's sum (per device if it is)."""
        if not self._unreduced_axes or self._holds_terms(value):
            return value
        return _partials.lift(value, self._unreduced_axes)

    def _unreduce_window(self, state: MultiStepsState) -> MultiStepsState:
        """A reduced window (see `reduce_window`) made per-device again."""
        if not self._unreduced_axes or self._holds_terms(state.acc_weight):
            return state
        lift = functools.partial(_partials.lift, axes=self._unreduced_axes)
        noise = jax.tree.map(lift, _noise_scale.window_terms(state.noise))
        return state._replace(
            acc_grads=state.acc_grads
            if self._per_device
            else jax.tree.map(lift, state.acc_grads),
            acc_weight=lift(state.acc_weight),
            noise=_with_window_terms(state.noise, noise),
        )

    def _emit_if(self, emit, state, grads_like, params, extra_args, scratch=None):
        """Runs the inner optimizer on the window's gradient iff ``emit``.

        On a step that does not emit, the loop does nothing and copies nothing;
        the updates it leaves are masked to zero after it, where XLA fuses the
        mask into the caller's `optax.apply_updates`. Where the updates are
        computed is `_UpdateSlots`' business.

        ``scratch``, when given, is a dead tree (the micro-batch's gradients,
        already added to the window) whose buffers may hold the updates.
        """

        def inner_update(acc, acc_weight, inner_state, pass_weight=True):
            total = acc if self._per_device else self._accumulator.total(acc)
            grads = self._window_gradient(total, acc_weight, grads_like)
            weight_arg = {"weight": acc_weight} if pass_weight else {}
            new_updates, new_inner_state = self._opt.update(
                grads, inner_state, params, **weight_arg, **extra_args
            )
            # The loop carry must keep its dtypes; optax.MultiSteps casts the
            # same way (some optimizers promote their state on update).
            new_inner_state = jax.tree.map(
                lambda new, old: jnp.asarray(new).astype(jnp.result_type(old)),
                new_inner_state,
                inner_state,
            )
            return new_updates, new_inner_state

        # The inner optimizer sees the reduced window (per-device terms
        # summed), so its shapes are taken on that.
        reduced_window, reduced_weight = jax.eval_shape(
            lambda acc, weight: _partials.reduce(
                (self._accumulator.total(acc) if self._per_device else acc, weight),
                self._unreduced_axes,
            ),
            state.acc_grads,
            state.acc_weight,
        )
        inner_update, updates_shape = _with_weight_if_accepted(
            inner_update, reduced_window, reduced_weight, state.inner_opt_state
        )
        slots = _UpdateSlots(state.acc_grads, updates_shape)

        # Everything the emitting work reads is threaded through the carry,
        # the window weight too: XLA hoists loop-invariant code out of while
        # loops, and work on a closed-over value (a collective, a ternary
        # decode) would then run on every micro-step instead of once per
        # window.
        def emit_window(carry):
            updates, rest, window_weight, (inner_state, reduction_state), _, noise = (
                carry
            )
            reset_window = slots.rest(
                self._accumulator.reset(slots.window(updates, rest))
            )
            # The window's only cross-device traffic with `unreduced_axes`:
            # the reduction of its per-device sums, its weight and the noise
            # scale's per-device A and k (by default one fused float
            # all-reduce). Its leaves never hold updates (`_same_layout`), so
            # the reduced copy aliases no update slot. A per-device window is
            # decoded on each device first; from there on its reduced sums
            # stand for the window.
            terms = (
                self._accumulator.total(slots.window(updates, rest))
                if self._per_device
                else rest
            )
            noise_terms = (
                _noise_scale.window_terms(noise) if self._unreduced_axes else ()
            )
            (rest, acc_weight, noise_sums), reduction_state = self._reduction.reduce(
                (terms, window_weight, noise_terms),
                self._unreduced_axes,
                reduction_state,
            )
            if self._track_noise:  # the same acc_weight, ordered after the norm
                closed, acc_weight = _noise_scale.close_window(
                    _with_window_terms(noise, noise_sums),
                    acc_weight,
                    rest
                    if self._per_device
                    else self._accumulator.total(slots.window(updates, rest)),
                    self._noise_decay,
                    filled_slots=state.mini_step,
                    window_size=self._window_size(state),
                    estimator=self._noise_estimator,
                )
                # The next window's A and k: zero terms, in the carry's form.
                noise = _with_window_terms(
                    closed,
                    _noise_scale.window_terms(_noise_scale.empty_window(noise))
                    if noise_terms
                    else (),
                )
            # A window of zero weight (all padding, all skipped) closes
            # without stepping the inner optimizer: adam's momentum would
            # still move the params, adamw would decay them. A nested 0/1
            # loop rather than a select keeps the inner state in place.
            stepped = _window_has_weight(acc_weight)

            # The window is threaded through the nested carry too: a
            # closed-over integer window (ternary codes) would leak out of
            # the differentiation rule of `run_if` as a tracer.
            def step_inner(inner_carry):
                updates, rest, acc_weight, inner_state = inner_carry
                acc = rest if self._per_device else slots.window(updates, rest)
                new_updates, inner_state = inner_update(acc, acc_weight, inner_state)
                return jax.tree.leaves(new_updates), rest, acc_weight, inner_state

            updates, _, _, inner_state = run_if(
                stepped, step_inner, (updates, rest, acc_weight, inner_state)
            )
            return (
                # Not stepped, the slots still hold the (zero-weight) window.
                [jnp.where(stepped, u, jnp.zeros((), u.dtype)) for u in updates],
                reset_window,
                _tree.zeros_like(window_weight),
                (inner_state, reduction_state),
                stepped,
                noise,
            )

        updates, rest, acc_weight, (inner_state, reduction_state), stepped, noise = (
            run_if(
                emit,
                emit_window,
                (
                    slots.initial_updates(state.acc_grads, scratch),
                    slots.rest(state.acc_grads),
                    state.acc_weight,
                    (state.inner_opt_state, state.reduction_state),
                    jnp.zeros([], jnp.bool_),
                    state.noise,
                ),
            )
        )
        new_updates = slots.updates_tree(
            [jnp.where(emit, u, jnp.zeros((), u.dtype)) for u in updates]
        )
        new_state = state._replace(
            mini_step=jnp.where(emit, 0, state.mini_step),
            gradient_step=jnp.where(
                emit, optax.safe_increment(state.gradient_step), state.gradient_step
            ),
            inner_opt_state=inner_state,
            acc_grads=slots.window(updates, rest),
            acc_weight=acc_weight,
            emitted=jnp.logical_and(emit, stepped),
            reduction_state=reduction_state,
            noise=noise,
        )
        if self._adaptive is not None:
            next_size = self._adaptive.next_size(
                state.window_size, _noise_scale.estimate(noise)
            )
            new_state = new_state._replace(
                window_size=jnp.where(emit, next_size, state.window_size)
            )
        return new_updates, new_state

    def _window_size(self, state):
        """Micro-batches in the current window: the schedule's k, >= 1.

        An adaptive window's size is kept in the state; a schedule's is a
        function of ``state.gradient_step``.

        A schedule returning k <= 0 is a bug that a traced k cannot report.
        optax's MultiSteps then never emits again: training silently stops
        while the window's sum grows without bound. Here such a k counts as
        1 (every micro-batch is its own window), the nearest window that has
        a meaning, and `stats` reports that 1.
        """
        if self._adaptive is not None:
            return state.window_size
        return jnp.maximum(self._every_k_schedule(state.gradient_step), 1)

    def _window_gradient(self, total, acc_weight, grads_like):
        """The window's weighted mean (or sum), in the gradients' dtypes."""
        if self._use_grad_mean:
            # A window of zero total weight emits zeros rather than 0/0.
            has_weight = acc_weight > 0
            inverse = jnp.where(has_weight, 1.0, 0.0) / jnp.where(
                has_weight, acc_weight, 1.0
            )
            total = jax.tree.map(lambda t: t * inverse.astype(t.dtype), total)
        return optax.tree.cast_like(total, grads_like)


class _UpdateSlots:
    """Where an emission computes its updates: in the window's own buffers.

    Once a window is emitted its sum is dead, and the next window resets it
    lazily (its first ``add`` sees ``reset(acc)``). So each accumulator leaf
    with the shape and dtype of the matching update leaf holds that update:
    no parameter-sized buffer is allocated for the updates, in the step that
    emits or in any other. Update leaves without such a twin (a ternary
    window, a low-precision accumulator) take the dead micro-batch gradients
    of the step, or fresh zeros.

    The emission loop's carry is then ``(updates, rest)``: the update leaves
    (some of them the window's) and the window leaves that hold no update.
    `window` puts the two back together as the accumulator.
    """

    def __init__(self, acc: Any, updates_shape: Any):
        acc_leaves, self._acc_def = jax.tree.flatten(acc)
        self._update_shapes, self._updates_def = jax.tree.flatten(updates_shape)
        same_tree = self._acc_def == self._updates_def
        # holds_update[i]: accumulator leaf i holds update leaf i.
        self._holds_update = [
            same_tree and _same_layout(leaf, self._update_shapes[i])
            for i, leaf in enumerate(acc_leaves)
        ]

    def initial_updates(self, acc: Any, scratch: Any) -> list[jax.Array]:
        """The update buffers before the loop (their contents are never read)."""
        acc_leaves = jax.tree.leaves(acc)
        scratch_leaves = (
            jax.tree.leaves(scratch)
            if scratch is not None and jax.tree.structure(scratch) == self._updates_def
            else [None] * len(self._update_shapes)
        )
        return [
            acc_leaves[i]
            if i < len(self._holds_update) and self._holds_update[i]
            else _reuse_or_zeros(scratch_leaves[i], shape)
            for i, shape in enumerate(self._update_shapes)
        ]

    def rest(self, acc: Any) -> list[Any]:
        """The accumulator leaves that hold no update."""
        return [
            leaf
            for leaf, holds in zip(
                jax.tree.leaves(acc), self._holds_update, strict=True
            )
            if not holds
        ]

    def window(self, updates: list[jax.Array], rest: list[Any]) -> Any:
        """The accumulator made of its update-holding leaves and the rest."""
        rest_iter = iter(rest)
        return self._acc_def.unflatten(
            [
                updates[i] if holds else next(rest_iter)
                for i, holds in enumerate(self._holds_update)
            ]
        )

    def updates_tree(self, updates: list[jax.Array]) -> Any:
        """The update leaves as a tree shaped like the inner optimizer's output."""
        return self._updates_def.unflatten(updates)


def _with_window_terms(noise: Any, terms: tuple[jax.Array, ...]) -> Any:
    """``noise`` with its window's ``(A, k)`` replaced; as is for ``()``."""
    if not terms:
        return noise
    sq_norm_sum, micro_batches = terms
    return noise._replace(sq_norm_sum=sq_norm_sum, micro_batches=micro_batches)


def _with_weight_if_accepted(inner_update, *args):
    """``(inner_update, its updates' shapes)``, ``weight=`` dropped if rejected.

    ``inner_update(*args, pass_weight)`` runs the inner optimizer with the
    window weight as the extra argument ``weight`` or without it. Most
    transformations ignore extra arguments they do not use, but some reject
    them: optax's line searches (in `optax.lbfgs`) forward every extra
    argument to ``value_fn`` and raise a TypeError naming ``weight``, and a
    plain function without ``**kwargs`` raises one too. Those get no
    weight; everything else (`average_across_devices` in particular) does.
    Both are decided at trace time, by shape evaluation only.
    """
    try:
        updates_shape, _ = jax.eval_shape(inner_update, *args)
        return inner_update, updates_shape
    except TypeError as error:
        if "weight" not in str(error):
            raise
    without_weight = functools.partial(inner_update, pass_weight=False)
    updates_shape, _ = jax.eval_shape(without_weight, *args)
    return without_weight, updates_shape


def _same_layout(leaf: Any, shape: jax.ShapeDtypeStruct) -> bool:
    """Whether ``leaf``'s buffer can hold an update of ``shape``.

    The loop carry keeps the type of its initial value, so the types must
    agree too. An unreduced window leaf never holds an update (an update is
    a reduced value). Inside ``shard_map``, ``leaf`` must vary over no mesh
    axis the update does not vary over: an update that is the same on every
    device (after an `average_across_devices` in the inner chain) must stay
    typed so, or params updated with it could not be returned with
    ``out_specs=P()``.
    """
    return (
        jnp.shape(leaf),
        jnp.result_type(leaf),
        _tree.unreduced_axes(leaf),
    ) == (
        shape.shape,
        shape.dtype,
        _tree.unreduced_axes(shape),
    ) and varying_axes(leaf) <= varying_axes(shape)


def _reuse_or_zeros(leaf: Any, shape: jax.ShapeDtypeStruct) -> jax.Array:
    """``leaf`` if it has the layout of ``shape``, else zeros of that layout.

    The initial value of the loop's updates slot is never read (the loop
    either overwrites it or the result is masked to zero), so a dead buffer
    of the right layout serves, and XLA updates it in place instead of
    allocating (and page-faulting in) a fresh parameter-sized buffer.
    """
    if leaf is not None and _same_layout(leaf, shape):
        return leaf
    return _tree.zeros_like(shape)


def _window_has_weight(acc_weight: jax.Array) -> jax.Array:
    """Whether a closing window steps the inner optimizer, alike on all devices.

    Devices that average inside the inner optimizer must decide alike, or
    the one whose own window is empty keeps its state while the others
    apply the averaged update, and they diverge. Inside ``shard_map`` the
    weight's type says which mesh axes it varies over: the decision is
    taken on its sum over them (one scalar psum, at the emitting call).
    Where mapped axes are bound but the weight has no such type (``pmap``,
    ``shard_map(check_vma=False)``), nothing tells which axes the devices
    share: every closing window steps (the empty one with a zero gradient,
    which is the right thing when the inner optimizer averages). Without
    mapped axes the window's own weight decides. ``!= 0`` rather than
    ``> 0``: a NaN weight (a negative one under jit) must step, so that the
    update comes out NaN, loudly wrong, instead of silently skipped.
    """
    axes = tuple(sorted(varying_axes(acc_weight)))
    if axes:
        return jax.lax.psum(acc_weight, axes) != 0
    if any_mapped_axis_bound():
        return jnp.asarray(True)
    return acc_weight != 0


def _window_reduction(
    reduction: _partials.WindowReduction | None, unreduced_axes: frozenset[str]
) -> _partials.WindowReduction:
    """The validated ``window_reduction``; the float all-reduce for None."""
    if reduction is None:
        return _partials.float_window_reduction()
    if not isinstance(reduction, _partials.WindowReduction):
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


def _check_state(state: Any, method: str) -> None:
    """Raises unless ``state`` looks like a `MultiStepsState`."""
    if not all(hasattr(state, field) for field in ("mini_step", "acc_grads")):
        raise ValueError(
            f"MultiSteps.{method}: `state` must be the MultiStepsState returned "
            "by `init(params)` (or by the previous update), got "
            f"{type(state).__name__}. Call `init` first and pass its result."
        )


def _skip_function(
    should_skip_update_fn: ShouldSkipUpdateFunction | None, skip_nonfinite: bool
) -> ShouldSkipUpdateFunction | None:
    """The skip function from the two ways of asking for one."""
    should_skip_update_fn = _checks.optional_callable(
        "should_skip_update_fn",
        should_skip_update_fn,
        "fn(updates, gradient_step, params) -> (skip, skip_state)",
    )
    if not _checks.boolean("skip_nonfinite", skip_nonfinite):
        return should_skip_update_fn
    if should_skip_update_fn is not None:
        raise ValueError(
            "`skip_nonfinite=True` is shorthand for "
            "`should_skip_update_fn=skip_not_finite`: pass one of them, not both "
            f"(got should_skip_update_fn={should_skip_update_fn!r})."
        )
    return skip_not_finite


class AccumulationTransformation(optax.GradientTransformationExtraArgs):
    """An accumulating transformation: ``(init, update)`` plus window controls.

    Returned by `accumulate`, `gradaccum_jax.ternary_accumulate` and
    `MultiSteps.gradient_transformation`. It is an
    `optax.GradientTransformationExtraArgs`, so it goes into `optax.chain`
    and receives ``weight=``; its methods act on its own state (for a chain,
    the element of the chain's state tuple that belongs to it) exactly as
    the `MultiSteps` methods of the same names.
    """

    __slots__ = ()

    @property
    def _engine(self) -> MultiSteps:
        return self.update.__self__

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer (with extra-argument support)."""
        return self._engine.inner_opt

    def flush(
        self, state: MultiStepsState, params: optax.Params | None = None, **extra_args
    ) -> tuple[optax.Updates, MultiStepsState]:
        """See `MultiSteps.flush`."""
        return self._engine.flush(state, params, **extra_args)

    def reset(self, state: MultiStepsState) -> MultiStepsState:
        """See `MultiSteps.reset`."""
        return self._engine.reset(state)

    def stats(self, state: MultiStepsState) -> AccumulationStats:
        """See `MultiSteps.stats`."""
        return self._engine.stats(state)

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """See `MultiSteps.has_updated`."""
        return self._engine.has_updated(state)

    def reduce_window(self, state: MultiStepsState) -> MultiStepsState:
        """See `MultiSteps.reduce_window`."""
        return self._engine.reduce_window(state)

    def gradient_transformation(self) -> AccumulationTransformation:
        """Returns itself, so code written for `MultiSteps` runs unchanged."""
        return self


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
    track_noise_scale: bool = False,
    noise_scale_decay: float = 0.95,
    noise_scale_estimator: str = "sampled",
    average: bool | None = None,
) -> AccumulationTransformation:
    """Accumulation as a transformation, for use inside `optax.chain`.

    ``chain(clip_by_global_norm(c), accumulate(optax.adam(lr), k))`` clips
    each micro-batch and then accumulates; the machinery, the keywords and
    the guarantees are those of `MultiSteps`. The one default that differs
    is ``count_skipped=True``: a transformation in a chain most often runs
    under pmap / shard_map, where devices must close their windows together.

    Args:
      opt: the optimizer run on each window's gradient.
      every_k: micro-batches per update (int >= 1 or a schedule).
      use_grad_mean: emit the (weighted) mean if True, the sum otherwise.
      should_skip_update_fn: as in `MultiSteps`.
      skip_nonfinite: shorthand for ``should_skip_update_fn=skip_not_finite``.
      count_skipped: as in `MultiSteps`; True here, so skipped micro-batches
        keep their place in the window and devices stay in step.
      accumulator_dtype: floating dtype of the window sum (narrower than
        float32: of a running mean, see `float_accumulator`).
      unreduced_axes: as in `MultiSteps`: mesh axes over which gradients
        arrive unreduced, reduced once per window.
      track_noise_scale: as in `MultiSteps`: estimate the gradient noise
        scale (`stats`).
      noise_scale_decay: as in `MultiSteps`.
      noise_scale_estimator: as in `MultiSteps`: ``"sampled"`` or ``"all"``.
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
    if not callable(every_k) and not isinstance(every_k, _window_size.AdaptiveWindow):
        _checks.window_size("every_k", every_k)
    return MultiSteps(
        opt,
        every_k,
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        accumulator_dtype=accumulator_dtype,
        skip_nonfinite=skip_nonfinite,
        count_skipped=count_skipped,
        unreduced_axes=unreduced_axes,
        track_noise_scale=track_noise_scale,
        noise_scale_decay=noise_scale_decay,
        noise_scale_estimator=noise_scale_estimator,
    ).gradient_transformation()
