"""`AccumulationTransformation`: an accumulation as an optax transformation."""

from __future__ import annotations

from typing import Any

import jax
import optax

from gradaccum_jax._accumulation._state import AccumulationStats, MultiStepsState

# What the transformation forwards to its engine.
_ENGINE_METHODS = (
    "init",
    "update",
    "flush",
    "reset",
    "stats",
    "has_updated",
    "reduce_window",
)


class AccumulationTransformation(optax.GradientTransformationExtraArgs):
    """An accumulating transformation: ``(init, update)`` plus window controls.

    Returned by `accumulate`, `gradaccum_jax.ternary_accumulate` and
    `MultiSteps.gradient_transformation`. It is an
    `optax.GradientTransformationExtraArgs`, so it goes into `optax.chain`
    and receives ``weight=``; its methods act on its own state (for a chain,
    the element of the chain's state tuple that belongs to it) exactly as
    the `MultiSteps` methods of the same names.

    Args:
      engine: the `MultiSteps` whose window this is; ``init`` and
        ``update`` are its methods.
    """

    # No `__slots__ = ()`: a NamedTuple subclass cannot add a field, so the
    # engine lives in the instance's `__dict__`, beside the two fields optax
    # reads (``init, update = tx`` and `optax.chain` see a 2-tuple).

    def __new__(cls, engine: Any, *unexpected: Any) -> AccumulationTransformation:
        if unexpected:
            raise ValueError(
                "AccumulationTransformation takes one argument, its engine (a "
                "gradaccum_jax.MultiSteps), not optax's (init, update): build "
                "one with MultiSteps(...).gradient_transformation() or accumulate"
            )
        missing = [m for m in _ENGINE_METHODS if not callable(getattr(engine, m, None))]
        if missing:
            raise ValueError(
                "AccumulationTransformation: engine must be a "
                f"gradaccum_jax.MultiSteps; got {type(engine).__name__}, which "
                f"has no {', '.join(missing)}"
            )
        return cls._with_engine(engine.init, engine.update, engine)

    @classmethod
    def _with_engine(cls, init, update, engine: Any) -> AccumulationTransformation:
        tx = tuple.__new__(cls, (init, update))
        tx.__dict__["_engine_ref"] = engine
        return tx

    def __reduce__(self):
        # `copy` would otherwise rebuild through `__new__` from the two
        # fields, which is not its signature.
        return _rebuild, (self.init, self.update, self._engine)

    @property
    def _engine(self) -> Any:
        """The `MultiSteps` this transformation was built from."""
        engine = self.__dict__.get("_engine_ref")
        if engine is None:
            # Only a construction that bypasses `__new__` (NamedTuple's
            # `_make`, `tuple.__new__`) gets here.
            raise ValueError(
                "this AccumulationTransformation was built without its engine; "
                "build one with AccumulationTransformation(multi_steps), "
                "MultiSteps(...).gradient_transformation() or accumulate"
            )
        return engine

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


def _rebuild(init, update, engine) -> AccumulationTransformation:
    return AccumulationTransformation._with_engine(init, update, engine)


def _flatten_with_keys(tx: AccumulationTransformation):
    return (
        (jax.tree_util.GetAttrKey("init"), tx.init),
        (jax.tree_util.GetAttrKey("update"), tx.update),
    ), tx._engine


def _unflatten(engine, children) -> AccumulationTransformation:
    init, update = children
    return AccumulationTransformation._with_engine(init, update, engine)


# A registered node rather than NamedTuple's: unflattening (`jax.tree.map`
# over a transformation) must keep the engine, and NamedTuple's rebuilds
# through `__new__` from the two fields. Leaves and key paths stay
# NamedTuple's: ``init`` and ``update``.
jax.tree_util.register_pytree_with_keys(
    AccumulationTransformation,
    _flatten_with_keys,
    _unflatten,
    flatten_func=lambda tx: ((tx.init, tx.update), tx._engine),
)
