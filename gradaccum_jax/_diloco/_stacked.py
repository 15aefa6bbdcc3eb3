"""DiLoCo under ``jax.jit`` over a mesh: workers stacked on a leading axis.

Between syncs every worker's parameters and inner state differ, so under
``jax.jit`` they are held stacked on a leading axis of size ``n`` (the
workers' mesh axis size), sharded over that axis: device (group) ``d``
holds worker ``d``'s row, as in MaxText's DiLoCo. Each worker's step runs
in a ``jax.shard_map`` manual over that axis alone, where the workers see
each other through the axis name exactly as under ``pmap``: one code path
for the three data-parallel layouts. Other mesh axes (a ``model`` axis of
tensor-parallel params) stay the compiler's.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _checks, _tree
from gradaccum_jax._diloco._state import DiLoCoState
from gradaccum_jax._placement import (
    is_explicit,
    rows_split,
    rows_split_like,
    split_arguments,
)


def _workers_axis(axis_name: Any, caller: str) -> int:
    """The size of mesh axis ``axis_name`` of the current mesh, checked."""
    mesh = jax.sharding.get_abstract_mesh()
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        raise ValueError(
            f"{caller}: `axis_name` {axis_name!r} must name one axis of the "
            f"current mesh (set it with jax.set_mesh), got mesh axes "
            f"{mesh.axis_names}; or call it inside jax.pmap / jax.shard_map "
            "where that axis is bound."
        )
    return mesh.shape[axis_name]


def _check_stacked(params: Any, axis_name: str, caller: str) -> None:
    """Raises unless every leaf of ``params`` has a leading workers axis."""
    workers = _workers_axis(axis_name, caller)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != workers:
            raise ValueError(
                f"{caller}: param {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(leaf)}; under jax.jit over mesh axis {axis_name!r} "
                f"the workers' params are stacked on a leading axis of size "
                f"{workers} (see gradaccum_jax.stack_workers)."
            )


def _first(leaf: jax.Array) -> jax.Array:
    return leaf[0]


def _stacked(leaf: Any) -> jax.Array:
    # An aux output may hold Python numbers, as jax.value_and_grad allows.
    return jnp.asarray(leaf)[None]


def run_stacked(
    worker_fn: Callable[..., tuple[Any, Any]],
    axis_name: str,
    grads: Any,
    state: Any,
    params: Any,
    weight: Any,
    init_fn: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """Runs ``worker_fn(grads, state, params, weight)`` once per stacked worker.

    ``grads``, ``state`` and ``params`` have a leading workers axis of the
    size of mesh axis ``axis_name``; ``weight`` is None, a scalar (the same
    for every worker) or one per worker (shape ``(n,)``). The results come
    back stacked the same way; nothing crosses devices but what
    ``worker_fn``'s collectives over ``axis_name`` move. ``init_fn`` (one
    worker's ``init``) says how a state restored from host arrays is laid
    out over the other mesh axes.
    """
    _check_stacked(params, axis_name, "diloco")
    per_worker_weight = weight is not None and np.ndim(weight) != 0
    # Rows not yet laid out over the workers (restored from host arrays, a
    # weight vector made on the host) are split here, and over the other
    # axes as the params and `init` lay them out; those already split move
    # nothing.
    params = jax.tree.map(functools.partial(rows_split, axis=axis_name), params)
    if is_explicit(axis_name):  # an Auto shard_map splits its inputs itself
        grads = _split_like(grads, params, axis_name)
        state = _split_like(state, _state_layout(init_fn, params), axis_name)
    if per_worker_weight:
        weight = rows_split(jnp.asarray(weight), axis_name)

    def block(grads, state, params, weight):
        if per_worker_weight:
            weight = weight[0]
        updates, state = worker_fn(
            *jax.tree.map(_first, (grads, state, params)), weight
        )
        return jax.tree.map(_stacked, (updates, state))

    spec = P(axis_name)
    return jax.shard_map(
        block,
        in_specs=(spec, spec, spec, spec if per_worker_weight else P()),
        out_specs=spec,
        axis_names={axis_name},
    )(grads, state, params, weight)


def _split_like(tree: Any, like: Any, axis_name: str) -> Any:
    """`rows_split_like` over ``tree``, each leaf like ``like``'s rows
    (``tree`` as is where the structures differ: the caller's checks say
    how)."""
    if jax.tree.structure(tree) != jax.tree.structure(like):
        return jax.tree.map(functools.partial(rows_split, axis=axis_name), tree)
    return jax.tree.map(
        lambda leaf, row: rows_split_like(leaf, axis_name, row), tree, like
    )


def _state_layout(init_fn: Callable[[Any], Any], stacked_params: Any) -> Any:
    """One worker's state as ``init_fn`` lays it out for one row of the
    stacked params (shapes and shardings only, nothing computed)."""

    def row(leaf):
        spec = P(*_tree.partitions(leaf)[1:])
        sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), spec)
        return jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], leaf.dtype, sharding=sharding)

    return jax.eval_shape(init_fn, jax.tree.map(row, stacked_params))


def stack_workers(tree: Any, axis_name: str = "data") -> Any:
    """Replicates ``tree`` into ``n`` stacked workers sharded over ``axis_name``.

    For `diloco` under ``jax.jit`` over a mesh: every leaf ``x`` becomes
    ``x`` repeated on a new leading axis of size ``n`` (the size of mesh
    axis ``axis_name``), sharded over that axis and keeping its other
    partitions (a tensor-parallel ``model`` axis). Apply it to the params
    and to ``opt.init(params)``; worker ``d``'s row lives on the devices of
    index ``d`` along ``axis_name``. Needs the mesh (``jax.set_mesh``).

    Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> with jax.set_mesh(mesh):
    ...     stacked = ga.stack_workers({"w": jnp.ones((3,))}, "data")
    >>> stacked["w"].shape
    (8, 3)

    Args:
      tree: a pytree of arrays: one worker's params or optimizer state.
      axis_name: the mesh axis the workers are laid out over.

    Returns:
      The stacked pytree.
    """
    workers = _workers_axis(axis_name, "stack_workers")
    explicit = (
        jax.sharding.get_abstract_mesh()._name_to_type[axis_name] == AxisType.Explicit
    )

    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    placements = [_placement(leaf) for _, leaf in paths_and_leaves]
    for (path, leaf), placement in zip(paths_and_leaves, placements, strict=True):
        if axis_name in _tree.mesh_axes_in(placement):
            raise ValueError(
                f"stack_workers: leaf {jax.tree_util.keystr(path)} "
                f"({jax.typeof(leaf)}) is sharded over {axis_name!r}, the "
                "workers' axis: each worker holds whole params of its own "
                "there (FSDP over the workers' axis is not supported). Shard "
                "params over another mesh axis (a `model` or `fsdp` axis)."
            )

    def stack(leaf, placement):
        spec = P(axis_name, *placement)
        repeated = jnp.broadcast_to(leaf[None], (workers, *jnp.shape(leaf)))
        if explicit:
            return jax.sharding.reshard(repeated, spec)
        return jax.lax.with_sharding_constraint(repeated, spec)

    leaves, treedef = jax.tree.flatten(tree)
    stacked = jax.jit(
        lambda leaves: [
            stack(leaf, placement)
            for leaf, placement in zip(leaves, placements, strict=True)
        ]
    )(leaves)
    return jax.tree.unflatten(treedef, stacked)


def _placement(leaf: Any) -> tuple[Any, ...]:
    """How ``leaf`` is split over the mesh: its partitions.

    From its type on Explicit axes; on Auto axes the type says nothing, and
    a concrete array's own sharding is the split the user chose (a
    tensor-parallel layer placed with ``jax.device_put``), which the
    stacked workers keep.
    """
    placement = _tree.partitions(leaf)
    sharding = getattr(leaf, "sharding", None)
    if not _tree.mesh_axes_in(placement) and isinstance(
        sharding, jax.sharding.NamedSharding
    ):
        placement = tuple(sharding.spec)
    return placement


def _check_aux(aux: Any) -> None:
    """Raises unless every leaf of ``aux`` can be stacked over the workers."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)):
            raise ValueError(
                f"worker_value_and_grad: aux leaf {jax.tree_util.keystr(path)} "
                f"is {type(leaf).__name__} {leaf!r}; each worker's aux is "
                "stacked over the workers, so its leaves must be arrays or "
                "Python numbers. Return other values from outside the loss."
            )


def anchor_params(state: Any) -> Any:
    """The anchor (outer) params of a `diloco` state: the model to evaluate.

    Between syncs each worker's params have drifted from the anchor; the
    anchor is the model the workers agreed on at the last sync (or,
    mid-cycle, the starting point they all continue from). Takes one
    worker's state, or a stacked one (a leading workers axis, as from
    `stack_workers` or ``jax.pmap``), whose anchors are the same on every
    worker: worker 0's is returned, moving nothing between devices.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> opt = ga.diloco(optax.sgd(0.1), sync_every=4)
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.ones(2)}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"], ga.anchor_params(state)["w"]  # the worker drifted, not the anchor
    (Array([0.9, 0.9], dtype=float32), Array([1., 1.], dtype=float32))

    Args:
      state: a `DiLoCoState` (possibly stacked), or an optax chain state
        that holds one (the first found is used).

    Returns:
      The anchor params, unstacked.
    """
    found = [
        node
        for node in jax.tree.leaves(
            state, is_leaf=lambda node: isinstance(node, DiLoCoState)
        )
        if isinstance(node, DiLoCoState)
    ]
    if not found:
        raise ValueError(
            f"anchor_params: `state` holds no DiLoCoState, got {type(state)}."
        )
    state = found[0]
    if np.ndim(state.cycle_step) == 0:
        return state.anchor
    return jax.jit(lambda anchor: jax.tree.map(_first_worker, anchor))(state.anchor)


def _first_worker(leaf: jax.Array) -> jax.Array:
    """Row 0 of a stacked leaf whose rows are equal, read where it lies.

    On an Explicit mesh JAX refuses to slice a sharded axis; a
    ``shard_map`` in which every device returns its own row (they are the
    same: the anchor is) moves nothing.
    """
    axis = (_tree.partitions(leaf) or (None,))[0]
    if axis is None:
        return leaf[0]
    return jax.shard_map(
        _first,
        mesh=jax.typeof(leaf).sharding.mesh,
        in_specs=P(axis),
        out_specs=P(),
        axis_names=set((axis,) if isinstance(axis, str) else axis),
        check_vma=False,
    )(leaf)


def worker_value_and_grad(
    loss_fn: Callable[..., Any],
    axis_name: str = "data",
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Each stacked worker's loss and gradient on its shard of a global batch.

    ``fn(params, *batch)`` takes stacked params (a leading workers axis,
    see `stack_workers`) and batch arguments whose leading dimension is
    split over mesh axis ``axis_name`` (worker ``d`` gets the ``d``-th
    contiguous block of rows, the block its devices hold), evaluates
    ``jax.value_and_grad(loss_fn, has_aux=has_aux)(params_d, *batch_d)``
    for every worker and returns the results stacked (``loss`` of shape
    ``(n,)``, each aux leaf, Python numbers too, with a leading ``(n,)``).
    No data crosses devices: a worker's gradient is its own, as `diloco`
    wants it. Params and batch not yet split over ``axis_name`` (restored
    from host arrays) are split here; a 0-d batch leaf (a dropout key, a
    scalar) goes to every worker whole.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> def loss_fn(params, x):
    ...     return jnp.mean((x @ params["w"]) ** 2)
    >>> with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    ...     params = ga.stack_workers({"w": jnp.ones((4,))}, "data")
    ...     x = jnp.ones((16, 4))
    ...     loss, grads = ga.worker_value_and_grad(loss_fn, "data")(params, x)
    >>> loss.shape, grads["w"].shape
    ((8,), (8, 4))

    Args:
      loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)``).
      axis_name: the mesh axis the workers are stacked and the batch split
        over.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``fn(params, *batch) -> (loss, grads)`` (``((loss, aux), grads)`` with
      ``has_aux``), stacked over workers.
    """
    if not callable(loss_fn):
        raise ValueError(
            f"`loss_fn` must be a callable loss_fn(params, *batch) -> loss, "
            f"got {loss_fn!r}."
        )
    axis_name = _checks.axis_name("axis_name", axis_name)
    if not isinstance(axis_name, str):
        raise ValueError(
            "`axis_name` must be a non-empty string naming one mesh axis, got "
            f"{axis_name!r}."
        )
    has_aux = _checks.boolean("has_aux", has_aux)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def block(params, *batch):
        out = value_and_grad(jax.tree.map(_first, params), *batch)
        _check_aux(out[0][1] if has_aux else ())
        return jax.tree.map(_stacked, out)

    def fn(params, *batch):
        caller = "worker_value_and_grad"
        _check_stacked(params, axis_name, caller)
        # Params and batch not yet split over the workers (restored from
        # host arrays) are split here; on an Explicit mesh shard_map would
        # reject them. Those already split, as a data loader gives them,
        # move nothing. 0-d arguments go to every worker whole.
        params = jax.tree.map(functools.partial(rows_split, axis=axis_name), params)
        batch, batch_specs = split_arguments(batch, axis_name, caller)
        return jax.shard_map(
            block,
            in_specs=(P(axis_name), *batch_specs),
            out_specs=P(axis_name),
            axis_names={axis_name},
        )(params, *batch)

    return fn
