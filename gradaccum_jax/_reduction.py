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

    Attributes:
      init: ``init(params) -> state``, the reduction's own state (kept in
        ``MultiStepsState.reduction_state``; arrays that are the same on
        every device, so checkpointable); ``init(params, layout)`` with
        ``per_device``.
      reduce: ``reduce(terms, layout, state) -> (sums, state)``: ``terms`` is
        a pytree of per-device terms in ``layout`` (a `TermsLayout`:
        unreduced or stacked, see this module), ``sums`` the same tree summed
        over the devices, identical on every device. Called once per window,
        inside the emission loop; ``layout.reduce`` is the exact float sum,
        ``layout.over_terms`` runs a function of each device's own term that
        ends in collectives.
      reports_sq_excess: whether ``reduce`` returns ``(sums, state,
        sq_excess)``: a lossy reduction (random rounding, clipping) says by
        how much it changes the sums' squared norm, ``sq_excess`` being
        ``E|sums|^2 - |exact sums|^2`` over its random draws given the
        terms (for unbiased rounding, the sums' variance summed over every
        element), a float32 scalar, the same on every device. The window
        statistics see it (`WindowPosition.sum_sq_excess`): the noise
        scale subtracts it from the window's squared norm. False: the sums
        are exact.
      per_device: whether the state holds something per device (an
        error-feedback residual): ``init`` then also takes the
        `TermsLayout`, and builds each device's part stacked on a leading
        axis sharded over ``layout.axes`` (plain arrays, checkpointable),
        e.g. `gradaccum_jax.compressed_window_reduction`.
      place: ``place(state, layout, like) -> state`` for a ``per_device``
        state: its per-device parts split over the layout's axes (and like
        ``like``, the gradients or params, or None, over the others), a
        no-op where they are: a state restored from host arrays arrives
        unsplit, and the emission loop's carry must keep one type. None:
        nothing to place.
    """

    init: Callable[..., Any]
    reduce: Callable[[Any, TermsLayout, Any], tuple[Any, ...]]
    reports_sq_excess: bool = False
    per_device: bool = False
    place: Callable[[Any, TermsLayout, Any], Any] | None = None

    def placed_state(self, state: Any, layout: TermsLayout, like: Any = None) -> Any:
        """``state`` placed by `place` (as it is where there is none)."""
        return state if self.place is None else self.place(state, layout, like)

    def init_state(self, params: Any, layout: TermsLayout) -> Any:
        """`init`'s state, given the layout where ``per_device``."""
        return self.init(params, layout) if self.per_device else self.init(params)

    def reduce_window(
        self, terms: Any, layout: TermsLayout, state: Any
    ) -> tuple[Any, Any, jax.Array]:
        """``(sums, state, sq_excess)``: `reduce`'s, ``sq_excess`` 0 if exact."""
        if self.reports_sq_excess:
            return self.reduce(terms, layout, state)
        sums, state = self.reduce(terms, layout, state)
        return sums, state, jnp.zeros([], jnp.float32)


def float_window_reduction() -> WindowReduction:
    """The default `WindowReduction`: one exact float all-reduce."""
    return WindowReduction(
        init=lambda params: (),
        reduce=lambda terms, layout, state: (layout.reduce(terms), state),
    )
