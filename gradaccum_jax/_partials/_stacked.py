"""Per-device terms stacked on a leading device axis, over one Auto axis."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree
from gradaccum_jax._partials._device_terms import DeviceTerms, _unstack
from gradaccum_jax._partials._rows import stacks, stored_shape, term_shape


class Stacked(DeviceTerms):
    """Terms stacked on a leading axis of size ``size``, sharded over ``axis``.

    A term keeps the split of the value it is a term of over the other mesh
    axes (a tensor-parallel param's ``model`` split): a window of a
    ``(16, 32)`` param split ``P(None, "model")`` over 4 devices holds a
    ``(1, 16, 8)`` block on each device, as many bytes as the param's own.
    """

    stacked = True

    def __init__(self, axis: str, size: int):
        self.axes = frozenset({axis})
        self.axis = axis
        self.size = size
        self._term_spec = P(axis)

    def zeros(self, leaf: Any) -> jax.Array:
        return self._zeros_split_like(leaf)

    def lift(self, value: jax.Array) -> jax.Array:
        if _placement.is_explicit(self.axis):  # one device: its term is the value
            return self._split_like(value[None], value)
        return self._split_like(self._zeros_split_like(value).at[0].set(value), value)

    def _zeros_split_like(self, like: Any) -> jax.Array:
        """Zero terms of a value shaped like ``like``, split as `_split_like`
        says. Eagerly they are made where they lie: a stacked window built
        whole on one device first would hold ``size`` times the param."""
        shape = (self.size, *jnp.shape(like))
        dtype = jnp.result_type(like)
        mesh = getattr(getattr(like, "sharding", None), "mesh", None)
        if _placement.is_concrete(like) and isinstance(mesh, jax.sharding.Mesh):
            sharding = jax.sharding.NamedSharding(mesh, self._spec_like(like))
            return jnp.zeros(shape, dtype, device=sharding)
        return self._split_like(jnp.zeros(shape, dtype), like)

    def _split_like(self, stacked: jax.Array, like: Any) -> jax.Array:
        """``stacked`` split by rows over the axis and, below them, as
        ``like`` (one device's term) is split over the other mesh axes.

        On an Auto axis the split is not in the types: a concrete ``like``
        (a param, at ``init``) tells it, and under ``jax.jit`` the compiler
        takes it from the values it meets (the gradients, the window passed
        in), not a replicated copy a plain ``P(axis)`` would ask for.
        """
        return _placement.constrained(stacked, self._spec_like(like))

    def _spec_like(self, like: Any) -> P:
        """The spec of terms of a value split as ``like``."""
        rest = [
            _placement.without_axis(entry, self.axis)
            for entry in _term_partitions(like, self.axis)
        ]
        return P(self.axis, *rest)

    def stored(self, term: jax.Array) -> jax.Array:
        """Stacked terms ``(n, a, ...)`` as rows ``(n * a, ...)``: a reshape
        of the leading dimensions, each device's block its own term (a
        scalar's or a leading dimension of 1's terms stay stacked)."""
        shape = jnp.shape(term)[1:]
        if stacks(shape):
            return term
        return jnp.reshape(term, stored_shape(shape, self.size))

    def loaded(self, stored: jax.Array) -> jax.Array:
        shape = term_shape(jnp.shape(stored), self.size)
        terms = stored if stacks(shape) else jnp.reshape(stored, (self.size, *shape))
        if _placement.is_explicit(self.axis):  # one device
            return _placement.placed(terms, P(self.axis))
        return jax.lax.with_sharding_constraint(
            terms, P(self.axis, *(P.UNCONSTRAINED,) * len(shape))
        )

    def term_spec(self, parts: tuple[Any, ...]) -> P:
        return P(self.axis, *parts)

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

    def as_stacked(self, terms: Any) -> Any:
        """Stacked terms: as they are."""
        return terms

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

    def over_terms(self, fn):
        # Each device's whole term: on an Auto mesh the split over the other
        # axes is the compiler's, not in the types, so a block's place in
        # the term is not known when tracing and a term split over them is
        # gathered at the map's boundary.
        return jax.shard_map(
            lambda terms, state: fn(_unstack(terms), state),
            in_specs=(P(self.axis), P()),
            out_specs=P(),
        )

    def __repr__(self) -> str:
        return f"Stacked({self.axis!r}, {self.size})"


def _term_partitions(like: Any, axis: str) -> tuple[Any, ...]:
    """How ``like`` is split, one entry per dimension: from its type on an
    Explicit mesh, from a concrete array's sharding on an Auto one, else
    left to the compiler (``P.UNCONSTRAINED``)."""
    ndim = jnp.ndim(like)
    if _placement.is_explicit(axis):
        parts = _tree.partitions(like)
    elif _placement.is_concrete(like):
        sharding = like.sharding
        parts = ()
        if isinstance(sharding, jax.sharding.NamedSharding) and _tree.mesh_axes_in(
            tuple(sharding.spec)
        ) <= set(jax.sharding.get_abstract_mesh().axis_names):
            parts = tuple(sharding.spec)
    else:
        return (P.UNCONSTRAINED,) * ndim
    return (*parts, *(None,) * (ndim - len(parts)))
