"""Window statistics: what the engine lets a part observe about each window.

A `WindowStatistic` sees every micro-batch's gradients (as each device's own
micro-batch, see `gradaccum_jax._partials.TermsLayout.micro_batch`) and,
when the window closes, the window's reduced sum. The gradient noise scale
(`gradaccum_jax._noise_scale`) is one; a new statistic is a new object
passed to ``MultiSteps(..., statistics={name: statistic})``, not a new
branch in the engine. The engine keeps each statistic's state under its
name (``MultiStepsState.statistics[name]``) and reads what a statistic
measured only through its `report`: `MultiSteps.stats` shows it, and a
window-size policy (`adaptive_every_k`) reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax


class WindowPosition(NamedTuple):
    """A point of a window: where a micro-batch falls in it, or where it closed.

    What `WindowStatistic.observe` sees of each micro-batch and
    `WindowStatistic.close` of the closing window (with how exact its sum
    is).

    Attributes:
      slot: int32, the window's slots filled before this point: the index of
        the slot a micro-batch fills (``observe``), or every slot the window
        filled (``close``: fewer than ``window_size`` for a `flush`).
      fills_slot: bool, whether the micro-batch takes a slot (False for one
        skipped with ``count_skipped=False``, which the window never saw);
        False at ``close``.
      window_size: int32, the slots of the window (its ``k``).
      window_index: int32, the window's index (``gradient_step``).
      sum_sq_excess: float32, at ``close``: by how much a lossy reduction
        (ternary codes) changed the squared norm of the window's sum, in
        expectation over its random draws: ``E|sum|^2 - |exact sum|^2``
        (the rounding variance, less what clipping removed); 0 for an
        exact reduction and at ``observe``. A statistic of the sum's
        squared norm subtracts it to stay unbiased.
    """

    slot: jax.Array
    fills_slot: jax.Array
    window_size: jax.Array
    window_index: jax.Array
    sum_sq_excess: Any = 0.0


class WindowStatistic(NamedTuple):
    """A statistic of the windows, kept in the accumulator's state.

    Its state holds two kinds of things: *window terms*, sums over the
    window's micro-batches that the engine keeps per device where the
    window is (a `TermsLayout`) and reduces with the window, in the same
    collective; and whatever the statistic keeps across windows (moving
    averages), the same on every device.

    Attributes:
      init: ``init(params, layout) -> state``: the state before any
        micro-batch; window terms built with ``layout.zeros``.
      observe: ``observe(state, grads, weight, position, layout) -> state``:
        adds one micro-batch (``grads`` in the layout the window receives,
        ``weight`` a float32 scalar or per-device terms). No collective:
        ``layout.micro_batch(fn)(grads, weight)`` runs ``fn(mean_grads,
        weight)`` on each device's own micro-batch and returns its result
        as terms. A zero weight must add nothing, even from NaN gradients
        (a select, not a multiply).
      window_terms: ``window_terms(state) -> terms``: the window terms
        (a pytree of arrays, possibly ``()``).
      with_window_terms: ``with_window_terms(state, terms) -> state``.
      close: ``close(state, window_sum, window_weight, position) -> state``:
        the window closes; ``state`` holds its reduced window terms,
        ``window_sum`` is the window's weighted gradient sum (reduced),
        ``window_weight`` its total weight and ``position`` says how many
        slots it filled. The engine then empties the window terms itself.
      report: optional ``report(state) -> {field: value}``: what the
        statistic measured, as `gradaccum_jax.AccumulationStats` fields
        (the noise scale reports ``grad_sq_norm``, ``noise_trace`` and
        ``noise_scale``), float32 scalars the same on every device.
        `MultiSteps.stats` shows them (NaN for a field no statistic
        reports) and a window-size policy reads them. None: it reports
        nothing (read its state from ``MultiStepsState.statistics``).
    """

    init: Callable[[Any, Any], Any]
    observe: Callable[[Any, Any, jax.Array, WindowPosition, Any], Any]
    window_terms: Callable[[Any], Any]
    with_window_terms: Callable[[Any, Any], Any]
    close: Callable[[Any, Any, jax.Array, WindowPosition], Any]
    report: Callable[[Any], Mapping[str, jax.Array]] | None = None


def named_statistics(
    statistics: Any, *declared: tuple[str, Mapping[str, WindowStatistic]]
) -> dict[str, WindowStatistic]:
    """The accumulator's statistics by name: those the other parts
    ``declared`` (``(which argument asks, {name: statistic})``, in order: the
    first of a name is kept, one statistic serving both), then
    ``statistics``, the user's, validated.

    Raises a ValueError naming ``statistics`` unless it maps names
    (non-empty strings) to `WindowStatistic` s taken by no other part.
    """
    if statistics is None:
        statistics = {}
    if not isinstance(statistics, Mapping) or not all(
        isinstance(name, str) and name and isinstance(stat, WindowStatistic)
        for name, stat in statistics.items()
    ):
        raise ValueError(
            "`statistics` must be a mapping of names (non-empty strings) to "
            "WindowStatistic (e.g. {'window_norm': my_statistic}; each one's "
            f"state is kept under its name), got {statistics!r}."
        )
    named: dict[str, WindowStatistic] = {}
    for source, part in declared:
        for name, stat in part.items():
            if name in statistics:
                raise ValueError(
                    f"`statistics` names {name!r}, the name of a statistic the "
                    f"accumulator keeps itself ({source} asks for it): give "
                    "yours another name."
                )
            named.setdefault(name, stat)
    return {**named, **statistics}


def map_window_terms(
    statistics: Mapping[str, WindowStatistic],
    states: Mapping[str, Any],
    fn: Callable[[Any], Any],
) -> dict[str, Any]:
    """The statistics' states with ``fn`` applied to their window terms."""
    return {
        name: stat.with_window_terms(states[name], fn(stat.window_terms(states[name])))
        for name, stat in statistics.items()
    }


def reports(
    statistics: Mapping[str, WindowStatistic], states: Mapping[str, Any]
) -> dict[str, jax.Array]:
    """Every statistic's `WindowStatistic.report`, merged into one mapping.

    Raises a ValueError if two statistics report the same field: `stats`
    would have to pick one.
    """
    merged: dict[str, jax.Array] = {}
    source: dict[str, str] = {}
    for name, stat in statistics.items():
        if stat.report is None:
            continue
        for field, value in stat.report(states[name]).items():
            if field in merged:
                raise ValueError(
                    f"The statistics {source[field]!r} and {name!r} both report "
                    f"{field!r}: a field of AccumulationStats comes from one "
                    "statistic; keep one of them."
                )
            merged[field], source[field] = value, name
    return merged
