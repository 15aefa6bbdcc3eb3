"""The window's storage as the engine sees it: a `WindowStore`.

A store holds the `WindowAccumulator` and says what the emission does with
its window. Two kinds:

* `SharedWindow` (a float window: `float_accumulator`, whole or as
  per-device terms): the reduction sums the window's own leaves (those not
  holding an update, see `_accumulation._inner_step.UpdateSlots`), and the
  inner optimizer reads the window's ``total``. Whole, the window's buffers
  then hold the updates.
* `DecodedWindow` (a `per_device_accumulator`: each device keeps its own
  window, e.g. ternary codes): each device decodes its window into its float
  term of the sum first (``total``), the reduction sums those terms, and
  the inner optimizer reads the sums.

`window_store` picks one from the accumulator's arguments, once; the engine
calls the `WindowStore` methods and never asks which kind it holds. A new
kind of storage is a new `WindowStore`.

The emission hands a store its window in two parts, the leaves that hold
the updates and the rest; ``whole(rest)`` puts a window back together from
the update leaves and a rest (reduced or not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks
from gradaccum_jax._partials import TermsLayout
from gradaccum_jax._window._accumulator import WindowAccumulator, float_accumulator
from gradaccum_jax._window._per_device import per_device_accumulator

Whole = Callable[[Any], Any]


class WindowStore:
    """How the engine reads, reduces and restores a window's storage.

    Attributes:
      accumulator: the `WindowAccumulator` that adds to the window.
      keeps_terms: whether the window's leaves are per-device terms of the
        layout (else each device's own window, or whole values).
    """

    keeps_terms = False

    def __init__(self, accumulator: WindowAccumulator):
        self.accumulator = accumulator

    def reduction_terms(self, whole: Whole, rest: list[Any]) -> Any:
        """What the cross-device reduction sums at the emission."""
        raise NotImplementedError

    def window_sum(self, whole: Whole, reduced: Any) -> Any:
        """The window's reduced weighted sum, from what the reduction returned."""
        raise NotImplementedError

    def lift(self, acc: Any, layout: TermsLayout, like: Any = None) -> Any:
        """A reduced window (a checkpoint's `reduce_window`) as terms again."""
        raise NotImplementedError

    def reduce(self, acc: Any, layout: TermsLayout) -> Any:
        """The window summed over devices (for `reduce_window`)."""
        raise NotImplementedError

    def stored(self, acc: Any, layout: TermsLayout) -> Any:
        """The window as the state keeps it between jitted calls."""
        raise NotImplementedError

    def loaded(self, acc: Any, layout: TermsLayout) -> Any:
        """A window `stored` keeps, as the step works on it."""
        raise NotImplementedError

    def rows_total(self, acc: Any, layout: TermsLayout, devices: int) -> Any:
        """A stored window of ``devices`` devices (another mesh's), whole."""
        raise NotImplementedError


class SharedWindow(WindowStore):
    """A window whose leaves the reduction sums and the updates may reuse."""

    keeps_terms = True

    def reduction_terms(self, whole: Whole, rest: list[Any]) -> Any:
        """The leaves holding no update.

        Per-device terms never hold an update (an update is a reduced value),
        so with ``unreduced_axes`` that is the whole window.
        """
        del whole
        return rest

    def window_sum(self, whole: Whole, reduced: Any) -> Any:
        """The total of the window made of the update leaves and the reduced rest."""
        return self.accumulator.total(whole(reduced))

    def lift(self, acc: Any, layout: TermsLayout, like: Any = None) -> Any:
        """Placed like ``like`` (the gradients or params) first: a window
        restored from host arrays has lost its params' split (a
        tensor-parallel ``model`` axis), which the gradients it is added to
        have."""
        if like is not None and jax.tree.structure(like) == jax.tree.structure(acc):
            acc = jax.tree.map(layout.placed_like, acc, like)
        return jax.tree.map(layout.lift, acc)

    def reduce(self, acc: Any, layout: TermsLayout) -> Any:
        return layout.reduce(acc)

    def stored(self, acc: Any, layout: TermsLayout) -> Any:
        return jax.tree.map(layout.stored, acc)

    def loaded(self, acc: Any, layout: TermsLayout) -> Any:
        return jax.tree.map(layout.loaded, acc)

    def rows_total(self, acc: Any, layout: TermsLayout, devices: int) -> Any:
        for path, leaf in jax.tree_util.tree_leaves_with_path(acc):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % devices:
                raise ValueError(
                    f"state.acc_grads{jax.tree_util.keystr(path)} (shape "
                    f"{jnp.shape(leaf)}) is not the rows of {devices} devices "
                    "that the state's acc_weight says it holds: pass the "
                    "state `init` or `update` returned (or `reduce_window`'s)."
                )
        return jax.tree.map(lambda leaf: layout.rows_total(leaf, devices), acc)


class DecodedWindow(WindowStore):
    """A per-device window, decoded on each device before the reduction."""

    def reduction_terms(self, whole: Whole, rest: list[Any]) -> Any:
        """Each device's float term of the window's sum (its window decoded)."""
        return self.accumulator.total(whole(rest))

    def window_sum(self, whole: Whole, reduced: Any) -> Any:
        """The reduced sums themselves: they stand for the window."""
        del whole
        return reduced

    def lift(self, acc: Any, layout: TermsLayout, like: Any = None) -> Any:
        """Per-device windows are plain stacked arrays: kept as they are."""
        del layout, like
        return acc

    def reduce(self, acc: Any, layout: TermsLayout) -> Any:
        del layout
        return acc

    # Per-device windows are plain stacked arrays across calls too.

    def stored(self, acc: Any, layout: TermsLayout) -> Any:
        del layout
        return acc

    def loaded(self, acc: Any, layout: TermsLayout) -> Any:
        del layout
        return acc

    def rows_total(self, acc: Any, layout: TermsLayout, devices: int) -> Any:
        path, _ = jax.tree_util.tree_leaves_with_path(acc)[0]
        raise ValueError(
            f"state.acc_grads{jax.tree_util.keystr(path)} holds the windows of "
            f"{devices} devices, each device's own (a per-device "
            "`window_accumulator`, as ternary_accumulate's), which cannot be "
            f"summed on the {layout.device_count()} devices of mesh axes "
            f"{sorted(layout.axes)}: restore the state on a mesh with "
            f"{devices} devices there."
        )


def window_store(
    accumulator_dtype: Any,
    window_accumulator: WindowAccumulator | None,
    unreduced_axes: frozenset[str],
) -> WindowStore:
    """The window's storage for an accumulator's arguments, validated.

    A float window of ``accumulator_dtype`` by default; ``window_accumulator``
    as it is without ``unreduced_axes``, and run by each device on its own
    window with them (it adds whole gradients, not per-device terms).
    """
    accumulator_dtype = _checks.float_dtype("accumulator_dtype", accumulator_dtype)
    if window_accumulator is None:
        return SharedWindow(float_accumulator(accumulator_dtype, unreduced_axes))
    if not isinstance(window_accumulator, WindowAccumulator):
        raise ValueError(
            "`window_accumulator` must be None or a WindowAccumulator, "
            f"got {window_accumulator!r}."
        )
    if not unreduced_axes:
        return SharedWindow(window_accumulator)
    if len(unreduced_axes) != 1:
        raise ValueError(
            "`unreduced_axes` with a `window_accumulator` takes one mesh "
            "axis (each device's window is stacked on a leading axis "
            f"sharded over it), got {sorted(unreduced_axes)}."
        )
    return DecodedWindow(per_device_accumulator(window_accumulator, unreduced_axes))
