"""Per-device terms of a sum, kept apart until a window is reduced.

Data parallelism under ``jax.jit`` needs one sum over devices per window,
not per micro-step. Until then each device keeps its own term, in one of
three layouts, decided once per trace by `terms_layout` from the mesh axes
and the current mesh (``jax.set_mesh``):

* `NoTerms` (no ``unreduced_axes``): values are whole; a sum is itself.
* `Unreduced` (Explicit axes): an *unreduced* array (type
  ``f32[...]{U:data}``), shaped like the value; JAX tracks that it is a sum
  and reduces it on ``reshard``.
* `Stacked` (one Auto axis, which has no unreduced types): the terms
  stacked on a leading axis of size ``n_devices``, sharded over the mesh
  axis; the sum is ``.sum(0)``.

The three share one interface (`TermsLayout`), so the code that keeps a
window never asks which one it holds. Either way a term crosses devices
only when a window is reduced: by default in `TermsLayout.reduce` (one
fused float all-reduce); a `WindowReduction` (`_reduction`, e.g.
`gradaccum_jax.ternary_window_reduction`) may send something smaller.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree, _weights


class TermsLayout:
    """Where the per-device terms of a sum live: the interface of all three.

    This base class is the layout without terms (`NoTerms`): every value is
    whole, on every device, and a "sum of terms" is the value itself.
    """

    axes: frozenset[str] = frozenset()

    def zeros(self, leaf: Any) -> jax.Array:
        """A zero sum, as terms, of a value shaped (and sharded) like ``leaf``."""
        return _tree.zeros_like(leaf)

    def lift(self, value: jax.Array) -> jax.Array:
        """A whole value as terms: whole on the first device, zero elsewhere."""
        return value

    def reduce(self, tree: Any) -> Any:
        """Every leaf of ``tree`` (all terms) summed over the devices, in one go."""
        return tree

    def placed_like(self, value: Any, like: Any) -> Any:
        """A whole ``value`` (restored from host arrays) split as ``like``
        where the split is in the types (Explicit axes), to be lifted."""
        del like
        return value

    def holds_terms(self, leaf: Any, like: Any) -> bool:
        """Whether ``leaf`` holds terms of a value shaped like ``like``."""
        del leaf, like
        return False

    def is_weighted(self, weight: Any) -> bool:
        """Whether ``weight`` is per-device terms (gradients then weighted)."""
        del weight
        return False

    def add_terms(self, acc: Any, terms: Any, weight: Any) -> Any:
        """``acc + terms``, leaf by leaf, on each device whose weight is not 0.

        ``terms`` are already weighted (``w_d g_d``, one per device, in this
        layout) and ``weight`` holds each device's ``w_d``. A device of
        weight 0 keeps its ``acc``: a select, since a device of padding only
        has a NaN gradient (a 0 / 0 loss), and 0 * NaN is NaN.
        """
        return jax.tree.map(lambda a, t: jnp.where(weight != 0, a + t, a), acc, terms)

    def as_weight(self, weight: Any, caller: str) -> jax.Array:
        """A micro-batch's ``weight=`` validated: a float32 scalar (1 if None),
        or per-device terms as the layout keeps them."""
        return _weights.scalar_weight(weight, caller)

    def as_terms(self, value: jax.Array, like: Any) -> jax.Array:
        """``value`` as terms, lifted if it is a whole value."""
        return value if self.holds_terms(value, like) else self.lift(value)

    def total(self, value: Any, like: Any) -> Any:
        """The whole value of ``value``: its terms summed, if it holds terms."""
        return self.reduce(value) if self.holds_terms(value, like) else value

    def arrival_shape(self, leaf: Any) -> Any:
        """The shape of the terms of a value shaped like ``leaf``."""
        return leaf

    def arrives_whole(self, grad: Any, param: Any) -> bool:
        """Whether gradient leaf ``grad`` is whole where terms are due.

        Whole: summed over the devices, as ``jax.grad`` returns it.
        ``param`` is its param, or None where the params are not given.
        """
        del grad, param
        return False

    def map_terms(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``fn(local, replicated)`` on each device's own term, kept as terms.

        A nonlinear function of a term (a squared norm) is computed where the
        term lies: no data crosses devices.
        """
        return fn

    def over_terms(
        self, fn: Callable[[Any, Any], tuple[Any, Any]]
    ) -> Callable[[Any, Any], tuple[Any, Any]]:
        """``fn(local, state)`` on each device's own term; replicated results.

        ``fn`` runs where each device sees its own term as a value varying
        over the axes and ``state`` replicated; it must return values that
        are the same on every device (results of collectives over the axes).
        """
        return fn

    def over_term_blocks(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`over_terms` with ``fn(blocks, splits, state)``: each device's block
        of a term split over other axes, its partitions (``_ternary._blocks``;
        ``()``: whole, as stacked terms are); ``fn`` returns blocks, state."""
        return self.over_terms(lambda t, s: fn(t, [()] * len(jax.tree.leaves(t)), s))

    def micro_batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(mean_grads, weight, *replicated)`` on each device's micro-batch.

        Returns ``g(grads, weight, *replicated)``, whose result is ``fn``'s
        as terms. Each device's term of a micro-batch's gradient is a small
        batch of its own; ``fn`` sees it as the mean gradient of that batch
        and the batch's weight (and ``replicated``, values that are the same
        on every device, as they are). With a per-device weight ``w_d`` the
        terms are ``w_d g_d`` (`gradaccum_jax.local_value_and_grad` with
        ``has_weight=True``), so the mean is the term over ``w_d``; a
        replicated weight ``w`` is spread evenly over the ``n`` devices,
        whose terms are then ``g_d / n``. The scaling is one multiply that
        XLA fuses into ``fn``'s reduction. A device of zero weight gets its
        gradients scaled by a safe 1 (its NaNs are ``fn``'s to drop with a
        select).
        """
        return fn


class NoTerms(TermsLayout):
    """Values kept whole: no ``unreduced_axes``."""

    def __repr__(self) -> str:
        return "NoTerms()"


class DeviceTerms(TermsLayout, abc.ABC):
    """What the two layouts with per-device terms share."""

    # The partition spec of terms, and whether a device's own term is a
    # slice of a stacked array (set by each layout).
    _term_spec: P
    _stacked: bool

    def micro_batch(self, fn):
        mapped = self.map_terms(_device_micro_batch(fn, self.device_count()))

        def run(grads, weight, *replicated):
            if self.is_weighted(weight):  # per-device weights, with the terms
                return mapped((grads, weight), (None, replicated))
            return mapped(grads, (weight, replicated))

        return run

    @abc.abstractmethod
    def from_stacked(self, terms: Any) -> Any:
        """Terms stacked on a leading device axis, in this layout."""

    def device_count(self) -> int:
        """The number of devices over the layout's axes."""
        mesh_shape = jax.sharding.get_abstract_mesh().shape
        count = 1
        for name in self.axes:
            count *= mesh_shape[name]
        return count

    def over_devices(
        self, fn: Callable[..., Any], in_kinds: str, out_kind: str
    ) -> Callable[..., Any]:
        """``fn`` run on each device of the (one) axis on its own values.

        No collective. ``in_kinds`` has one letter per argument, ``out_kind``
        one for the result: ``s`` a tree stacked on a leading device axis
        sharded over the axis (a per-device state: a plain array,
        checkpointable), ``t`` per-device terms in this layout, ``r`` a value
        replicated on every device (inputs only). ``fn`` sees each device's
        own slice (its term, its state) as a value shaped like one device's.
        """
        (axis,) = self.axes
        spec = {"s": P(axis), "t": self._term_spec, "r": P()}
        unstack = {"s": True, "t": self._stacked, "r": False}

        def local(*args):
            out = fn(
                *(
                    _unstack(arg) if unstack[kind] else arg
                    for arg, kind in zip(args, in_kinds, strict=True)
                )
            )
            return jax.tree.map(lambda x: x[None], out) if unstack[out_kind] else out

        # Unreduced terms need check_vma=False (see `Unreduced.over_terms`).
        mapped = jax.shard_map(
            local,
            in_specs=tuple(spec[kind] for kind in in_kinds),
            out_specs=spec[out_kind],
            check_vma=self._stacked,
        )

        def run(*args):
            # A per-device state restored from host arrays arrives unsplit,
            # which an Explicit shard_map rejects (an Auto one splits it).
            explicit = _placement.is_explicit(axis)
            return mapped(
                *(
                    self.stack(arg) if kind == "s" and explicit else arg
                    for arg, kind in zip(args, in_kinds, strict=True)
                )
            )

        return run

    def stack(self, tree: Any) -> Any:
        """``tree`` (one per device, stacked on a leading axis) sharded over
        it: a no-op if it is; host arrays are sliced where they lie."""
        (axis,) = self.axes
        if _placement.is_explicit(axis):
            return jax.tree.map(lambda leaf: _placement.placed(leaf, P(axis)), tree)
        return jax.tree.map(
            lambda leaf: jax.lax.with_sharding_constraint(leaf, P(axis)), tree
        )


class Unreduced(DeviceTerms):
    """Terms as unreduced arrays over Explicit mesh ``axes``."""

    _stacked = False

    def __init__(self, axes: frozenset[str]):
        self.axes = axes
        self._term_spec = P(unreduced=set(axes))

    def zeros(self, leaf: Any) -> jax.Array:
        return _tree.unreduced_zeros(leaf, self.axes)

    def lift(self, value: jax.Array) -> jax.Array:
        return _tree.as_unreduced(value, self.axes)

    def placed_like(self, value: Any, like: Any) -> Any:
        return _placement.placed(value, P(*_tree.partitions(like)))

    def reduce(self, tree: Any) -> Any:
        # Unreduced leaves are resharded together: one fused tuple all-reduce.
        return _tree.reduce_unreduced(tree)

    def holds_terms(self, leaf: Any, like: Any) -> bool:
        del like
        return _tree.unreduced_axes(leaf) == self.axes

    def is_weighted(self, weight: Any) -> bool:
        return bool(_tree.unreduced_axes(weight))

    def arrives_whole(self, grad: Any, param: Any) -> bool:
        del param
        return not _tree.unreduced_axes(grad)

    def add_terms(self, acc: Any, terms: Any, weight: Any) -> Any:
        # No rule compares unreduced arrays: selected on each device's terms.
        local = functools.partial(TermsLayout.add_terms, self)
        return _tree.map_unreduced_terms(local, acc, terms, weight, self.axes)

    def from_stacked(self, terms: Any) -> Any:
        """Terms stacked on a leading device axis, as unreduced arrays."""
        (axis,) = self.axes
        return _tree.stacked_as_unreduced(terms, axis)

    def map_terms(self, fn):
        return self._full_manual(fn, P(unreduced=set(self.axes)))

    def over_terms(self, fn):
        return self._full_manual(fn, P())

    def over_term_blocks(self, fn):
        def mapped(terms, state):
            splits = [_tree.partitions(leaf) for leaf in jax.tree.leaves(terms)]
            specs = jax.tree.map(lambda leaf: P(*_tree.partitions(leaf)), terms)
            # Unchecked, as `_full_manual`: results are each device's blocks.
            unreduced = jax.tree.map(lambda s: P(*s, unreduced=set(self.axes)), specs)
            return jax.shard_map(
                lambda terms, state: fn(terms, splits, state),
                in_specs=(unreduced, P()),
                out_specs=(specs, P()),
                check_vma=False,
            )(terms, state)

        return mapped

    def _full_manual(self, fn, out_spec):
        """``fn`` on each device's whole term, in a full-manual shard_map.

        Unreduced inputs need every mesh axis manual (jax 0.10.2), and jax
        0.10.2 has no cast from unreduced to varying (`pcast` knows only the
        reverse), which a nonlinear function of a term needs: the map runs
        unchecked and hands each device its term as is. ``fn``'s results are
        each device's own terms (``out_spec`` unreduced) or collectives'
        results, the same on every device (``P()``). A term split over
        another axis (a tensor-parallel leaf on a 2-D mesh) is gathered over
        it first, so ``fn`` sees the device's whole term; the devices of that
        axis then compute the same results.
        """

        def mapped(terms, replicated):
            specs = jax.tree.map(
                lambda leaf: P(*_tree.partitions(leaf), unreduced=set(self.axes)),
                terms,
            )

            def local(terms, replicated):
                return fn(jax.tree.map(_gather_partitions, terms, specs), replicated)

            return jax.shard_map(
                local, in_specs=(specs, P()), out_specs=out_spec, check_vma=False
            )(terms, replicated)

        return mapped

    def __repr__(self) -> str:
        return f"Unreduced({sorted(self.axes)})"


class Stacked(DeviceTerms):
    """Terms stacked on a leading axis of size ``size``, sharded over ``axis``."""

    _stacked = True

    def __init__(self, axis: str, size: int):
        self.axes = frozenset({axis})
        self.axis = axis
        self.size = size
        self._term_spec = P(axis)

    def zeros(self, leaf: Any) -> jax.Array:
        shape = (self.size, *jnp.shape(leaf))
        return self.stack(jnp.zeros(shape, jnp.result_type(leaf)))

    def lift(self, value: jax.Array) -> jax.Array:
        stacked = jnp.zeros((self.size, *jnp.shape(value)), value.dtype)
        return self.stack(stacked.at[0].set(value))

    def reduce(self, tree: Any) -> Any:
        # XLA's all-reduce combiner fuses the leaves' sums into one.
        return jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), tree)

    def holds_terms(self, leaf: Any, like: Any) -> bool:
        return jnp.ndim(leaf) == jnp.ndim(like) + 1

    def is_weighted(self, weight: Any) -> bool:
        return weight is not None and jnp.ndim(weight) == 1

    def add_terms(self, acc: Any, terms: Any, weight: Any) -> Any:
        def add_leaf(a, t):  # device d's weight selects row d of its term
            keep = jnp.reshape(weight != 0, (self.size,) + (1,) * (jnp.ndim(a) - 1))
            return jnp.where(keep, a + t, a)

        return jax.tree.map(add_leaf, acc, terms)

    def as_weight(self, weight: Any, caller: str) -> jax.Array:
        if self.is_weighted(weight):  # stacked like the gradients
            return jnp.asarray(weight, jnp.float32)
        return super().as_weight(weight, caller)

    def from_stacked(self, terms: Any) -> Any:
        """Terms stacked on a leading device axis: as they are."""
        return terms

    def arrival_shape(self, leaf: Any) -> Any:
        return jax.ShapeDtypeStruct(
            (self.size, *jnp.shape(leaf)), jnp.result_type(leaf)
        )

    def arrives_whole(self, grad: Any, param: Any) -> bool:
        # Without the param a whole gradient of leading dimension `size`
        # looks like terms: only the params tell.
        return param is not None and jnp.shape(grad) == jnp.shape(param)

    def map_terms(self, fn):
        return jax.shard_map(
            lambda terms, replicated: jax.tree.map(
                lambda x: x[None], fn(_unstack(terms), replicated)
            ),
            in_specs=(P(self.axis), P()),
            out_specs=P(self.axis),
        )

    def over_terms(self, fn):
        return jax.shard_map(
            lambda terms, state: fn(_unstack(terms), state),
            in_specs=(P(self.axis), P()),
            out_specs=P(),
        )

    def __repr__(self) -> str:
        return f"Stacked({self.axis!r}, {self.size})"


def terms_layout(axes: frozenset[str]) -> TermsLayout:
    """The layout of per-device terms over ``axes`` on the current mesh.

    Explicit axes keep unreduced arrays; one Auto axis (which has no
    unreduced types) keeps stacked terms. A one-device Explicit axis also
    stacks: its single term is the sum, and jax 0.10.2 fails to lower some
    unreduced ops on a size-1 axis.
    """
    if not axes:
        return NoTerms()
    mesh = jax.sharding.get_abstract_mesh()
    missing = sorted(axes - set(mesh.axis_names))
    if missing:
        raise ValueError(
            f"`unreduced_axes` {sorted(axes)}: mesh axes {missing} are not in "
            f"the current mesh {mesh.axis_names}; call under jax.set_mesh(mesh)."
        )
    types = {mesh._name_to_type[name] for name in axes}
    one_device = len(axes) == 1 and mesh.shape[next(iter(axes))] == 1
    if types == {AxisType.Explicit} and not one_device:
        return Unreduced(frozenset(axes))
    if len(axes) > 1 or not (one_device or types == {AxisType.Auto}):
        raise ValueError(
            f"`unreduced_axes` {sorted(axes)}: on a mesh that is not all "
            "Explicit, only one Auto axis is supported (terms stacked on a "
            f"leading axis), got types {sorted(str(t) for t in types)}."
        )
    (axis,) = axes
    return Stacked(axis, mesh.shape[axis])


def _gather_partitions(local: jax.Array, spec: P) -> jax.Array:
    """A device's slice of a leaf split as ``spec``, gathered whole."""
    for dim, names in enumerate(spec.partitions):
        if names is not None:
            local = jax.lax.all_gather(local, names, axis=dim, tiled=True)
    return local


def device_terms_layout(axes: frozenset[str]) -> DeviceTerms:
    """`terms_layout` for a window kept on each device: one with terms."""
    layout = terms_layout(axes)
    if not isinstance(layout, DeviceTerms):
        raise ValueError(
            f"A per-device window needs mesh axes for its terms, got {sorted(axes)}."
        )
    return layout


def _unstack(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: leaf[0], tree)


def _device_micro_batch(fn, device_count):
    """``fn`` of a device's mean gradient and weight, from its terms (see
    `TermsLayout.micro_batch`); built for `TermsLayout.map_terms`."""

    def local(terms, replicated):
        weight, rest = replicated
        if weight is None:  # per-device weights came in with the terms
            grads, device_weight = terms
            safe = jnp.where(device_weight != 0, device_weight, 1.0)
            scale = 1.0 / safe
        else:
            grads, device_weight = terms, weight / device_count
            scale = jnp.asarray(device_count, jnp.float32)
        mean = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        return fn(mean, device_weight, *rest)

    return local
