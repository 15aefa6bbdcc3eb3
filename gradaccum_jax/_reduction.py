"""How the engine sums a window of per-device terms: `WindowReduction`.

The window's only cross-device traffic with ``unreduced_axes`` is its
reduction, once per window. The default is the exact float sum (one fused
all-reduce, `float_window_reduction`); a lossy reduction such as
`gradaccum_jax.ternary_window_reduction` sends something smaller and says
by how much its rounding changes the sums' squared norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._partials import TermsLayout


class WindowReduction(NamedTuple):
    """How the engine sums a window of per-device terms at its emission.

    One signature for every reduction: no flag changes what a function
    takes or returns.

    Attributes:
      init: ``init(params, layout) -> state``, the reduction's own state
        (kept in ``MultiStepsState.reduction_state``), given the window's
        `TermsLayout`: arrays the same on every device, or each device's
        part stacked on a leading axis sharded over ``layout.axes`` (an
        error-feedback residual, `gradaccum_jax.compressed_window_reduction`):
        plain arrays either way, checkpointable.
      reduce: ``reduce(terms, layout, state) -> (sums, state, sq_excess)``:
        ``terms`` is a pytree of per-device terms in ``layout`` (unreduced
        or stacked), ``sums`` the same tree summed over the devices,
        identical on every device. Called once per window, inside the
        emission loop; ``layout.reduce`` is the exact float sum,
        ``layout.over_terms`` runs a function of each device's own term that
        ends in collectives. ``sq_excess``, a float32 scalar the same on
        every device, says by how much the reduction changes the sums'
        squared norm, ``E|sums|^2 - |exact sums|^2`` over its random draws
        given the terms (for unbiased rounding, the sums' variance summed
        over every element); 0 for an exact sum. The window statistics see
        it (`WindowPosition.sum_sq_excess`): the noise scale subtracts it
        from the window's squared norm.
      place: ``place(state, layout, like) -> state``: the state's per-device
        parts split over the layout's axes (and like ``like``, the
        gradients or params, or None, over the others), a no-op where they
        are: a state restored from host arrays arrives unsplit, and the
        emission loop's carry must keep one type. None: nothing to place.
    """

    init: Callable[[Any, TermsLayout], Any]
    reduce: Callable[[Any, TermsLayout, Any], tuple[Any, Any, jax.Array]]
    place: Callable[[Any, TermsLayout, Any], Any] | None = None

    def placed_state(self, state: Any, layout: TermsLayout, like: Any = None) -> Any:
        """``state`` placed by `place` (as it is where there is none)."""
        return state if self.place is None else self.place(state, layout, like)


def exact(sums: Any, state: Any) -> tuple[Any, Any, jax.Array]:
    """``reduce``'s result for sums that are exact: no squared-norm excess."""
    return sums, state, jnp.zeros([], jnp.float32)


def float_window_reduction() -> WindowReduction:
    """The default `WindowReduction`: one exact float all-reduce."""
    return WindowReduction(
        init=lambda params, layout: (),
        reduce=lambda terms, layout, state: exact(layout.reduce(terms), state),
    )
