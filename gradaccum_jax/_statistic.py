"""Window statistics: what the engine lets a part observe about each window.

A `WindowStatistic` sees every micro-batch's gradients (as each device's own
micro-batch, see `gradaccum_jax._partials.TermsLayout.micro_batch`) and,
when the window closes, the window's reduced sum. The gradient noise scale
(`gradaccum_jax._noise_scale`) is one; a new statistic is a new object
passed to ``MultiSteps(..., statistics=...)``, not a new branch in the
engine.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """

    init: Callable[[Any, Any], Any]
    observe: Callable[[Any, Any, jax.Array, WindowPosition, Any], Any]
    window_terms: Callable[[Any], Any]
    with_window_terms: Callable[[Any, Any], Any]
    close: Callable[[Any, Any, jax.Array, WindowPosition], Any]
