"""The window as a whole, outside a micro-step: reset, reduce, lift back.

Also where each `WindowStatistic`'s state is kept in a `MultiStepsState`:
the noise scale's in ``noise`` (its documented field), the user's in
``statistics``, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _tree
from gradaccum_jax._accumulation._parts import Parts
from gradaccum_jax._accumulation._state import MultiStepsState
from gradaccum_jax._partials import TermsLayout


def statistic_states(parts: Parts, state: MultiStepsState) -> list[Any]:
    """The statistics' states, in the order of ``parts.statistics``."""
    user = iter(state.statistics)
    return [
        getattr(state, field) if field != "statistics" else next(user)
        for field in parts.statistic_fields
    ]


def with_statistic_states(
    parts: Parts, state: MultiStepsState, states: list[Any]
) -> MultiStepsState:
    """``state`` holding ``states`` (as `statistic_states` reads them)."""
    fields: dict[str, Any] = {}
    user = []
    for field, stat_state in zip(parts.statistic_fields, states, strict=True):
        if field == "statistics":
            user.append(stat_state)
        else:
            fields[field] = stat_state
    fields["statistics"] = tuple(user)
    return state._replace(**fields)


def map_window_terms(
    parts: Parts, states: list[Any], fn: Callable[[Any], Any]
) -> list[Any]:
    """The statistics' states with ``fn`` applied to their window terms."""
    return [
        stat.with_window_terms(stat_state, fn(stat.window_terms(stat_state)))
        for stat, stat_state in zip(parts.statistics, states, strict=True)
    ]


def reset(parts: Parts, state: MultiStepsState) -> MultiStepsState:
    """``state`` with the partial window dropped; the inner state is kept."""
    empty = map_window_terms(
        parts,
        statistic_states(parts, state),
        lambda terms: jax.tree.map(_tree.zeros_like, terms),
    )
    state = state._replace(
        mini_step=jnp.zeros_like(state.mini_step),
        acc_grads=parts.store.accumulator.reset(state.acc_grads),
        acc_weight=_tree.zeros_like(state.acc_weight),
        emitted=jnp.zeros_like(state.emitted),
    )
    return with_statistic_states(parts, state, empty)


def reduce(
    parts: Parts, state: MultiStepsState, layout: TermsLayout
) -> MultiStepsState:
    """``state`` with its window's per-device terms summed (for a checkpoint)."""
    if not layout.holds_terms(state.acc_weight, jnp.zeros([])):
        return state
    return _map_window(parts, state, layout, layout.reduce, parts.store.reduce)


def lift(
    parts: Parts, state: MultiStepsState, layout: TermsLayout, like: Any = None
) -> MultiStepsState:
    """A reduced window (see `reduce`) made per-device terms again, its
    leaves placed like ``like`` (the gradients or params), if given; the
    window reduction's per-device state placed too (a no-op where it is)."""
    if layout.axes:
        state = state._replace(
            reduction_state=parts.reduction.placed_state(
                state.reduction_state, layout, like
            )
        )
    if not layout.axes or layout.holds_terms(state.acc_weight, jnp.zeros([])):
        return state

    def lift_tree(tree):
        return jax.tree.map(layout.lift, tree)

    def lift_window(acc, layout):
        return parts.store.lift(acc, layout, like)

    return _map_window(parts, state, layout, lift_tree, lift_window)


def _map_window(
    parts: Parts,
    state: MultiStepsState,
    layout: TermsLayout,
    terms_fn: Callable[[Any], Any],
    window_fn: Callable[[Any, TermsLayout], Any],
) -> MultiStepsState:
    """``terms_fn`` on the weight and window terms, ``window_fn`` on the window."""
    stats = map_window_terms(parts, statistic_states(parts, state), terms_fn)
    state = state._replace(
        acc_grads=window_fn(state.acc_grads, layout),
        acc_weight=terms_fn(state.acc_weight),
    )
    return with_statistic_states(parts, state, stats)
