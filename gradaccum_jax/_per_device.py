"""A function run once per device of one mesh axis, the other axes kept.

Data parallelism's per-device terms (each device's gradient of its own
examples, left unreduced) need a function run once per device of the data
axis. A ``shard_map`` manual over that axis alone would do, but jax 0.10.2
lowers its boundary with every *Explicit* axis it leaves to the compiler
replicated: a tensor-parallel param ``f32[2048,8192@model]`` is all-gathered
over ``model`` on the way in and its gradient on the way out, so every
device holds the whole param, the saving tensor parallelism exists for.
(Inside, the types still say ``@model``; only the lowering's
``in_shardings`` drop it. An Auto axis is left open there and kept.)

A ``jax.vmap`` over the per-device blocks of the arguments, its mapped axis
sharded over the mesh axis (``spmd_axis_name``), computes the same terms on
the same devices and leaves every other axis in the types: the model split
is kept and nothing is gathered. Inside, ``jax.lax.axis_index(axis)``,
``psum`` and the other collectives over the axis are vmap's, with the
values they have under ``shard_map``; values are not typed as varying
(no ``pcast``: the axis is not manual).

Where no other axis is Explicit (every other axis Auto, or of size 1:
plain data parallelism) there is nothing to gather, and the ``shard_map``
runs instead, manual over the axis alone: it traces the function on one
device's blocks, so its backward dots are plain matrix products, and the
compiler partitions the Auto axes inside as in the plain step. Under the
vmap they are batched: XLA:CPU writes each weight gradient transposed and
copies it back (the gradients of a 4.2M-parameter MLP took 3x longer), and
XLA's partitioner gathers a batched embedding lookup's backward scatter
over the data axis on a ``data`` x ``fsdp`` Auto mesh (its indices and
updates, every micro-step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree


def over_axis(
    fn: Callable[..., Any], axis: str, in_axes: Any, out_axes: Any = 0
) -> Callable[..., Any]:
    """``fn`` once per device of mesh ``axis``, on the arguments' blocks.

    An argument mapped (``in_axes`` 0) is stacked on a leading axis of the
    size of ``axis``, sharded over it (`device_rows`); one not mapped
    (None) goes to every device whole. Results mapped out (``out_axes``
    0) come out stacked the same way, row ``d`` device ``d``'s.
    """
    if _no_other_explicit_axis(axis):
        return _manual_over(fn, axis, in_axes, out_axes)
    mapped = jax.vmap(
        fn, in_axes=in_axes, out_axes=out_axes, axis_name=axis, spmd_axis_name=axis
    )

    def run(*args):
        out = mapped(*args)
        return jax.tree.map(
            lambda leaf, dim: leaf if dim is None else _rows_over(leaf, axis),
            out,
            jax.tree.broadcast(out_axes, out, is_leaf=lambda x: x is None),
            is_leaf=lambda x: x is None,
        )

    return run


def _no_other_explicit_axis(axis: str) -> bool:
    """Whether every other axis of the current mesh with more than one
    device is Auto: a ``shard_map`` manual over ``axis`` alone then gathers
    nothing at its boundary (jax 0.10.2 replicates only Explicit ones)."""
    mesh = jax.sharding.get_abstract_mesh()
    return all(
        size == 1 or _placement.axis_type(name) == AxisType.Auto
        for name, size in mesh.shape.items()
        if name != axis
    )


def _manual_over(
    fn: Callable[..., Any], axis: str, in_axes: Any, out_axes: Any
) -> Callable[..., Any]:
    """`over_axis` as a ``shard_map`` manual over ``axis``: ``fn`` traced on
    one device's blocks (a mapped argument's row, an unmapped one whole).

    Every value is typed as varying over ``axis``, as each vmapped instance
    has its own: an unmapped argument on the way in (else the gradient of
    one inside ``fn`` would be summed over the devices, the all-reduce a
    per-device term exists to avoid), a result on the way out.
    """
    varying = frozenset({axis})

    def specs(axes: Any, tree: Any) -> Any:
        axes = jax.tree.broadcast(axes, tree, is_leaf=lambda x: x is None)
        return jax.tree.map(
            lambda _, dim: P() if dim is None else P(axis),
            tree,
            axes,
            is_leaf=lambda x: x is None,
        )

    def run(*args):
        in_specs = specs(tuple(in_axes), args)
        out_specs = specs(
            out_axes,
            jax.eval_shape(
                jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=axis),
                *args,
            ),
        )

        def on_device(*blocks):
            # A None (an absent batch field) is passed through as it is.
            blocks = jax.tree.map(
                lambda block, spec: (
                    block
                    if block is None
                    else _tree.vary_over(block, varying)
                    if spec == P()
                    else block[0]
                ),
                blocks,
                in_specs,
                is_leaf=lambda x: x is None,
            )
            return jax.tree.map(
                lambda leaf, spec: (
                    leaf
                    if leaf is None or spec == P()
                    else _tree.vary_over(leaf, varying)[None]
                ),
                fn(*blocks),
                out_specs,
                is_leaf=lambda x: x is None,
            )

        return jax.shard_map(
            on_device, in_specs=in_specs, out_specs=out_specs, axis_names={axis}
        )(*args)

    return run


def device_rows(leaf: Any, axis: str) -> jax.Array:
    """``leaf``'s rows grouped by device of mesh ``axis``: shape
    ``(n, rows // n, ...)``, the leading axis sharded over ``axis``.

    Where ``leaf``'s rows are already split over ``axis`` (alone or with
    other axes, as an FSDP batch ``P(("data", "fsdp"))`` or a multi-slice
    one ``P(("dcn", "data"))`` is) the grouping is local: each device's row
    ``d`` holds the rows it has, still split over the other axes. A leaf
    not split over ``axis`` (a host array) is split first: from a
    replicated one, a local slice.
    """
    n = jax.sharding.get_abstract_mesh().shape[axis]
    shape = np.shape(leaf)
    if not _placement.is_explicit(axis):
        # An Auto axis: vmap's spmd_axis_name places the groups.
        return jnp.reshape(leaf, (n, shape[0] // n, *shape[1:]))
    parts = _tree.partitions(leaf)
    parts += (None,) * (len(shape) - len(parts))
    lead = () if parts[0] is None else _as_tuple(parts[0])
    rest = tuple(_placement.without_axis(entry, axis) for entry in parts[1:])
    if axis not in lead:
        lead = (axis, *lead)
        leaf = _placement.placed(leaf, P(lead, *rest))
    mesh_shape = jax.sharding.get_abstract_mesh().shape
    sizes = tuple(mesh_shape[name] for name in lead)
    block = shape[0] // math.prod(sizes)
    # (rows) -> one dimension per mesh axis of the split, then this axis's
    # first: both steps only relabel what each device holds.
    split = jnp.reshape(
        leaf, (*sizes, block, *shape[1:]), out_sharding=P(*lead, None, *rest)
    )
    split = jnp.moveaxis(split, lead.index(axis), 0)
    others = tuple(name for name in lead if name != axis)
    return jnp.reshape(
        split,
        (n, shape[0] // n, *shape[1:]),
        out_sharding=P(axis, others or None, *rest),
    )


def stacked_arguments(
    args: tuple, axis: str, caller: str, first_position: int = 1
) -> tuple[tuple, tuple]:
    """Each argument's leaves grouped by device of ``axis``, with in_axes.

    A leaf with a leading dimension is split along it (`device_rows`); a
    0-d leaf (a dropout key, a temperature) goes to every device whole, as
    ``jax.value_and_grad`` would see it on one device.

    Returns:
      ``(args, in_axes)``: the stacked arguments and an in_axes tree per
      argument for `over_axis` (0 or None per leaf).

    Raises:
      ValueError: naming the argument and leaf (``first_position`` is the
        position of ``args[0]`` among the caller's arguments) when a
        leading dimension is not a multiple of the size of ``axis``.
    """
    stacked, in_axes = [], []
    for position, arg in enumerate(args, start=first_position):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
        pairs: list[tuple[Any, int | None]] = []
        for path, leaf in leaves:
            if np.ndim(leaf) == 0:
                pairs.append((leaf, None))
                continue
            _placement.check_rows(leaf, axis, f"{caller}: argument {position}", path)
            pairs.append((device_rows(leaf, axis), 0))
        stacked.append(treedef.unflatten([leaf for leaf, _ in pairs]))
        in_axes.append(treedef.unflatten([dim for _, dim in pairs]))
    return tuple(stacked), tuple(in_axes)


def _rows_over(leaf: jax.Array, axis: str) -> jax.Array:
    """A stacked result with its leading axis over ``axis``.

    A result the function computes alike on every device (a constant, a
    weight from a static shape) comes out of the vmap broadcast, not
    split: on an Explicit axis it is split here (a local slice). On an Auto
    axis nothing holds any result there once the map is done (the compiler
    may replicate it): it is pinned, its other dimensions left free.
    """
    if not _placement.is_explicit(axis):
        free = (P.UNCONSTRAINED,) * (jnp.ndim(leaf) - 1)
        return jax.lax.with_sharding_constraint(leaf, P(axis, *free))
    rest = _tree.partitions(leaf)[1:]
    return _placement.placed(leaf, P(axis, *rest))


def _as_tuple(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)
