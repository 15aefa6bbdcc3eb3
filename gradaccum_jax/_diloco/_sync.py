"""One fragment's sync: the outer gradient, its mean over workers, the outer step.

Runs inside `_control.run_if` (once per cycle for each fragment); every
value it changes is in the carry, so the anchor and the outer state are
updated in place and a step that does not sync moves nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _weights
from gradaccum_jax._compression._error_feedback import take_residual
from gradaccum_jax._compression._random import with_own_streams


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
    # The part of its unsent outer gradient a worker keeps (`diloco`'s
    # ``keep_unsent``), and the workers' axis, over which the weights add up.
    keep_unsent: float = 0.0
    axis: Any = None


def sync_fragment(carry: SyncCarry, params: list[Any], config: SyncConfig) -> SyncCarry:
    """Steps the fragment's anchor and puts the worker on the new anchor.

    The outer gradient is ``anchor - local`` where ``local = params +
    updates`` is where the inner steps took this worker; it is averaged
    over the workers weighted by their cycle weights (a worker that saw
    nothing is left out, NaN included), the outer optimizer steps the
    anchor with it (in float32), and the returned updates take ``params``
    to the new anchor, less the part of what this worker did not send that
    it keeps (``keep_unsent``). A zero total weight leaves the anchor and
    the outer state as they are (the outer momentum would move it
    otherwise).
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
        # Where the leaves lie over Auto axes (read from the params'
        # Explicit types before the axes were made Auto), passed as optax
        # passes extra arguments: a codec codes each device's block.
        told = {} if config.layouts is None else {"leaf_layouts": [*config.layouts, ()]}
        means, reduction_state = config.reduction.update(
            [*outer_grads, presence], reduction_state, weight=weight, **told
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
    kept = [None] * len(params)
    if config.keep_unsent:
        kept, reduction_state = _unsent_kept(reduction_state, weight, moved, config)
    updates = [
        (wide(a) - wide(p) - (0.0 if k is None else k)).astype(jnp.result_type(p))
        for a, p, k in zip(new_anchor, params, kept, strict=True)
    ]
    return SyncCarry(
        updates,
        new_anchor,
        outer_state,
        reduction_state,
        carry.cycle_weights.at[config.fragment].set(0.0),
    )


def _unsent_kept(
    reduction_state: Any, weight: jax.Array, moved: jax.Array, config: SyncConfig
) -> tuple[list[Any], Any]:
    """``keep_unsent`` of this worker's unsent outer gradient, per leaf
    (None where the reduction keeps no residual), and the reduction's
    state keeping the rest for the next sync.

    The residual is in units of the worker's share of the mean (its weight
    over the total); divided by the share it is in the outer gradient's.
    A worker that saw nothing (share 0) and a sync that left the anchor
    where it was keep nothing: their residual stays whole.
    """
    share, _ = _weights.share(weight, jax.lax.psum(weight, config.axis))
    taken, reduction_state = take_residual(
        reduction_state, jnp.where(moved & (share > 0), config.keep_unsent, 0.0)
    )
    per_share, _ = _weights.share(jnp.float32(1.0), share)  # 0 for a share of 0
    # The last leaf is the presence weight, which no codec compresses.
    return [None if t is None else t * per_share for t in taken[:-1]], reduction_state


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
