"""`diloco`'s update on workers stacked on a mesh axis, under ``jax.jit``.

The workers' params, gradients and states are stacked on a leading axis
sharded over the workers' mesh axis (see `_stacked`). Each worker's step
runs where the workers see each other through the axis name, exactly as
under ``pmap``: one code path (`_worker.worker_update`) for the three
data-parallel layouts.

The name is bound by a ``jax.vmap`` over the workers (``spmd_axis_name``),
with every Explicit mesh axis made Auto for the step
(``jax.sharding.auto_axes``; the results get the inputs' types back). The
params' split over other axes (tensor parallelism over ``model``, HSDP
over ``fsdp``) is kept: nothing is gathered. Auto, because on jax 0.10.2 a
``psum`` over a vmapped axis of an operand with an Explicit split fails to
type its result (its positional reduction keeps the operand's spec), as
the default mean's does. A ``shard_map`` manual over the workers' axis
alone would keep the Explicit types, but its boundary gathers every input
split over another Explicit axis (its ``in_shardings`` name the manual
axis only): the params and states, whole, on every call.

A user's ``outer_reduction`` thus sees whole leaves on Auto axes. A codec
there would reshape them whole (packing its codes) and XLA would move the
codes over ``model`` to lay the reshape out; so the split each leaf had
before the map is handed to the sync (``layouts=``), and a codec codes
each device's block where it lies (`gradaccum_jax._codecs._auto_blocks`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree
from gradaccum_jax._diloco._stacked import check_stacked, first_row
from gradaccum_jax._placement import (
    constrained,
    explicit_axes,
    is_explicit,
    rows_split,
    rows_split_like,
)


def run_stacked(
    worker_fn: Callable[..., tuple[Any, Any]],
    axis_name: str,
    grads: Any,
    state: Any,
    params: Any,
    weight: Any,
    worker_state: Any,
) -> tuple[Any, Any]:
    """Runs ``worker_fn(grads, state, params, weight)`` once per stacked worker.

    ``grads``, ``state`` (a `DiLoCoState`) and ``params`` have a leading
    workers axis of the size of mesh axis ``axis_name``; ``weight`` is None,
    a scalar (the same for every worker) or one per worker (shape
    ``(n,)``). The results come back stacked the same way.
    ``worker_state`` (`state_layout` of one worker's ``init``) says how a
    state restored from host arrays is laid out over the other mesh axes.
    ``worker_fn`` also gets ``layouts=``: per param leaf, its split over the
    other mesh axes, which the map leaves to the compiler (see the module's
    docstring).
    """
    check_stacked(params, axis_name, "diloco")
    per_worker_weight = weight is not None and np.ndim(weight) != 0
    # Rows not yet laid out over the workers (restored from host arrays, a
    # weight vector made on the host) are split here, and over the other
    # axes as the params and `init` lay them out; those already split move
    # nothing.
    params = jax.tree.map(functools.partial(rows_split, axis=axis_name), params)
    if is_explicit(axis_name):  # on Auto axes the compiler lays them out
        grads = _split_like(grads, params, axis_name)
        state = _split_like(state, worker_state, axis_name)
    if per_worker_weight:
        weight = rows_split(jnp.asarray(weight), axis_name)
    return _mapped(worker_fn, axis_name, grads, state, params, weight)


def _mapped(worker_fn, axis_name, grads, state, params, weight):
    """`run_stacked` as a ``vmap`` over the workers, Explicit axes made Auto."""
    per_worker_weight = weight is not None and np.ndim(weight) != 0
    # The workers are at the same step of the cycle: shared (not mapped),
    # the syncs' loops test one scalar, as under pmap. Each device reads
    # its own row (a slice of row 0 would broadcast it on Auto axes).
    # Unchecked: the rows are equal, which JAX's types cannot know, so a
    # checked map would refuse a row typed varying as the P() output.
    step = jax.shard_map(
        first_row,
        in_specs=P(axis_name),
        out_specs=P(),
        axis_names={axis_name},
        check_vma=False,
    )(state.cycle_step)

    # Read before the map makes the Explicit axes Auto: each leaf's split
    # over the other axes, for a codec that codes each device's block.
    # On an Auto mesh the types do not say it: None, and a codec's state
    # says how `init` saw the params split (`_codecs._auto_blocks`).
    layouts = (
        [tuple(_tree.partitions(leaf)[1:]) for leaf in jax.tree.leaves(params)]
        if explicit_axes()
        else None
    )

    def one_worker(grads, state, params, weight, step):
        updates, state = worker_fn(
            grads, state._replace(cycle_step=step), params, weight, layouts=layouts
        )
        return updates, state._replace(cycle_step=None), state.cycle_step

    mapped = jax.vmap(
        one_worker,
        in_axes=(0, 0, 0, 0 if per_worker_weight else None, None),
        out_axes=(0, 0, None),
        axis_name=axis_name,
        spmd_axis_name=axis_name,
    )
    args = (grads, state._replace(cycle_step=None), params, weight, step)
    if explicit_axes():
        like = (params, args[1], step)
        mapped = jax.sharding.auto_axes(
            mapped,
            axes=explicit_axes(),
            out_sharding=jax.tree.map(lambda leaf: jax.typeof(leaf).sharding, like),
        )
    updates, new_state, step = mapped(*args)
    return updates, new_state._replace(cycle_step=_stacked_step(step, axis_name))


def _stacked_step(step: jax.Array, axis_name: str) -> jax.Array:
    """The shared cycle step, one per worker again (no data moves)."""
    workers = jax.sharding.get_abstract_mesh().shape[axis_name]
    return constrained(jnp.broadcast_to(step, (workers,)), P(axis_name))


def _split_like(tree: Any, like: Any, axis_name: str) -> Any:
    """`rows_split_like` over ``tree``, each leaf like ``like``'s rows
    (``tree`` as is where the structures differ: the caller's checks say
    how)."""
    if jax.tree.structure(tree) != jax.tree.structure(like):
        return jax.tree.map(functools.partial(rows_split, axis=axis_name), tree)
    return jax.tree.map(
        lambda leaf, row: rows_split_like(leaf, axis_name, row), tree, like
    )


def state_layout(init_fn: Callable[[Any], Any], stacked_params: Any) -> Any:
    """One worker's state as ``init_fn`` lays it out for one row of the
    stacked params (shapes and shardings only, nothing computed)."""

    def row(leaf):
        spec = P(*_tree.partitions(leaf)[1:])
        sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), spec)
        return jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], leaf.dtype, sharding=sharding)

    return jax.eval_shape(init_fn, jax.tree.map(row, stacked_params))
