"""Per-device terms of a sum, kept apart until a window is reduced.

Data parallelism under ``jax.jit`` needs one sum over devices per window,
not per micro-step. Until then each device keeps its own term, in one of two
forms picked from the current mesh (``jax.set_mesh``):

* Explicit axes: an *unreduced* array (type ``f32[...]{U:data}``), shaped
  like the value; JAX tracks that it is a sum and reduces it on ``reshard``.
* Auto axes (no unreduced types there): the terms *stacked* on a leading
  axis of size ``n_devices``, sharded over the mesh axis; the sum is
  ``.sum(0)``.

Either way a term crosses devices only when a window is reduced: by
default in `reduce` (one fused float all-reduce); a `WindowReduction` (e.g.
`gradaccum_jax.ternary_window_reduction`) may send something smaller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree


def is_stacked(axes: frozenset[str]) -> bool:
    """Whether terms over ``axes`` are stacked (Auto mesh) or unreduced."""
    if not axes:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    missing = sorted(axes - set(mesh.axis_names))
    if missing:
        raise ValueError(
            f"`unreduced_axes` {sorted(axes)}: mesh axes {missing} are not in "
            f"the current mesh {mesh.axis_names}; call under jax.set_mesh(mesh)."
        )
    types = {mesh._name_to_type[name] for name in axes}
    # A one-device Explicit axis also stacks: its single term is the sum,
    # and jax 0.10.2 fails to lower some unreduced ops on a size-1 axis.
    one_device = len(axes) == 1 and mesh.shape[next(iter(axes))] == 1
    if types == {AxisType.Explicit} and not one_device:
        return False
    if one_device:
        return True
    if len(axes) > 1 or types != {AxisType.Auto}:
        raise ValueError(
            f"`unreduced_axes` {sorted(axes)}: on a mesh that is not all "
            "Explicit, only one Auto axis is supported (terms stacked on a "
            f"leading axis), got types {sorted(str(t) for t in types)}."
        )
    return True


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


def on_mesh_of(leaf: Any) -> contextlib.AbstractContextManager[Any]:
    """The mesh of a concrete state leaf, set, when none is set already.

    Lets host-side calls on a state of per-device terms (`stats`, a
    checkpoint's `reduce_window`) run outside ``jax.set_mesh``: the
    array's own sharding knows its mesh.
    """
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, jax.core.Tracer)
        and isinstance(mesh, jax.sharding.Mesh)
        and jax.sharding.get_abstract_mesh().empty
    ):
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def _stack_axis(axes: frozenset[str]) -> tuple[str, int]:
    (name,) = axes
    return name, jax.sharding.get_abstract_mesh().shape[name]


def stacked_shape(shape: tuple[int, ...], axes: frozenset[str]) -> tuple[int, ...]:
    """The shape of stacked terms of a value of ``shape``."""
    return (_stack_axis(axes)[1], *shape)


def _stacked_constraint(x: jax.Array, axis: str) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh._name_to_type[axis] == AxisType.Explicit:  # a one-device axis
        return jax.sharding.reshard(x, P(axis))
    return jax.lax.with_sharding_constraint(x, P(axis))


def zeros(leaf: Any, axes: frozenset[str]) -> jax.Array:
    """A zero sum, one term per device, for a value shaped like ``leaf``."""
    if not is_stacked(axes):
        return _tree.unreduced_zeros(leaf, axes)
    shape = stacked_shape(jnp.shape(leaf), axes)
    return _stacked_constraint(jnp.zeros(shape, jnp.result_type(leaf)), *axes)


def is_terms(leaf: Any, like: Any, axes: frozenset[str]) -> bool:
    """Whether ``leaf`` holds per-device terms of a value shaped like ``like``.

    ``like`` is the reduced value's shape (a scalar for a weight, a
    parameter for a gradient).
    """
    if not axes:
        return False
    if is_stacked(axes):
        return jnp.ndim(leaf) == jnp.ndim(like) + 1
    return _tree.unreduced_axes(leaf) == axes


def lift(value: jax.Array, axes: frozenset[str]) -> jax.Array:
    """A reduced value as terms: whole on the first device, zero elsewhere."""
    if not is_stacked(axes):
        return _tree.as_unreduced(value, axes)
    axis, size = _stack_axis(axes)
    stacked = jnp.zeros((size, *jnp.shape(value)), value.dtype).at[0].set(value)
    return _stacked_constraint(stacked, axis)


def reduce(tree: Any, axes: frozenset[str]) -> Any:
    """Sums every leaf of ``tree`` (all terms) over the devices, in one go.

    Unreduced leaves are resharded together (one fused tuple all-reduce);
    stacked leaves are summed over their leading axis, which XLA's
    all-reduce combiner fuses the same way.
    """
    if not axes:
        return tree
    if not is_stacked(axes):
        return _tree.reduce_unreduced(tree)
    return jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), tree)


class WindowReduction(NamedTuple):
    """How `MultiSteps` sums a window of per-device terms at its emission.

    Attributes:
      init: ``init(params) -> state``, the reduction's own state (kept in
        ``MultiStepsState.reduction_state``; arrays that are the same on
        every device, so checkpointable).
      reduce: ``reduce(terms, axes, state) -> (sums, state)``: ``terms`` is
        a pytree of per-device terms over the mesh ``axes`` (unreduced or
        stacked, see this module), ``sums`` the same tree summed over the
        devices, identical on every device. Called once per window, inside
        the emission loop.
    """

    init: Callable[[Any], Any]
    reduce: Callable[[Any, frozenset[str], Any], tuple[Any, Any]]


def float_window_reduction() -> WindowReduction:
    """The default `WindowReduction`: `reduce`, one exact float all-reduce."""
    return WindowReduction(
        init=lambda params: (),
        reduce=lambda terms, axes, state: (reduce(terms, axes), state),
    )


def map_terms(
    fn: Callable[[Any, Any], Any], axes: frozenset[str]
) -> Callable[[Any, Any], Any]:
    """``fn(local, replicated)`` on each device's own term, kept as terms.

    Returns ``g(terms, replicated)``: each device applies ``fn`` to its own
    term of ``terms`` (as a plain value) and to ``replicated`` (the same on
    every device), and its results become
    that device's terms of the output (unreduced, or stacked). A nonlinear
    function of a term (a squared norm) is computed where the term lies:
    no data crosses devices.
    """
    if is_stacked(axes):
        (axis,) = axes
        return jax.shard_map(
            lambda terms, replicated: jax.tree.map(
                lambda x: x[None],
                fn(jax.tree.map(lambda leaf: leaf[0], terms), replicated),
            ),
            in_specs=(P(axis), P()),
            out_specs=P(axis),
        )
    # As in `over_terms`: no cast from unreduced to varying in jax 0.10.2,
    # so the map runs unchecked and hands each device its term as is; its
    # results are each device's own terms of an unreduced output.
    return jax.shard_map(
        fn,
        in_specs=(P(unreduced=set(axes)), P()),
        out_specs=P(unreduced=set(axes)),
        check_vma=False,
    )


def over_terms(
    fn: Callable[[Any, Any], tuple[Any, Any]], axes: frozenset[str]
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``fn(local, state)`` mapped over the devices of per-device ``terms``.

    Returns ``g(terms, state)`` that runs ``fn`` inside a ``jax.shard_map``
    over ``axes``, where each device sees its own term as a value varying
    over ``axes`` (``local``), and ``state`` replicated; ``fn`` must return
    values that are the same on every device (results of collectives over
    ``axes``), which ``g`` returns replicated.
    """
    if is_stacked(axes):
        (axis,) = axes
        in_terms, check_vma = P(axis), True

        def local_terms(terms):
            return jax.tree.map(lambda leaf: leaf[0], terms)
    else:
        # jax 0.10.2 has no cast from unreduced to varying (`pcast` knows
        # only the reverse), and a nonlinear function of a term needs one.
        # Without type checks a shard_map hands each device its term as a
        # plain value; ``fn``'s results are collectives' results, the same
        # on every device, as ``out_specs=P()`` then assumes unchecked.
        in_terms, check_vma = P(unreduced=set(axes)), False

        def local_terms(terms):
            return terms

    def mapped(terms, state):
        return jax.shard_map(
            lambda terms, state: fn(local_terms(terms), state),
            in_specs=(in_terms, P()),
            out_specs=P(),
            check_vma=check_vma,
        )(terms, state)

    return mapped


def over_devices(
    fn: Callable[..., Any], axes: frozenset[str], in_kinds: str, out_kind: str
) -> Callable[..., Any]:
    """``fn`` run on each device of ``axes`` on its own values, no collective.

    ``in_kinds`` has one letter per argument, ``out_kind`` one for the
    result: ``s`` a tree stacked on a leading device axis sharded over the
    axis (a per-device state: a plain array, checkpointable), ``t``
    per-device terms (unreduced or stacked, as `zeros` makes them), ``r``
    a value replicated on every device (inputs only). ``fn`` sees each
    device's own slice (its term, its state) as a value shaped like one
    device's.
    """
    (axis,) = axes
    stacked = is_stacked(axes)
    spec = {"s": P(axis), "t": P(axis) if stacked else P(unreduced={axis}), "r": P()}
    unstack = {"s": True, "t": stacked, "r": False}

    def local(*args):
        out = fn(
            *(
                jax.tree.map(lambda leaf: leaf[0], arg) if unstack[kind] else arg
                for arg, kind in zip(args, in_kinds, strict=True)
            )
        )
        if unstack[out_kind]:
            out = jax.tree.map(lambda leaf: leaf[None], out)
        return out

    # Unreduced terms need check_vma=False (see `over_terms`); each device's
    # result is its own, as the out spec says.
    return jax.shard_map(
        local,
        in_specs=tuple(spec[kind] for kind in in_kinds),
        out_specs=spec[out_kind],
        check_vma=stacked,
    )


def stack(tree: Any, axes: frozenset[str]) -> Any:
    """``tree`` (one per device, stacked on a leading axis) sharded over ``axes``."""
    (axis,) = axes
    return jax.tree.map(lambda leaf: _stacked_constraint(leaf, axis), tree)
