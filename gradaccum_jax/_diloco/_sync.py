"""One fragment's sync: the outer gradient, its mean over workers, the outer step.

Runs inside `_control.run_if` (once per cycle for each fragment); every
value it changes is in the carry, so the anchor and the outer state are
updated in place and a step that does not sync moves nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._codecs._auto_blocks import leaf_layouts
from gradaccum_jax._codecs._protocol import with_own_streams


def wide(leaf: jax.Array) -> jax.Array:
    """``leaf`` in at least float32: the outer step's arithmetic."""
    return leaf.astype(jnp.promote_types(jnp.result_type(leaf), jnp.float32))


class SyncCarry(NamedTuple):
    """What a fragment's sync reads and writes (the `run_if` carry).

    Attributes:
      updates: the fragment's update leaves (the inner step's; after the
        sync, those that take the params to the new anchor).
      anchor: the fragment's anchor leaves.
      outer_state: the fragment's outer optimizer state.
      reduction_state: the fragment's ``outer_reduction`` state.
      cycle_weights: every fragment's weight since its last sync.
    """

    updates: list[Any]
    anchor: list[Any]
    outer_state: Any
    reduction_state: Any
    cycle_weights: jax.Array


class SyncConfig(NamedTuple):
    """The parts of `diloco`'s configuration a sync needs."""

    outer: optax.GradientTransformation
    reduction: optax.GradientTransformation | None  # None: a single worker
    fragment: int  # the fragment's index in ``cycle_weights``
    # Per leaf of the fragment, its split over Auto mesh axes; None: not
    # known (shown by the types, or an Auto mesh's, the compiler's).
    layouts: list[Any] | None = None


def sync_fragment(carry: SyncCarry, params: list[Any], config: SyncConfig) -> SyncCarry:
    """Steps the fragment's anchor and puts the worker on the new anchor.

    The outer gradient is ``anchor - local`` where ``local = params +
    updates`` is where the inner steps took this worker; it is averaged
    over the workers weighted by their cycle weights (a worker that saw
    nothing is left out, NaN included), the outer optimizer steps the
    anchor with it (in float32), and the returned updates take ``params``
    to the new anchor. A zero total weight leaves the anchor and the outer
    state as they are (the outer momentum would move it otherwise).
    """
    weight = carry.cycle_weights[config.fragment]
    local = [
        (wide(p) + wide(u)).astype(jnp.result_type(p))
        for p, u in zip(params, carry.updates, strict=True)
    ]
    outer_grads = [wide(a) - wide(x) for a, x in zip(carry.anchor, local, strict=True)]
    reduction_state = carry.reduction_state
    if config.reduction is None:
        moved = weight != 0
    else:
        # One more scalar leaf, 1 on every worker: its weighted mean is 1
        # when any worker saw anything and 0 when the total weight is 0, so
        # the same reduction says whether the anchor moves (no second
        # collective for the total).
        presence = jnp.ones([], jnp.float32)
        said = (
            contextlib.nullcontext()
            if config.layouts is None
            else leaf_layouts([*config.layouts, ()])
        )
        with said:
            means, reduction_state = config.reduction.update(
                [*outer_grads, presence], reduction_state, weight=weight
            )
        *outer_grads, presence = means
        moved = presence != 0
    anchor = [wide(a) for a in carry.anchor]
    steps, outer_state = config.outer.update(outer_grads, carry.outer_state, anchor)
    new_anchor = [
        jnp.where(moved, a + s, a).astype(jnp.result_type(old))
        for a, s, old in zip(anchor, steps, carry.anchor, strict=True)
    ]
    outer_state = jax.tree.map(
        lambda new, old: jnp.where(moved, new, old), outer_state, carry.outer_state
    )
    updates = [
        (wide(a) - wide(p)).astype(jnp.result_type(p))
        for a, p in zip(new_anchor, params, strict=True)
    ]
    return SyncCarry(
        updates,
        new_anchor,
        outer_state,
        reduction_state,
        carry.cycle_weights.at[config.fragment].set(0.0),
    )


def reduction_init(
    reduction: optax.GradientTransformation | None, fragment: list[Any], index: int
) -> Any:
    """The reduction's state over fragment ``index``'s float32 leaves and the
    presence leaf; a reduction's random streams (any state node with a
    ``with_own_stream`` method) are the fragment's own."""
    if reduction is None:
        return optax.EmptyState()
    state = reduction.init([*fragment, jnp.ones([], jnp.float32)])
    # Fragment 0 keeps the seed as given: with one fragment, the state is
    # the reduction's own.
    return with_own_streams(state, index) if index else state
