"""The engine's configuration: its parts and the choices between them."""

from __future__ import annotations

from typing import NamedTuple

import optax

from gradaccum_jax._accumulation import _skip
from gradaccum_jax._accumulation._size_policy import AdaptiveSize, ScheduledSize
from gradaccum_jax._accumulation._store import DecodedWindow, SharedWindow
from gradaccum_jax._partials import TermsLayout, terms_layout
from gradaccum_jax._reduction import WindowReduction
from gradaccum_jax._statistic import WindowStatistic


class Parts(NamedTuple):
    """The engine's configuration: its parts and the choices between them.

    Attributes:
      opt: the inner optimizer (with extra-argument support).
      store: the window's storage (`SharedWindow` or `DecodedWindow`).
      reduction: the window's cross-device reduction.
      statistics: the window statistics (the noise scale first, if tracked).
      statistic_fields: for each statistic, the `MultiStepsState` field that
        holds its state: ``"noise"`` for the noise scale, ``"statistics"``
        for the user's (kept there as a tuple, in order).
      window_size: the window size policy.
      should_skip_update_fn: the skip function, or None.
      use_grad_mean: emit the window's mean (else its sum).
      count_skipped: a skipped micro-batch takes its place in the window.
      unreduced_axes: the mesh axes of per-device terms.
    """

    opt: optax.GradientTransformationExtraArgs
    store: SharedWindow | DecodedWindow
    reduction: WindowReduction
    statistics: tuple[WindowStatistic, ...]
    statistic_fields: tuple[str, ...]
    window_size: ScheduledSize | AdaptiveSize
    should_skip_update_fn: _skip.ShouldSkipUpdateFunction | None
    use_grad_mean: bool
    count_skipped: bool
    unreduced_axes: frozenset[str]

    def layout(self) -> TermsLayout:
        """Where per-device terms live on the current mesh: decided here."""
        return terms_layout(self.unreduced_axes)
