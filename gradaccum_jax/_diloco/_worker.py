"""One worker's step: the inner step every call, each fragment's sync when due.

Written once for a worker that sees the others through a named axis
(``pmap``, ``shard_map``, or the stacked path's ``shard_map`` over the
workers' axis, see `_stacked`); the only collectives are the reduction's,
inside each fragment's `run_if`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _tree, _weights
from gradaccum_jax._control import run_if
from gradaccum_jax._diloco import _fragments
from gradaccum_jax._diloco._offload import to_device, to_host
from gradaccum_jax._diloco._state import DiLoCoState
from gradaccum_jax._diloco._sync import SyncCarry, SyncConfig, sync_fragment


class WorkerConfig(NamedTuple):
    """`diloco`'s configuration, as one worker's step reads it."""

    inner: optax.GradientTransformationExtraArgs
    outer: optax.GradientTransformation
    reduction: optax.GradientTransformation | None  # None: a single worker
    sync_every: int
    fragments: int
    fragment_axis: Any  # None, an axis, or a pytree prefix of the params
    keep_unsent: float = 0.0
    axis: Any = None  # the workers' axis; None: a single worker
    # The anchor and outer states kept in host memory (`_offload`).
    offload: bool = False


def inner_step(
    grads: Any,
    state: DiLoCoState,
    params: Any,
    weight: Any,
    extra_args: dict,
    config: WorkerConfig,
) -> tuple[Any, Any, jax.Array]:
    """The inner optimizer's step on this worker's gradients, no communication.

    Returns the updates, the inner state and the call's float32 weight. A
    call with weight 0 (a worker that saw no tokens) moves nothing and
    keeps the inner state, applied with a select: its gradients may be NaN,
    which would stay in Adam's moments for good.
    """
    if weight is not None:
        extra_args = {**extra_args, "weight": weight}
    updates, inner_state = config.inner.update(
        grads, state.inner_state, params, **extra_args
    )
    if weight is None:
        return updates, inner_state, jnp.ones([], jnp.float32)
    weight = _weights.scalar_weight(weight, "diloco")
    seen = weight != 0
    updates = jax.tree.map(lambda u: jnp.where(seen, u, _tree.zeros_like(u)), updates)
    inner_state = jax.tree.map(
        lambda new, old: jnp.where(seen, new, old), inner_state, state.inner_state
    )
    return updates, inner_state, weight


def worker_update(
    grads: Any,
    state: DiLoCoState,
    params: Any,
    weight: Any,
    extra_args: dict,
    config: WorkerConfig,
    layouts: list[Any] | None = None,
) -> tuple[Any, DiLoCoState]:
    """One call of `diloco`'s update on one worker.

    ``layouts``: per param leaf, its split over mesh axes its type does not
    show (the stacked workers' map), for the ``outer_reduction``; None
    where the types show it.
    """
    if config.offload:  # a state restored into device memory goes back
        state = state._replace(
            anchor=to_host(state.anchor),
            outer_states=to_host(state.outer_states),
            reduction_states=to_host(state.reduction_states),
        )
    updates, inner_state, weight = inner_step(
        grads, state, params, weight, extra_args, config
    )
    update_leaves, treedef = jax.tree.flatten(updates)
    param_leaves = jax.tree.leaves(params)
    anchor_leaves = jax.tree.leaves(state.anchor)
    fragments = _fragments.assign(params, config.fragments, config.fragment_axis)
    offsets = _fragments.sync_offsets(config.sync_every, config.fragments)
    cycle_weights = state.cycle_weights + weight
    outer_states, reduction_states = [], []
    for index, (fragment, offset) in enumerate(zip(fragments, offsets, strict=True)):
        carry = SyncCarry(
            _fragments.take(update_leaves, fragment),
            _fragments.take(anchor_leaves, fragment),
            state.outer_states[index],
            state.reduction_states[index],
            cycle_weights,
        )
        sync = functools.partial(
            _sync_pieces,
            params=_fragments.take(param_leaves, fragment),
            fragment=fragment,
            offload=config.offload,
            config=SyncConfig(
                config.outer,
                config.reduction,
                index,
                None if layouts is None else _fragments.take(layouts, fragment),
                config.keep_unsent,
                config.axis,
            ),
        )
        carry = run_if(state.cycle_step == offset, sync, carry)
        update_leaves = _fragments.put(update_leaves, fragment, carry.updates)
        anchor_leaves = _fragments.put(anchor_leaves, fragment, carry.anchor)
        outer_states.append(carry.outer_state)
        reduction_states.append(carry.reduction_state)
        cycle_weights = carry.cycle_weights
    new_state = DiLoCoState(
        cycle_step=(state.cycle_step + 1) % config.sync_every,
        inner_state=inner_state,
        anchor=jax.tree.unflatten(jax.tree.structure(state.anchor), anchor_leaves),
        outer_states=tuple(outer_states),
        reduction_states=tuple(reduction_states),
        cycle_weights=cycle_weights,
    )
    return jax.tree.unflatten(treedef, update_leaves), new_state


def _sync_pieces(
    carry: SyncCarry,
    params: list[Any],
    fragment: _fragments.Fragment,
    config: SyncConfig,
    offload: bool,
) -> SyncCarry:
    """`sync_fragment` on the fragment's pieces of the whole leaves carried.

    The loop of `run_if` carries the whole update and anchor leaves; the
    pieces are cut and pasted back inside it, so a sync of a block of
    layers writes those rows in place and a step that does not sync moves
    nothing. With ``offload`` the anchor's pieces and the fragment's outer
    states come from host memory and go back there: cut on the host, so
    only the fragment's rows travel.
    """
    here = to_device if offload else _same
    back = to_host if offload else _same
    synced = sync_fragment(
        carry._replace(
            updates=_fragments.cut(carry.updates, fragment),
            anchor=here(_fragments.cut(carry.anchor, fragment)),
            outer_state=here(carry.outer_state),
            reduction_state=here(carry.reduction_state),
        ),
        _fragments.cut(params, fragment),
        config,
    )
    return synced._replace(
        updates=_fragments.paste(carry.updates, fragment, synced.updates),
        anchor=_fragments.paste(carry.anchor, fragment, back(synced.anchor)),
        outer_state=back(synced.outer_state),
        reduction_state=back(synced.reduction_state),
    )


def _same(tree: Any) -> Any:
    return tree
