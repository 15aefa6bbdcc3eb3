"""`AccumulationTransformation`: an accumulation as an optax transformation."""

from __future__ import annotations

from typing import Any

import jax
import optax

from gradaccum_jax._accumulation._state import AccumulationStats, MultiStepsState


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
    def _engine(self) -> Any:
        """The `MultiSteps` whose ``update`` this is."""
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
