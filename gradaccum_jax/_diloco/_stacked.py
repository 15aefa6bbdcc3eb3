"""DiLoCo under ``jax.jit`` over a mesh: workers stacked on a leading axis.

Between syncs every worker's parameters and inner state differ, so under
``jax.jit`` they are held stacked on a leading axis of size ``n`` (the
workers' mesh axis size), sharded over that axis: device (group) ``d``
holds worker ``d``'s row, as in MaxText's DiLoCo. Here: the layout's
helpers (`stack_workers`, `anchor_params`) and each worker's gradient
(`worker_value_and_grad`, a ``jax.vmap`` over the workers with their axis
name bound, which keeps the params' split over other mesh axes: a
tensor-parallel ``model`` split is not gathered); `_update` runs
`diloco`'s update on the layout.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _checks, _tree
from gradaccum_jax._diloco._state import DiLoCoState
from gradaccum_jax._placement import is_explicit, rows_split, split_arguments


def workers_axis(axis_name: Any, caller: str) -> int:
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


def check_stacked(params: Any, axis_name: str, caller: str) -> None:
    """Raises unless every leaf of ``params`` has a leading workers axis."""
    workers = workers_axis(axis_name, caller)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != workers:
            raise ValueError(
                f"{caller}: param {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(leaf)}; under jax.jit over mesh axis {axis_name!r} "
                f"the workers' params are stacked on a leading axis of size "
                f"{workers} (see gradaccum_jax.stack_workers)."
            )


def first_row(leaf: jax.Array) -> jax.Array:
    return leaf[0]


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
    workers = workers_axis(axis_name, "stack_workers")
    on_explicit = is_explicit(axis_name)

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
        if on_explicit:
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
    ``shard_map`` manual over every mesh axis, in which every device
    returns its own block of its row (the rows are the same: the anchor
    is), moves nothing, whatever the leaf's split over other axes (a
    ``shard_map`` manual over the workers' axis alone would gather a
    tensor-parallel split).
    """
    partitions = _tree.partitions(leaf)
    if not partitions or partitions[0] is None:
        return leaf[0]
    # Unchecked: the rows are equal, which JAX's types cannot know (a checked
    # map refuses a varying row as an output unsplit over the workers).
    return jax.shard_map(
        first_row,
        mesh=jax.typeof(leaf).sharding.mesh,
        in_specs=P(*partitions),
        out_specs=P(*partitions[1:]),
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
    No data crosses the workers: a worker's gradient is its own, as
    `diloco` wants it. ``loss_fn`` sees one worker's params and rows with
    their split over the other mesh axes (``jax.vmap`` over the workers):
    tensor-parallel params stay split over ``model`` and nothing is
    gathered that ``jax.value_and_grad`` of one worker would not gather;
    rows split over the workers' axis and then another (``("dcn",
    "data")``) stay split over the other within a worker. Params and
    batch not yet split over ``axis_name`` (restored from host arrays) are
    split here; a 0-d batch leaf (a dropout key, a scalar) goes to every
    worker whole.

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

    def one_worker(params, *batch):
        out = value_and_grad(params, *batch)
        _check_aux(out[0][1] if has_aux else ())
        # An aux output may hold Python numbers, as jax.value_and_grad allows.
        return jax.tree.map(jnp.asarray, out)

    def fn(params, *batch):
        caller = "worker_value_and_grad"
        check_stacked(params, axis_name, caller)
        # Params and batch not yet split over the workers (restored from
        # host arrays) are split here; those already split, as a data loader
        # gives them, move nothing. 0-d arguments go to every worker whole.
        params = jax.tree.map(functools.partial(rows_split, axis=axis_name), params)
        batch, in_axes = _worker_blocks(batch, axis_name, caller)
        return jax.vmap(
            one_worker,
            in_axes=(0, *in_axes),
            axis_name=axis_name,
            spmd_axis_name=axis_name,
        )(params, *batch)

    return fn


def _leading_axes(leaf: Any) -> tuple[str, ...]:
    """The mesh axes ``leaf``'s leading dimension is split over, in order."""
    lead = (_tree.partitions(leaf) or (None,))[0]
    if lead is None:
        return ()
    return (lead,) if isinstance(lead, str) else tuple(lead)


def _worker_blocks(batch: tuple, axis: str, caller: str) -> tuple[tuple, tuple]:
    """Each batch leaf ``(rows, ...)`` as ``(n, rows // n, ...)``, worker
    ``d``'s contiguous block at ``d``, with the ``vmap`` in_axes (None for a
    0-d leaf, which every worker gets whole).

    Rows split over the workers' axis first and then over others (a
    ``data`` axis inside each worker of a ``dcn`` x ``data`` mesh) keep
    that inner split: each worker's block stays split over its devices.
    """
    workers = jax.sharding.get_abstract_mesh().shape[axis]

    def blocks(leaf, spec=None):
        shape = np.shape(leaf)
        inner = _leading_axes(leaf)[1:]
        rest = (*_tree.partitions(leaf), *(None,) * len(shape))[1 : len(shape)]
        split = P(axis, (inner[0] if len(inner) == 1 else inner) or None, *rest)
        return jnp.reshape(
            leaf,
            (workers, shape[0] // workers, *shape[1:]),
            out_sharding=split if is_explicit(axis) else None,
        )

    laid_out = jax.tree.map(
        lambda leaf: bool(np.ndim(leaf)) and _leading_axes(leaf)[:1] == (axis,),
        batch,
    )
    # Rows laid out by workers become blocks first (the placing below then
    # moves nothing); the others are checked and placed, then cut.
    batch = jax.tree.map(
        lambda leaf, ready: blocks(leaf) if ready else leaf, batch, laid_out
    )
    batch, specs = split_arguments(batch, axis, caller)
    batch = jax.tree.map(
        lambda leaf, ready: leaf if ready or np.ndim(leaf) == 0 else blocks(leaf),
        batch,
        laid_out,
    )
    in_axes = jax.tree.map(lambda spec: 0 if spec == P(axis) else None, specs)
    return batch, in_axes
