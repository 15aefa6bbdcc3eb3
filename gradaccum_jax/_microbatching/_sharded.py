"""One step laid out over a mesh's data axis: device-local scans, one reduction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _per_device, _placement
from gradaccum_jax._microbatching._layout import DataLayout, ShardedParams
from gradaccum_jax._microbatching._scan import weighted_means
from gradaccum_jax._tree import reduce_unreduced, stacked_as_unreduced


def over_data_axis(local_sums, layout, params, batch, args, kwargs):
    """Runs the micro-batch scan per device over ``layout.axis`` and reduces
    the sums once after it (one fused all-reduce).

    Mapped over the data axis only (`_per_device.over_axis`), so that the
    other mesh axes stay in the types: a tensor-parallel param keeps its
    split and is never gathered. Leaves gathered in every micro-batch
    (``gather_params_once=False``) need the collectives of a manual
    ``shard_map`` (`_over_data_axis_manual`).
    """
    if any(dim is not None for dim in jax.tree.leaves(layout.gather_dims)):
        return _over_data_axis_manual(local_sums, layout, params, batch, args, kwargs)
    dynamic, rebuild = _dynamic_leaves((args, kwargs))
    axis = layout.axis
    inputs = params
    if layout.explicit:
        # Leaves sharded over the axis are gathered once, here (the FSDP
        # gather the plain step does too).
        inputs = jax.tree.map(lambda p: _gathered(p, axis), params)
        dynamic = [_gathered(jnp.asarray(leaf), axis) for leaf in dynamic]
    (rows,), (row_axes,) = _per_device.stacked_arguments(
        (batch,), axis, "microbatched_value_and_grad"
    )
    static = []

    def device_sums(params, rows, dynamic):
        args, kwargs = rebuild(dynamic)
        sums = local_sums(params, rows, args, kwargs, ShardedParams(layout, False))
        static.append(sums._replace(value=None, grads=None, weight=None))
        return sums.value, sums.grads, sums.weight

    stacked = _per_device.over_axis(device_sums, axis, (None, row_axes, None))(
        inputs, rows, dynamic
    )
    value, grads, total = _summed(stacked, layout)
    value, grads = weighted_means(
        static[0]._replace(value=value, grads=grads, weight=total)
    )
    if layout.unreduced:
        # Each device's row of the stack is its term (a local retyping).
        return value, stacked_as_unreduced(grads, axis)
    if layout.explicit:
        grads = _with_param_shardings(grads, params)
    return value, grads


def _summed(stacked: Any, layout: DataLayout) -> tuple[Any, Any, Any]:
    """The devices' ``(value, grads, weight)`` sums, stacked on a leading
    axis, summed over it; the gradients left stacked if asked unreduced.

    On an Explicit axis each device's row becomes its unreduced term, and
    the sums all cross devices in one fused all-reduce, each keeping its
    other partitions (a tensor-parallel split).
    """
    value, grads, total = stacked
    if not layout.explicit:
        summed = jax.tree.map(lambda x: jnp.sum(x, axis=0), (value, total, grads))
        value, total, reduced = summed
    else:
        terms = stacked_as_unreduced(
            (value, total, None if layout.unreduced else grads), layout.axis
        )
        value, total, reduced = reduce_unreduced(terms)
    return value, grads if layout.unreduced else reduced, total


def _over_data_axis_manual(local_sums, layout, params, batch, args, kwargs):
    """`over_data_axis` in a ``shard_map`` manual over the data axis, for
    leaves gathered in every micro-batch (an all-gather before the loss, a
    reduce-scatter of the gradient, per micro-batch)."""
    dynamic, rebuild = _dynamic_leaves((args, kwargs))
    axis = layout.axis
    is_leaf = lambda x: x is None  # noqa: E731 (gather_dims holds Nones)

    def device_step(params, batch, dynamic):
        args, kwargs = rebuild(dynamic)
        shard = ShardedParams(layout)
        sums = local_sums(params, batch, args, kwargs, shard)
        acc_value, acc_grads, total = sums.value, sums.grads, sums.weight
        whole = jax.tree.map(
            lambda g, dim: g if dim is None else None,
            acc_grads,
            layout.gather_dims,
            is_leaf=is_leaf,
        )
        if layout.unreduced:
            acc_value, total = jax.lax.psum((acc_value, total), axis)
        else:
            acc_value, whole, total = jax.lax.psum((acc_value, whole, total), axis)
        acc_grads = jax.tree.map(
            lambda reduced, g, dim: g if dim is not None else reduced,
            whole,
            acc_grads,
            layout.gather_dims,
            is_leaf=is_leaf,
        )
        value, grads = weighted_means(
            sums._replace(value=acc_value, grads=acc_grads, weight=total)
        )
        if layout.unreduced:
            # Each device's term, stacked along a new leading axis sharded
            # over the data axis; `stacked_as_unreduced` retypes the stack.
            grads = jax.tree.map(
                lambda g, dim: g if dim is not None else g[None],
                grads,
                layout.gather_dims,
                is_leaf=is_leaf,
            )
        return value, grads

    def grad_spec(dim: int | None) -> P:
        if dim is None and layout.unreduced:
            return P(axis)
        return layout.param_spec(dim)

    if layout.explicit:
        # Explicit shard_map does not reshard its inputs: gather the leaves
        # that enter the scan whole here, once per step, and split the batch
        # over the axis if it is not already (keeping the other axes that
        # split its rows: a multi-slice batch stays split over ``data``
        # inside each ``dcn`` slice, no row crosses the slices).
        inputs = jax.tree.map(
            lambda p, dim: p if dim is not None else _gathered(p, axis),
            params,
            layout.gather_dims,
        )
        batch = jax.tree.map(lambda leaf: _placement.rows_split(leaf, axis), batch)
        dynamic = [_gathered(jnp.asarray(leaf), axis) for leaf in dynamic]
    else:
        inputs = params
    param_specs = jax.tree.map(layout.param_spec, layout.gather_dims, is_leaf=is_leaf)
    grad_specs = jax.tree.map(grad_spec, layout.gather_dims, is_leaf=is_leaf)
    value, grads = jax.shard_map(
        device_step,
        in_specs=(param_specs, P(axis), P()),
        out_specs=(P(), grad_specs),
        axis_names={axis},
    )(inputs, batch, dynamic)
    return value, _final_grads(grads, params, layout)


def _final_grads(grads: Any, params: Any, layout: DataLayout) -> Any:
    """The step's gradients, as they leave the ``shard_map``, in their final
    type: unreduced ones from their per-device stack; on an Explicit mesh,
    reduced ones with their parameter's sharding."""
    if layout.unreduced:
        return jax.tree.map(
            lambda g, dim: (
                g if dim is not None else stacked_as_unreduced(g, layout.axis)
            ),
            grads,
            layout.gather_dims,
            is_leaf=lambda x: x is None,
        )
    if layout.explicit:
        return _with_param_shardings(grads, params)
    return grads


def _with_param_shardings(grads: Any, params: Any) -> Any:
    """Gradients of parameters sharded over the axis but gathered once
    come out replicated: they get the parameter's sharding back (a local
    slice, no communication)."""
    return jax.tree.map(
        lambda g, p: _placement.placed(g, jax.typeof(p).sharding.spec), grads, params
    )


def _gathered(leaf: jax.Array, axis: str) -> jax.Array:
    """``leaf`` resharded to be whole along ``axis`` (other axes kept)."""
    spec = jax.typeof(leaf).sharding.spec
    whole = P(*(_placement.without_axis(entry, axis) for entry in spec))
    return leaf if whole == spec else jax.sharding.reshard(leaf, whole)


def _dynamic_leaves(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Splits ``tree`` into its array leaves and a function rebuilding it.

    Arrays cross the ``shard_map`` boundary (replicated); other leaves
    (Python flags, strings) are closed over, as ``jax.jit`` would see them.
    """
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

    def rebuild(dynamic: list[Any]) -> Any:
        arrays = iter(dynamic)
        merged = [
            next(arrays) if a else leaf
            for a, leaf in zip(is_array, leaves, strict=True)
        ]
        return jax.tree.unflatten(treedef, merged)

    return [leaf for a, leaf in zip(is_array, leaves, strict=True) if a], rebuild
