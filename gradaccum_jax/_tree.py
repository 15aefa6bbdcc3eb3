"""Small pytree helpers shared by the transformations."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def varying_axes(leaf: Any) -> frozenset[str]:
    """The ``shard_map`` mesh axes over which ``leaf`` varies (none outside).

    Accepts an array, a tracer or a ``jax.ShapeDtypeStruct``.
    """
    aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
    manual_axis_type = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    axes = getattr(manual_axis_type, "varying", None)
    if axes is None:
        axes = getattr(aval, "vma", None) or ()  # older jax releases
    return frozenset(axes)


def vary_over(leaf: jax.Array, axes: frozenset[str]) -> jax.Array:
    """Marks ``leaf`` as varying over ``axes`` too (no data moves).

    Inside ``shard_map`` (with ``check_vma``) a loop carry must keep its
    type, and a value that is the same on every device (zeros, the result of
    a psum) has another type than one each device computes for itself.
    """
    missing = tuple(sorted(axes - varying_axes(leaf)))
    if not missing:
        return leaf
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(leaf, missing, to="varying")
    return jax.lax.pvary(leaf, missing)  # type: ignore[attr-defined]  # older jax


def unreduced_axes(leaf: Any) -> frozenset[str]:
    """The mesh axes over which ``leaf`` is unreduced (a partial sum).

    An unreduced array (type ``f32[...]{U:data}``) holds on each device one
    term of a sum over the devices of the axis: its value is that sum, but
    nothing has been summed yet. Reads the explicit-sharding type
    (``.sharding.spec.unreduced``) and, inside ``shard_map``, the manual
    axes' type (``.manual_axis_type.unreduced``); returns their union.
    Accepts an array, a tracer or a ``jax.ShapeDtypeStruct``.
    """
    aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    axes = set(getattr(spec, "unreduced", None) or ())
    manual_axis_type = getattr(aval, "manual_axis_type", None)
    axes |= set(getattr(manual_axis_type, "unreduced", None) or ())
    return frozenset(axes)


def partitions(leaf: Any) -> tuple[Any, ...]:
    """The explicit-sharding partitions of ``leaf`` (``()`` when it has none)."""
    aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return tuple(getattr(spec, "partitions", None) or ())


def unreduced_zeros(leaf: Any, axes: frozenset[str]) -> jax.Array:
    """Zeros like ``leaf``, with its partitions, unreduced over ``axes``.

    Needs the mesh (``jax.set_mesh``). No data moves: every device holds a
    zero term of the sum.
    """
    spec = jax.sharding.PartitionSpec(*partitions(leaf), unreduced=set(axes))
    return jnp.zeros(jnp.shape(leaf), jnp.result_type(leaf), out_sharding=spec)


def zeros_like(leaf: Any, dtype: Any = None) -> jax.Array:
    """Zeros of ``leaf``'s shape and type: the one way to build them here.

    Keeps everything the type says about where the value lies, which
    ``jnp.zeros(shape)`` drops: the explicit-sharding partitions (an FSDP
    ``f32[64@data,8]`` gives ``f32[64@data,8]``, not a replicated array a
    loop carry or a ``select`` would reject), the unreduced axes, and inside
    ``shard_map`` the axes it varies over. ``dtype`` replaces the dtype only.
    Accepts an array, a tracer or a ``jax.ShapeDtypeStruct`` (as
    ``jax.eval_shape`` returns it, with its sharding); works eagerly too.
    """
    dtype = jnp.result_type(leaf) if dtype is None else jnp.dtype(dtype)
    axes = unreduced_axes(leaf)
    if axes:
        spec = jax.sharding.PartitionSpec(*partitions(leaf), unreduced=set(axes))
        zeros = jnp.zeros(jnp.shape(leaf), dtype, out_sharding=spec)
    elif not isinstance(leaf, jax.ShapeDtypeStruct):
        # An array keeps its sharding (an Auto mesh's too); a tracer its type.
        zeros = jnp.zeros_like(leaf, dtype)
    else:
        zeros = jnp.zeros(jnp.shape(leaf), dtype, out_sharding=explicit_sharding(leaf))
    return vary_over(zeros, varying_axes(leaf))


def explicit_sharding(leaf: Any) -> Any:
    """``leaf``'s sharding if it has explicit partitions, else None.

    What an array built to match ``leaf`` (``out_sharding=``) needs: an
    unpartitioned leaf gives None, which works with any mesh or none.
    """
    if not any(part is not None for part in partitions(leaf)):
        return None
    aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
    return aval.sharding


def squared_modulus(x: jax.Array) -> jax.Array:
    """``|x|^2`` element-wise in float32: real for complex ``x`` too.

    ``x.astype(float32)`` would drop a complex leaf's imaginary part (with
    only a ComplexWarning to say so).
    """
    if jnp.iscomplexobj(x):
        return jnp.square(x.real.astype(jnp.float32)) + jnp.square(
            x.imag.astype(jnp.float32)
        )
    return jnp.square(x.astype(jnp.float32))


def accumulation_dtype(leaf: Any, dtype: Any) -> jnp.dtype:
    """The dtype in which a sum of ``leaf``-like values is kept.

    ``leaf``: an array, tracer, ``jax.ShapeDtypeStruct`` or a dtype.

    ``dtype`` (the ``accumulator_dtype``, real) for a real leaf; for a
    complex leaf, the complex dtype with at least ``dtype``'s precision
    (complex64 for float32 and narrower, there is no complex bfloat16),
    so the imaginary part is kept.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating):
        return dtype
    return jnp.promote_types(dtype, jnp.complex64)


def as_unreduced(leaf: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``leaf`` as a sum over ``axes``: whole on one device, zero elsewhere.

    No data moves. Leaves already unreduced over ``axes`` are returned as
    is. Written as a ``shard_map`` that selects on the device index rather
    than as ``reshard(leaf, P(unreduced=axes))``: on jax 0.10.2 the reshard
    of a constant (``weight=None``, ``weight=x.shape[0]``) that is also used
    reduced elsewhere in the program comes out as the constant on every
    device, i.e. ``n_devices`` times too large once reduced.
    """
    if unreduced_axes(leaf) == axes:
        return leaf
    names = tuple(sorted(axes))

    mesh_shape = jax.sharding.get_abstract_mesh().shape
    single_device = all(mesh_shape[name] == 1 for name in names)

    def first_device_only(x):
        x = jax.lax.pcast(x, names, to="varying")
        if not single_device:
            # (On a one-device axis the select is moot, and jax 0.10.2 fails
            # to lower it: "Expected last op to be sdy.sharding_constraint".)
            first = functools.reduce(
                jnp.logical_and, [jax.lax.axis_index(name) == 0 for name in names]
            )
            x = jnp.where(first, x, jnp.zeros_like(x))
        return jax.lax.pcast(x, names, to="unreduced")

    # Manual over every mesh axis, not only ``axes``: JAX accepts unreduced
    # out_specs only in full manual mode. Over the other axes (a 2-D mesh's
    # ``model``) each device keeps its own block, as the partitions say.
    spec = jax.sharding.PartitionSpec(*partitions(leaf))
    return jax.shard_map(
        first_device_only,
        in_specs=spec,
        out_specs=jax.sharding.PartitionSpec(*partitions(leaf), unreduced=set(axes)),
    )(leaf)


def stacked_as_unreduced(tree: Any, axis: str | tuple[str, ...]) -> Any:
    """Per-device terms stacked on a leading axis, as unreduced arrays.

    ``tree``'s leaves have a leading axis of the size of mesh ``axis`` (or
    of the axes of a tuple, in the order they split it), sharded over it:
    row ``d`` is device ``d``'s term. Each comes out shaped without it,
    typed unreduced over ``axis``, with its other partitions (a
    tensor-parallel ``model`` axis) kept: a sum over the leading axis whose
    result stays unreduced, so each device keeps its own row and no data
    moves. (Not a ``shard_map`` with unreduced out_specs over ``axis``
    alone: JAX accepts those only when every mesh axis is manual, and a step
    that leaves ``model`` to the compiler is not.)
    """
    axes = {axis} if isinstance(axis, str) else set(axis)

    def as_term(leaf: jax.Array) -> jax.Array:
        rest = partitions(leaf)[1:]
        return jax.lax.reduce_sum(
            leaf,
            (0,),
            out_sharding=jax.sharding.PartitionSpec(*rest, unreduced=axes),
        )

    return jax.tree.map(as_term, tree)


def mesh_axes_of(leaf: Any) -> frozenset[str]:
    """The mesh axes ``leaf``'s explicit partitions shard it over."""
    return mesh_axes_in(partitions(leaf))


def mesh_axes_in(placement: tuple[Any, ...]) -> frozenset[str]:
    """The mesh axes a tuple of partitions (a spec's entries) names."""
    return frozenset(axis for part in placement for axis in entry_axes(part))


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one spec entry names, in order: ``()`` for None, the
    axis for an axis name, the axes of a tuple of them."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def reduce_unreduced(tree: Any) -> Any:
    """Sums every unreduced leaf of ``tree`` over its unreduced axes.

    All of them in one ``reshard``, which XLA emits as one fused (tuple)
    all-reduce; each result keeps its leaf's partitions. Other leaves are
    returned as they are.
    """
    leaves, treedef = jax.tree.flatten(tree)
    todo = [i for i, leaf in enumerate(leaves) if unreduced_axes(leaf)]
    if not todo:
        return tree
    specs = [jax.sharding.PartitionSpec(*partitions(leaves[i])) for i in todo]
    reduced = jax.sharding.reshard([leaves[i] for i in todo], specs)
    for i, value in zip(todo, reduced, strict=True):
        leaves[i] = value
    return treedef.unflatten(leaves)


def map_unreduced_terms(
    fn: Any, acc: Any, terms: Any, weight: jax.Array, axes: frozenset[str]
) -> Any:
    """``fn(acc, terms, weight)`` on each device's own terms over ``axes``.

    For an elementwise ``fn`` of unreduced arrays that JAX has no rule for
    (a comparison, a select): it runs in a full-manual ``shard_map`` whose
    specs keep each leaf of ``acc`` split as it is (a tensor-parallel leaf
    stays split: no collective, each device works on its slice); ``terms``
    are first laid out like ``acc``, the result is.
    """
    unreduced = set(axes)

    def spec(leaf):
        return jax.sharding.PartitionSpec(*partitions(leaf), unreduced=unreduced)

    specs = jax.tree.map(spec, acc)
    terms = jax.tree.map(
        lambda t, s: (
            t if jax.typeof(t).sharding.spec == s else jax.sharding.reshard(t, s)
        ),
        terms,
        specs,
    )
    # Unchecked: JAX has no cast from unreduced to varying in a checked map
    # (`pcast` knows only the reverse), and each device's term is what it
    # holds.
    return jax.shard_map(
        fn,
        in_specs=(specs, specs, jax.sharding.PartitionSpec(unreduced=unreduced)),
        out_specs=specs,
        check_vma=False,
    )(acc, terms, weight)


def is_metadata_box(node: Any) -> bool:
    """Whether ``node`` is a framework's box of one array and its metadata:
    flax linen's ``AxisMetadata`` (``nn.LogicallyPartitioned``,
    ``nn.Partitioned``) or an nnx ``Variable``, which hold it as ``value``
    and carry the params' partitioning."""
    module = type(node).__module__
    return module.startswith("flax.") and hasattr(node, "value")


def unboxed(tree: Any) -> Any:
    """``tree`` with every metadata box (`is_metadata_box`) replaced by its
    array: for a state's leaves that are not laid out like the params,
    whose partitioning the boxes would otherwise hand on to them."""
    return jax.tree.map(
        lambda node: node.value if is_metadata_box(node) else node,
        tree,
        is_leaf=is_metadata_box,
    )


def any_mapped_axis_bound() -> bool:
    """Whether the code is traced under ``pmap``, ``shard_map`` or a named vmap.

    JAX has no public query for it; where its internals differ, the answer
    is True, the cautious one for the callers (they then assume that other
    devices may see other values).
    """
    try:
        from jax._src import core  # noqa: PLC0415

        return bool(core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):
        return True
