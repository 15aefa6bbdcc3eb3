"""The window's storage as the emission sees it: shared with the updates, or decoded.

A `WindowAccumulator` keeps the window's sum; where it lies across devices
is the `gradaccum_jax._partials.TermsLayout`'s business. What differs
between accumulators at the emission is what the cross-device reduction
sums and what the inner optimizer then reads:

* `SharedWindow` (a float window: `float_accumulator`, whole or as
  per-device terms): the reduction sums the window's own leaves (those not
  holding an update, see `UpdateSlots`), and the inner optimizer reads the
  window's ``total``. Whole, the window's buffers then hold the updates.
* `DecodedWindow` (a `per_device_accumulator`: each device keeps its own
  window, e.g. ternary codes): each device decodes its window into its float
  term of the sum first (``total``), the reduction sums those terms, and
  the inner optimizer reads the sums.

The engine picks one when it is built and never asks which it holds.
"""

from __future__ import annotations

from typing import Any

import jax

from gradaccum_jax._accumulation._inner_step import UpdateSlots
from gradaccum_jax._partials import TermsLayout
from gradaccum_jax._window import WindowAccumulator


class SharedWindow:
    """A window whose leaves the reduction sums and the updates may reuse."""

    def __init__(self, accumulator: WindowAccumulator):
        self.accumulator = accumulator

    def reduction_terms(self, slots: UpdateSlots, updates: list, rest: list) -> Any:
        """What the cross-device reduction sums: the leaves holding no update.

        Per-device terms never hold an update (an update is a reduced value),
        so with ``unreduced_axes`` that is the whole window.
        """
        del slots, updates
        return rest

    def window_sum(self, slots: UpdateSlots, updates: list, reduced: Any) -> Any:
        """The window's reduced weighted sum, from the slots and the reduced rest."""
        return self.accumulator.total(slots.window(updates, reduced))

    def lift(self, acc: Any, layout: TermsLayout, like: Any = None) -> Any:
        """A reduced window (a checkpoint's `reduce_window`) as terms again.

        Placed like ``like`` (the gradients or params) first: a window
        restored from host arrays has lost its params' split (a
        tensor-parallel ``model`` axis), which the gradients it is added to
        have.
        """
        if like is not None and jax.tree.structure(like) == jax.tree.structure(acc):
            acc = jax.tree.map(layout.placed_like, acc, like)
        return jax.tree.map(layout.lift, acc)

    def reduce(self, acc: Any, layout: TermsLayout) -> Any:
        """The window summed over devices (for `reduce_window`)."""
        return layout.reduce(acc)


class DecodedWindow:
    """A per-device window, decoded on each device before the reduction."""

    def __init__(self, accumulator: WindowAccumulator):
        self.accumulator = accumulator

    def reduction_terms(self, slots: UpdateSlots, updates: list, rest: list) -> Any:
        """Each device's float term of the window's sum (its window decoded)."""
        return self.accumulator.total(slots.window(updates, rest))

    def window_sum(self, slots: UpdateSlots, updates: list, reduced: Any) -> Any:
        """The reduced sums themselves: they stand for the window."""
        del slots, updates
        return reduced

    def lift(self, acc: Any, layout: TermsLayout, like: Any = None) -> Any:
        """Per-device windows are plain stacked arrays: kept as they are."""
        del layout, like
        return acc

    def reduce(self, acc: Any, layout: TermsLayout) -> Any:
        del layout
        return acc
