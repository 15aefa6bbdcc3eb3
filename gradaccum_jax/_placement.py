"""Inputs placed where a ``shard_map`` over one mesh axis expects them.

On an Explicit mesh ``jax.shard_map`` does not move its inputs: an array
whose type does not match its ``in_specs`` is an error. Arrays restored
from a checkpoint without a sharding (``np.asarray``, ``jax.device_get``)
arrive unsplit: as NumPy arrays eagerly, as replicated inputs under
``jax.jit``. The entry points that map over an axis place such inputs
themselves with the helpers here; each is a no-op for an input already
placed (the compiled program of a placed input is unchanged), and moving a
replicated input to a split one is a local slice, with no collective. On an
Auto axis ``shard_map`` places its inputs itself.

Three more questions about where arrays lie are answered here: whether a
param is split over an axis its gradient must be summed over
(`check_not_sharded_over`), which mesh a concrete state lives on, for
host-side calls made outside ``jax.set_mesh`` (`on_mesh_of`), and how to
run a computation, or have a collective move its operands, where they lie
when XLA's partitioner would move them (`on_each_device`,
`held_by_each_device`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree


def axis_type(axis: str) -> AxisType:
    """The type (Explicit, Auto or Manual) of mesh ``axis`` of the current
    mesh (``jax.set_mesh``; inside ``shard_map``, the axes it made manual
    are Manual). Read from the public ``axis_names`` and ``axis_types``."""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis]


def is_explicit(axis: str) -> bool:
    """Whether mesh ``axis`` of the current mesh is Explicit."""
    return axis_type(axis) == AxisType.Explicit


def axes_typed(*kinds: AxisType, mesh: Any = None) -> tuple[str, ...]:
    """The axes of ``mesh`` (default: the current mesh) whose type is one of
    ``kinds``, in the mesh's order."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind in kinds
    )


def explicit_axes() -> tuple[str, ...]:
    """The Explicit axes of the current mesh, in its order."""
    return axes_typed(AxisType.Explicit)


def placed(leaf: Any, spec: P) -> Any:
    """``leaf`` resharded to ``spec`` unless its type already says so.

    For an Explicit mesh only (an Auto axis's split is not in the type).
    """
    if normalized(_tree.partitions(leaf)) == normalized(tuple(spec)):
        return leaf
    return jax.sharding.reshard(leaf, spec)


def constrained(leaf: Any, spec: P) -> Any:
    """``leaf`` split as ``spec``: `placed` where its first mesh axis is
    Explicit, a sharding constraint where it is Auto (a host array, as a
    restored checkpoint gives, is split either way)."""
    first = next(axis for entry in spec for axis in _tree.entry_axes(entry))
    if is_explicit(first):
        return placed(leaf, spec)
    return jax.lax.with_sharding_constraint(leaf, spec)


def rows_split(leaf: Any, axis: str) -> Any:
    """``leaf`` with its leading dimension split over mesh ``axis``.

    Its other partitions are kept (a tensor-parallel ``model`` split), but
    for ``axis`` itself, which can split one dimension only; so are the
    other axes that split the leading dimension, inside ``axis``'s blocks
    (`rows_entry`). An input not placed at all (a host array) comes out
    replicated over the other mesh axes: nothing says how it was split when
    it was saved. On an Auto axis ``leaf`` is returned as it is.
    """
    if not is_explicit(axis):
        return leaf
    return placed(leaf, _rows_spec(_tree.partitions(leaf), axis))


def rows_entry(entry: Any, axis: str) -> Any:
    """The leading dimension's spec entry split over ``axis`` first.

    ``axis`` becomes the major axis, so that device (or worker) ``d`` of
    ``axis`` holds the ``d``-th contiguous block of rows, and the other
    mesh axes that already split the dimension stay, splitting each block
    further: a multi-slice batch ``P(("dcn", "data"))`` split over ``dcn``
    keeps its ``data`` split inside each slice, where gathering it would
    hand every device of a slice the slice's whole batch.
    """
    kept = without_axis(entry, axis)
    if kept is None:
        return axis
    return (axis, *((kept,) if isinstance(kept, str) else kept))


def _rows_spec(parts: tuple, axis: str) -> P:
    """``parts`` with the leading dimension split over ``axis`` first
    (`rows_entry`) and ``axis`` dropped from the other dimensions."""
    first = rows_entry(parts[0] if parts else None, axis)
    return P(first, *(without_axis(entry, axis) for entry in parts[1:]))


def rows_split_like(leaf: Any, axis: str, like: Any) -> Any:
    """`rows_split`, and where ``leaf`` is split over no other mesh axis (a
    host array, say), split over them as ``like`` (one row's layout: an
    array or a ``jax.ShapeDtypeStruct`` shaped like ``leaf[0]``).

    A state restored from host arrays has lost its tensor-parallel split,
    which the params it is combined with keep: an Explicit mesh refuses to
    mix the two (``select cases must have the same shardings``).
    """
    if not is_explicit(axis):
        return leaf
    spec = _rows_spec(_tree.partitions(leaf), axis)
    if not normalized(tuple(spec)[1:]):
        spec = P(
            spec[0], *(without_axis(entry, axis) for entry in _tree.partitions(like))
        )
    return placed(leaf, spec)


def split_arguments(
    args: tuple, axis: str, caller: str, first_position: int = 1
) -> tuple[tuple, tuple]:
    """Each argument's leaves split by rows over ``axis``, with their specs.

    A leaf with a leading dimension is split along it: device (or worker)
    ``d`` gets the ``d``-th contiguous block of rows. A 0-d leaf (a
    dropout key, a temperature, a Python number) cannot be split: every
    device gets it whole, as ``jax.value_and_grad`` would on one device.

    Args:
      args: the arguments, pytrees of arrays.
      axis: the mesh axis they are split over.
      caller: the public function, for error messages.
      first_position: the position of ``args[0]`` among the caller's
        arguments, so that a message names the argument as the user passed
        it (``params`` is 0).

    Returns:
      ``(args, in_specs)``: the placed arguments and a spec tree per
      argument for ``jax.shard_map`` (``P(axis)`` or ``P()`` per leaf).

    Raises:
      ValueError: naming the argument and leaf, when a leading dimension
        is not a multiple of the size of ``axis``.
    """

    def split(position, path, leaf):
        if np.ndim(leaf) == 0:
            return leaf, P()
        check_rows(leaf, axis, f"{caller}: argument {position}", path)
        return rows_split(leaf, axis), P(axis)

    placed_args, specs = [], []
    for position, arg in enumerate(args, start=first_position):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
        pairs = [split(position, path, leaf) for path, leaf in leaves]
        placed_args.append(treedef.unflatten([leaf for leaf, _ in pairs]))
        specs.append(treedef.unflatten([spec for _, spec in pairs]))
    return tuple(placed_args), tuple(specs)


def check_rows(leaf: Any, axis: str, where: str, path: Any) -> None:
    """Raises unless ``leaf``'s leading dimension splits over mesh ``axis``.

    ``where`` names the argument (``"fn: argument 1"``), ``path`` the leaf
    in it.
    """
    size = jax.sharding.get_abstract_mesh().shape[axis]
    rows = np.shape(leaf)[0]
    if rows % size:
        raise ValueError(
            f"{where}{jax.tree_util.keystr(path)} "
            f"has shape {np.shape(leaf)}; its leading dimension ({rows}) "
            f"is split over the {size} devices of mesh axis {axis!r} and "
            f"must be a multiple of {size}. An argument every device "
            "should get whole must be 0-d: a typed PRNG key "
            "(jax.random.key, or jax.random.wrap_key_data of a raw uint32 "
            "key) or a scalar; close over anything else (functools.partial)."
        )


def without_axis(entry: Any, axis: str) -> Any:
    """A spec entry with mesh ``axis`` dropped from it."""
    if entry == axis:
        return None
    if isinstance(entry, tuple):
        kept = tuple(name for name in entry if name != axis)
        return kept or None
    return entry


def normalized(parts: tuple) -> tuple:
    """Spec entries without trailing Nones (``P('data')`` is ``P('data', None)``)."""
    kept = list(parts)
    while kept and kept[-1] is None:
        kept.pop()
    return tuple(kept)


def check_not_sharded_over(params: Any, axes: frozenset[str], what: str) -> None:
    """Raises if a param is sharded over an axis its gradient is a sum over.

    With FSDP (``P("data", None)``) a device holds a slice of the param, but
    its term of the gradient would be the whole gradient: per-device terms
    cannot be kept sharded over the same axis. ``jax.grad`` there
    reduce-scatters the gradient, which an accumulator sums as it is.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shared = sorted(axes & _tree.mesh_axes_of(leaf))
        if shared:
            raise ValueError(
                f"{what} {jax.tree_util.keystr(path)} ({jax.typeof(leaf)}) is "
                f"sharded over the mesh axis {shared[0]!r}, over which its "
                "gradient would be kept as per-device terms: each device's "
                "term would be the whole gradient. With FSDP params take the "
                "gradients with jax.value_and_grad (reduce-scattered) and "
                "accumulate them without `unreduced_axes`."
            )


def is_concrete(leaf: Any) -> bool:
    """Whether ``leaf`` is an array with values (not traced): its sharding
    says where it lies, on Auto axes too."""
    return isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def as_jit_returns(tree: Any) -> Any:
    """``tree``'s placed arrays with their shardings written as a jitted
    step returns them (traced leaves and others as they are).

    ``jax.jit`` keys its compiled programs on its arguments' shardings as
    written, and the same placement can be written several ways:
    ``P()``, ``P(None)``, ``P("data", None)``, ``P("data")``. An array
    that comes out of a step is written the JAX way (on Explicit axes its
    type's spec, one entry a dimension; on Auto axes the compiler's, its
    trailing Nones dropped), and a state ``init`` wrote another way would
    make the second call compile the whole step again. No data moves.
    """

    def rewritten(leaf: Any) -> Any:
        sharding = getattr(leaf, "sharding", None)
        if not is_concrete(leaf) or not isinstance(sharding, jax.NamedSharding):
            return leaf
        if axes_typed(AxisType.Explicit, mesh=sharding.mesh):
            spec = jax.typeof(leaf).sharding.spec
        else:
            parts = list(sharding.spec)
            while parts and parts[-1] is None:
                parts.pop()
            spec = P(*parts, unreduced=sharding.spec.unreduced)
        if spec == sharding.spec:
            return leaf
        return jax.device_put(leaf, jax.NamedSharding(sharding.mesh, spec))

    return jax.tree.map(rewritten, tree)


def on_mesh_of(leaf: Any) -> contextlib.AbstractContextManager[Any]:
    """The mesh of a concrete state leaf, set, when none is set already.

    Lets host-side calls on a state of per-device terms (`stats`, a
    checkpoint's `reduce_window`) run outside ``jax.set_mesh``: the
    array's own sharding knows its mesh.
    """
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (
        is_concrete(leaf)
        and isinstance(mesh, jax.sharding.Mesh)
        and jax.sharding.get_abstract_mesh().empty
    ):
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def on_each_device(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, run by each device on what it holds.

    Where mesh axes are not manual (``diloco``'s maps over stacked workers
    and over a leaf's blocks, ``spmd_axis_name``), ``fn`` runs in a
    ``shard_map`` manual over them, which those maps split as they split
    its operands. Left to XLA's partitioner, some operations are not run
    where their operands lie: a TopK over a sharded batch dimension is
    gathered whole, and the decoding of top-k payloads gathered over the
    workers was spread over them and its results all-reduced back.
    Elsewhere (``pmap``, a manual ``shard_map``) ``fn`` runs as it is.
    ``fn`` must not use collectives: inside the workers' map their axis
    name would be bound twice.
    """
    free = set(axes_typed(AxisType.Explicit, AxisType.Auto))
    if not free:
        return fn(*args)
    # Unchecked: inside a ``vmap`` with ``spmd_axis_name`` the mapped axis's
    # split is not in the specs' types, so JAX would type each device's own
    # results (its workers' rows) as the same everywhere and refuse them.
    return jax.shard_map(
        fn, in_specs=P(), out_specs=P(), axis_names=free, check_vma=False
    )(*args)


def held_by_each_device(tree: Any) -> Any:
    """``tree``, its arrays laid out as each device holds them.

    The companion of `on_each_device` for a collective's operands and
    results: where mesh axes are not manual (``diloco``'s maps over
    stacked workers and over a leaf's blocks), a collective over the
    workers' mapped axis is a transpose of the stacked array, which XLA's
    partitioner may lay out anywhere, moving the operations around it to
    the other side (an all-to-all of top-k's packed words became one of
    their unpacked int32 indices and float32 values). Constrained on both
    sides, the collective moves what it was given. Elsewhere (``pmap``, a
    manual ``shard_map``) ``tree`` is returned as it is.
    """
    if not axes_typed(AxisType.Explicit, AxisType.Auto):
        return tree
    return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, P()), tree)
