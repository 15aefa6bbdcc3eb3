"""The accumulation engine: a micro-step and an emission, composed of parts.

Each part owns its slice of the state and has one job (see
`Configuration`): the window's storage (a `WindowStore` holding a
`WindowAccumulator`), where per-device terms live (a `TermsLayout`, decided
once per trace), the window's cross-device reduction (a
`WindowReduction`), the window statistics (`WindowStatistic`s, by name),
the inner optimizer's step (`_inner_step`) and the window's size (a
`WindowSize` policy). A micro-step reads::

    accept -> add -> observe -> count -> emit_if(window is full)

and an emission, inside a zero-or-one-trip loop (`_control.run_if`)::

    reduce -> close statistics -> step the inner optimizer if weighted
    -> reset the window -> next window size

The window as a whole, outside a micro-step, is `reset` (drop the partial
window), `reduce` (its per-device terms summed, for a checkpoint) and
`lift` (a reduced window made terms again).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _tree
from gradaccum_jax._accumulation import _inner_step, _skip
from gradaccum_jax._accumulation._configuration import Configuration
from gradaccum_jax._accumulation._state import MultiStepsState, map_window, stored
from gradaccum_jax._control import run_if
from gradaccum_jax._partials import TermsLayout, _rows
from gradaccum_jax._statistic import WindowPosition, map_window_terms


def add_micro_batch(
    config: Configuration,
    state: MultiStepsState,
    grads: Any,
    weight: jax.Array,
    params: Any,
    layout: TermsLayout,
) -> tuple[MultiStepsState, jax.Array]:
    """Adds one micro-batch to the window: ``(state, whether the window is full)``."""
    accept, skip_state = _skip.accepts(
        config.should_skip_update_fn,
        grads,
        state.gradient_step,
        params,
        state.skip_state,
    )
    # A weight of zero adds nothing, not even the skipped NaNs.
    weight = jnp.where(accept, weight, 0.0)
    accumulator = config.store.accumulator
    # The window is reset lazily, by its first micro-batch: after an
    # emission its buffers may hold the emitted updates (`UpdateSlots`).
    # The select fuses into the accumulation pass.
    acc = jax.tree.map(
        lambda fresh, old: jnp.where(state.mini_step == 0, fresh, old),
        accumulator.reset(state.acc_grads),
        state.acc_grads,
    )
    acc = accumulator.add(acc, grads, weight)
    fills_slot = jnp.asarray(True) if config.count_skipped else accept
    window_size = config.window_size.current(state.window_size, state.gradient_step)
    position = WindowPosition(
        state.mini_step, fills_slot, window_size, state.gradient_step
    )
    # No dependency on the add: a compiler may fuse both reads of the grads.
    stat_states = {
        name: stat.observe(state.statistics[name], grads, weight, position, layout)
        for name, stat in config.statistics.items()
    }
    mini_step = state.mini_step + fills_slot.astype(jnp.int32)
    state = state._replace(
        mini_step=mini_step,
        acc_grads=acc,
        acc_weight=state.acc_weight + layout.as_terms(weight, jnp.zeros([])),
        skip_state=skip_state,
        micro_steps=jnp.where(
            accept, optax.safe_increment(state.micro_steps), state.micro_steps
        ),
        statistics=stat_states,
    )
    # `>=` rather than `==`: a schedule may shrink k mid-window.
    full = jnp.logical_and(fills_slot, mini_step >= window_size)
    return state, full


class WindowCarry(NamedTuple):
    """What closing a window reads and writes (the `run_if` carry).

    Attributes:
      updates: the update slots: the window's leaves that will hold the
        inner optimizer's updates (`UpdateSlots`).
      rest: the rest of the window's accumulator.
      window_weight: the window's total weight (per-device terms).
      inner_state: the inner optimizer's state.
      reduction_state: the window reduction's state.
      stepped: whether the inner optimizer stepped (False on entry).
      stats: each statistic's state, by name.
    """

    updates: list[Any]
    rest: Any
    window_weight: Any
    inner_state: Any
    reduction_state: Any
    stepped: jax.Array
    stats: dict[str, Any]


class _Emission(NamedTuple):
    """What an emission needs besides its carry, fixed at trace time."""

    config: Configuration
    layout: TermsLayout
    slots: _inner_step.UpdateSlots
    inner_update: Callable[..., Any]
    position: WindowPosition  # where the window closes


def emit_if(
    config: Configuration,
    emit: jax.Array,
    state: MultiStepsState,
    grads_like: Any,
    params: Any,
    extra_args: dict[str, Any],
    layout: TermsLayout,
    scratch: Any = None,
) -> tuple[Any, MultiStepsState]:
    """Closes the window iff ``emit``: the inner optimizer's updates, or zeros.

    On a step that does not emit, the loop does nothing and copies nothing;
    the updates it leaves are masked to zero after it, where XLA fuses the
    mask into the caller's `optax.apply_updates`. ``scratch``, when given,
    is a dead tree (the micro-batch's gradients, already added to the
    window) whose buffers may hold the updates.

    Everything the emitting work reads is threaded through the carry, the
    window weight too: XLA hoists loop-invariant code out of while loops,
    and work on a closed-over value (a collective, a ternary decode) would
    then run on every micro-step instead of once per window.
    """
    emission = _plan(config, state, grads_like, params, extra_args, layout)
    slots = emission.slots
    closed = run_if(
        emit,
        lambda carry: _close_window(emission, carry),
        WindowCarry(
            updates=slots.initial_updates(state.acc_grads, scratch),
            rest=slots.rest(state.acc_grads),
            window_weight=state.acc_weight,
            inner_state=state.inner_opt_state,
            reduction_state=state.reduction_state,
            stepped=jnp.zeros([], jnp.bool_),
            stats=state.statistics,
        ),
    )
    new_updates = slots.updates_tree(
        [jnp.where(emit, u, jnp.zeros((), u.dtype)) for u in closed.updates]
    )
    new_state = state._replace(
        mini_step=jnp.where(emit, 0, state.mini_step),
        gradient_step=jnp.where(
            emit, optax.safe_increment(state.gradient_step), state.gradient_step
        ),
        inner_opt_state=closed.inner_state,
        acc_grads=slots.window(closed.updates, closed.rest),
        acc_weight=closed.window_weight,
        emitted=jnp.logical_and(emit, closed.stepped),
        reduction_state=closed.reduction_state,
        statistics=closed.stats,
    )
    next_size = config.window_size.next(state.window_size, closed.stats)
    return new_updates, new_state._replace(
        window_size=jax.tree.map(
            lambda new, old: jnp.where(emit, new, old), next_size, state.window_size
        )
    )


def flush(
    config: Configuration,
    state: MultiStepsState,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, MultiStepsState]:
    """Closes the partial window now (`MultiSteps.flush`), if it holds any
    micro-batch; its gradient in the params' dtypes, if given."""
    layout = config.layout()
    state = load(config, state, layout, params)
    # Only the dtypes are read: the zeros are dead.
    grads_like = optax.tree.zeros_like(
        jax.eval_shape(config.store.accumulator.total, state.acc_grads)
    )
    if params is not None:
        grads_like = optax.tree.cast_like(grads_like, params)
    updates, state = emit_if(
        config, state.mini_step > 0, state, grads_like, params, extra_args, layout
    )
    return updates, stored(config, state, layout)


def _plan(config, state, grads_like, params, extra_args, layout) -> _Emission:
    """The inner update and its slots, from shapes only (at trace time)."""

    def inner_update(window_sum, weight, inner_state, pass_weight=True):
        grads = _inner_step.window_gradient(
            window_sum, weight, grads_like, config.use_grad_mean
        )
        weight_arg = {"weight": weight} if pass_weight else {}
        updates, new_inner_state = config.opt.update(
            grads, inner_state, params, **weight_arg, **extra_args
        )
        return updates, _inner_step.keep_dtypes(new_inner_state, inner_state)

    # The inner optimizer sees the reduced window (per-device terms summed).
    window_sum, weight = jax.eval_shape(
        lambda acc, weight: layout.reduce(
            (config.store.accumulator.total(acc), weight)
        ),
        state.acc_grads,
        state.acc_weight,
    )
    inner_update, updates_shape = _inner_step.with_weight_if_accepted(
        inner_update, window_sum, weight, state.inner_opt_state
    )
    config.window_size.check_inner_update(
        inner_update, window_sum, weight, state.inner_opt_state
    )
    slots = _inner_step.UpdateSlots(state.acc_grads, updates_shape)
    position = WindowPosition(
        state.mini_step,
        jnp.asarray(False),
        config.window_size.current(state.window_size, state.gradient_step),
        state.gradient_step,
    )
    return _Emission(config, layout, slots, inner_update, position)


def _close_window(emission: _Emission, carry: WindowCarry) -> WindowCarry:
    """The emitting trip: reduce, close the statistics, step.

    The window's leaves that hold no update (per-device terms, a ternary or
    low-precision window) are left as they are: the next micro-batch
    resets the window lazily, as it does the leaves holding updates. Reset
    here, the reduction's read of each leaf and the zeros written into its
    buffer would be unordered for XLA, which then copies the window first
    (a second window-sized temporary).
    """
    config, layout, slots = emission.config, emission.layout, emission.slots
    updates, window_weight = carry.updates, carry.window_weight
    rest = slots.terms(updates, carry.rest)
    whole = functools.partial(slots.with_held, updates)
    # The window's only cross-device traffic with `unreduced_axes`: its
    # per-device sums, its weight and the statistics' window terms, in one
    # reduction (by default one fused float all-reduce). The terms held in
    # update slots are read typed as terms again (`UpdateSlots.terms`); the
    # reduced sums are buffers of their own, and the updates come back in
    # the terms' buffers.
    stat_terms = {
        name: stat.window_terms(carry.stats[name])
        for name, stat in config.statistics.items()
    }
    (reduced, weight, stat_sums), reduction_state, sum_sq_excess = (
        config.reduction.reduce(
            (config.store.reduction_terms(whole, rest), window_weight, stat_terms),
            layout,
            carry.reduction_state,
        )
    )
    window_sum = config.store.window_sum(whole, reduced)
    position = emission.position._replace(sum_sq_excess=sum_sq_excess)
    closed = {
        name: stat.close(
            stat.with_window_terms(carry.stats[name], stat_sums[name]),
            window_sum,
            weight,
            position,
        )
        for name, stat in config.statistics.items()
    }
    weight = _inner_step.ordered_after(weight, closed)
    # The next window's terms: zeros, in the carry's form (per-device terms).
    stats = {
        name: stat.with_window_terms(
            closed[name], jax.tree.map(_tree.zeros_like, stat_terms[name])
        )
        for name, stat in config.statistics.items()
    }
    updates, inner_state, stepped = _step_if_weighted(
        emission, updates, reduced, window_sum, weight, carry.inner_state
    )
    return WindowCarry(
        updates=updates,
        rest=carry.rest,
        window_weight=_tree.zeros_like(window_weight),
        inner_state=inner_state,
        reduction_state=reduction_state,
        stepped=stepped,
        stats=stats,
    )


def _step_if_weighted(
    emission: _Emission, updates, reduced, window_sum, weight, inner_state
):
    """The inner optimizer's step on the window, if the window has weight.

    A window of zero weight (all padding, all skipped) closes without
    stepping: adam's momentum would still move the params, adamw would
    decay them. A nested 0/1 loop rather than a select keeps the inner
    state in place. The window is threaded through the nested carry too: a
    closed-over integer window (ternary codes) would leak out of the
    differentiation rule of `run_if` as a tracer.

    Where no window leaf holds an update (per-device terms), the window's
    reduced sum is dead once the step has read it: its buffers hold the
    updates, so the reduced window and a second set of update buffers are
    never held at once.
    """
    stepped = _inner_step.window_has_weight(weight)
    sums_def = jax.tree.structure(window_sum)
    in_sums = emission.slots.holds_none and emission.slots.fits_updates(window_sum)
    if in_sums:
        updates, reduced = jax.tree.leaves(window_sum), ()

    def step(carry):
        updates, reduced, weight, inner_state = carry
        if in_sums:
            window_sum = sums_def.unflatten(updates)
        else:
            whole = functools.partial(emission.slots.with_held, updates)
            window_sum = emission.config.store.window_sum(whole, reduced)
        new_updates, inner_state = emission.inner_update(
            window_sum, weight, inner_state
        )
        return jax.tree.leaves(new_updates), reduced, weight, inner_state

    updates, _, _, inner_state = run_if(
        stepped, step, (updates, reduced, weight, inner_state)
    )
    # Not stepped, the slots still hold the (zero-weight) window.
    updates = [jnp.where(stepped, u, jnp.zeros((), u.dtype)) for u in updates]
    return updates, inner_state, stepped


def reset(config: Configuration, state: MultiStepsState) -> MultiStepsState:
    """``state`` with the partial window dropped; the inner state is kept."""
    return state._replace(
        mini_step=jnp.zeros_like(state.mini_step),
        acc_grads=config.store.accumulator.reset(state.acc_grads),
        acc_weight=_tree.zeros_like(state.acc_weight),
        emitted=jnp.zeros_like(state.emitted),
        statistics=map_window_terms(
            config.statistics,
            state.statistics,
            lambda terms: jax.tree.map(_tree.zeros_like, terms),
        ),
    )


def reduce(
    config: Configuration, state: MultiStepsState, layout: TermsLayout
) -> MultiStepsState:
    """``state`` with its window's per-device terms summed (for a checkpoint)."""
    state = load(config, state, layout)
    if not layout.holds_terms(state.acc_weight, jnp.zeros([])):
        return state
    return map_window(config, state, layout.reduce, config.store.reduce, layout)


def load(
    config: Configuration, state: MultiStepsState, layout: TermsLayout, like: Any = None
) -> MultiStepsState:
    """``state`` as a step works on it: its window's terms as ``layout``
    keeps them inside the step (unreduced arrays, say), from the ordinary
    arrays the state holds between jitted calls (`_state.stored`).

    A window stored on another number of devices (a checkpoint restored on
    another mesh) is summed whole first, and a whole window
    (`reduce_window`'s) is lifted: the window goes on exactly.
    """
    devices = layout.stored_devices(state.acc_weight)
    if devices is not None and devices == layout.device_count():
        _rows.check_placed(_stored_terms(config, state), layout)
        state = map_window(
            config,
            state,
            lambda terms: jax.tree.map(layout.loaded, terms),
            config.store.loaded,
            layout,
        )
    elif devices is not None:
        state = map_window(
            config,
            state,
            lambda terms: jax.tree.map(
                lambda leaf: layout.rows_total(leaf, devices), terms
            ),
            functools.partial(config.store.rows_total, devices=devices),
            layout,
        )
    return lift(config, state, layout, like)


def _stored_terms(config: Configuration, state: MultiStepsState) -> dict[str, Any]:
    """The fields of ``state`` that hold per-device terms, by name."""
    terms = {
        "acc_weight": state.acc_weight,
        "statistics": {
            name: stat.window_terms(state.statistics[name])
            for name, stat in config.statistics.items()
        },
    }
    if config.store.keeps_terms:
        terms["acc_grads"] = state.acc_grads
    return terms


def lift(
    config: Configuration, state: MultiStepsState, layout: TermsLayout, like: Any = None
) -> MultiStepsState:
    """A reduced window (see `reduce`) made per-device terms again, its
    leaves placed like ``like`` (the gradients or params), if given; the
    window reduction's per-device state placed too (a no-op where it is)."""
    if layout.axes:
        state = state._replace(
            reduction_state=config.reduction.placed_state(
                state.reduction_state, layout, like
            )
        )
    if not layout.axes or layout.holds_terms(state.acc_weight, jnp.zeros([])):
        return state

    def lift_window(acc, layout):
        return config.store.lift(acc, layout, like)

    return map_window(
        config,
        state,
        lambda tree: jax.tree.map(layout.lift, tree),
        lift_window,
        layout,
    )
