"""Which micro-batches the window takes: the skip function."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks


class ShouldSkipUpdateFunction(optax.ShouldSkipUpdateFunction, Protocol):
    """Decides whether a micro-batch is skipped: ``should_skip_update_fn=``.

    optax's protocol, with its signature:
    ``fn(updates, gradient_step, params) -> (skip, skip_state)``. ``updates``
    are the micro-batch's gradients, ``gradient_step`` the window count
    (`MultiStepsState.gradient_step`, e.g. for an annealed threshold) and
    ``params`` the current params (or None). ``skip`` is a boolean scalar
    array; ``skip_state`` any pytree, kept in `MultiStepsState.skip_state`
    for logging. `skip_not_finite` and `skip_large_updates` are two.
    """

    def __call__(
        self, updates: optax.Updates, gradient_step: jax.Array, params: Any
    ) -> tuple[jax.Array, Any]: ...


# The skip functions are optax's own: same signatures, same skip_state.
skip_not_finite = optax.skip_not_finite
skip_large_updates = optax.skip_large_updates


def skip_function(
    should_skip_update_fn: ShouldSkipUpdateFunction | None, skip_nonfinite: bool
) -> ShouldSkipUpdateFunction | None:
    """The skip function from the two ways of asking for one."""
    should_skip_update_fn = _checks.optional_callable(
        "should_skip_update_fn",
        should_skip_update_fn,
        "fn(updates, gradient_step, params) -> (skip, skip_state)",
    )
    if not _checks.boolean("skip_nonfinite", skip_nonfinite):
        return should_skip_update_fn
    if should_skip_update_fn is not None:
        raise ValueError(
            "`skip_nonfinite=True` is shorthand for "
            "`should_skip_update_fn=skip_not_finite`: pass one of them, not both "
            f"(got should_skip_update_fn={should_skip_update_fn!r})."
        )
    return skip_not_finite


def accepts(
    should_skip_update_fn: ShouldSkipUpdateFunction | None,
    grads: Any,
    gradient_step: jax.Array,
    params: Any,
    skip_state: Any,
) -> tuple[jax.Array, Any]:
    """``(accept, skip_state)`` of a micro-batch (True, unchanged without a fn)."""
    if should_skip_update_fn is None:
        return jnp.asarray(True), skip_state
    skip, skip_state = should_skip_update_fn(grads, gradient_step, params)
    skip = jnp.asarray(skip)
    if (skip.dtype, skip.shape) != (jnp.bool_, ()):
        raise ValueError(
            "`should_skip_update_fn` must return a boolean scalar array "
            f"first, got dtype {skip.dtype} and shape {skip.shape}."
        )
    return jnp.logical_not(skip), skip_state


def initial_skip_state(
    should_skip_update_fn: ShouldSkipUpdateFunction | None, params: Any
) -> Any:
    """What the skip function returns for zero gradients (``()`` without one)."""
    if should_skip_update_fn is None:
        return ()
    _, skip_state = should_skip_update_fn(
        optax.tree.zeros_like(params), jnp.zeros([], jnp.int32), params
    )
    return skip_state
