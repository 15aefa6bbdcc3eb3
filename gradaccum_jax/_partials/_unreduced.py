"""Per-device terms as unreduced arrays, over Explicit mesh axes."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree
from gradaccum_jax._partials._device_terms import DeviceTerms
from gradaccum_jax._partials._layout import TermsLayout
from gradaccum_jax._partials._rows import stacks, term_shape


class Unreduced(DeviceTerms):
    """Terms as unreduced arrays over Explicit mesh ``axes``."""

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
        if weight is None:
            return False
        return bool(_tree.unreduced_axes(weight)) or self._weight_rows(weight)

    def as_weight(self, weight: Any, caller: str) -> jax.Array:
        """Per-device weights as `local_value_and_grad` returns them (one
        row per device, shape ``(n,)``) become a term of the sum, unreduced;
        an unreduced weight is taken as it is, anything else as a scalar."""
        if self._weight_rows(weight):
            return self.loaded(jnp.asarray(weight, jnp.float32))
        if weight is not None and _tree.unreduced_axes(weight):
            return weight
        return super().as_weight(weight, caller)

    def _weight_rows(self, weight: Any) -> bool:
        return weight is not None and jnp.shape(weight) == (self.device_count(),)

    def arrives_whole(self, grad: Any, param: Any) -> bool:
        del param
        return not _tree.unreduced_axes(grad)

    def add_terms(self, acc: Any, terms: Any, weight: Any) -> Any:
        # No rule compares unreduced arrays: selected on each device's terms.
        local = functools.partial(TermsLayout.add_terms, self)
        return _tree.map_unreduced_terms(local, acc, terms, weight, self.axes)

    def as_stacked(self, terms: Any) -> Any:
        """Each device's term as its row of an array stacked over the axes.

        A ``shard_map`` manual over every mesh axis (unreduced inputs need
        it, jax 0.10.2) whose in- and out-specs keep each leaf's partitions:
        a device's block of its term is its block of the row, so no data
        moves. Unchecked: JAX has no cast from unreduced to varying (`pcast`
        knows only the reverse), and each device's term is what it holds.
        """
        rows = self.row_axes()

        def as_rows(leaf):
            parts = _tree.partitions(leaf)
            return jax.shard_map(
                lambda term: term[None],
                in_specs=P(*parts, unreduced=set(self.axes)),
                out_specs=P(rows, *parts),
                check_vma=False,
            )(leaf)

        return jax.tree.map(as_rows, terms)

    def term_spec(self, parts: tuple[Any, ...]) -> P:
        return P(*parts, unreduced=set(self.axes))

    def stored(self, term: jax.Array) -> jax.Array:
        """``term`` as a state keeps it across jitted calls: an ordinary array.

        No unreduced array crosses a jit boundary (newer JAX releases
        refuse one that enters a jitted function). Each device's buffer is
        its own term, as it was: a term of shape ``(a, ...)`` split
        ``P(p0, ...)`` is stored as ``(n * a, ...)`` split
        ``P((*axes, p0), ...)``, the devices' terms one after another along
        the leading dimension; a term with no leading dimension (a scalar)
        or one of size 1 gets a leading dimension of ``n`` instead (see
        `gradaccum_jax._partials._rows`). An identity ``shard_map`` manual
        over every mesh axis (unreduced inputs need it), unchecked: JAX has
        no cast from unreduced to varying (`pcast` knows only the reverse).
        """
        parts = _padded_partitions(term)
        stacked = stacks(jnp.shape(term))
        return jax.shard_map(
            (lambda block: block[None]) if stacked else (lambda block: block),
            in_specs=P(*parts, unreduced=set(self.axes)),
            out_specs=self._stored_spec(parts, stacked),
            check_vma=False,
        )(term)

    def loaded(self, stored: jax.Array) -> jax.Array:
        """A term `stored` keeps, unreduced again: no data moves.

        A stored array placed otherwise (restored from host arrays, or
        saved on another mesh) is first split as `stored` splits it.
        """
        shape = term_shape(jnp.shape(stored), self.device_count())
        stacked = stacks(shape)
        spec = self.stored_spec(stored)
        parts = self._term_partitions(tuple(spec), len(shape), stacked)
        stored = _placement.placed(stored, spec)

        def as_term(block):
            block = block[0] if stacked else block
            return jax.lax.pcast(block, self._rows(), to="unreduced")

        return jax.shard_map(
            as_term, in_specs=spec, out_specs=P(*parts, unreduced=set(self.axes))
        )(stored)

    def stored_spec(self, stored: Any) -> P:
        """The spec a stored term keeps: its rows split over the layout's
        axes first, then over the axes that split its term's leading
        dimension (read from its own split over the other axes)."""
        shape = term_shape(jnp.shape(stored), self.device_count())
        stacked = stacks(shape)
        parts = self._term_partitions(_tree.partitions(stored), len(shape), stacked)
        return self._stored_spec(parts, stacked)

    def _rows(self) -> tuple[str, ...]:
        rows = self.row_axes()
        return (rows,) if isinstance(rows, str) else rows

    def _stored_spec(self, parts: tuple[Any, ...], stacks: bool) -> P:
        """The spec of a stored term split as ``parts``."""
        rows = self._rows()
        first = None if stacks else parts[0]
        kept = () if first is None else (first,) if isinstance(first, str) else first
        joined = (*rows, *kept)
        entry = joined[0] if len(joined) == 1 else joined
        return P(entry, *parts) if stacks else P(entry, *parts[1:])

    def _term_partitions(
        self, stored_parts: tuple[Any, ...], ndim: int, stacks: bool
    ) -> tuple[Any, ...]:
        """A term's partitions, from those of its stored array."""
        stored_parts = (*stored_parts, *(None,) * (ndim + stacks - len(stored_parts)))
        if stacks:
            return tuple(stored_parts[1:])
        first = stored_parts[0]
        for name in self.axes:
            first = _placement.without_axis(first, name)
        return (first, *stored_parts[1:])

    def from_stacked(self, terms: Any) -> Any:
        """Terms stacked on a leading device axis, as unreduced arrays."""
        return _tree.stacked_as_unreduced(terms, self.row_axes())

    def over_terms(self, fn):
        def mapped(terms, state):
            specs = self._block_specs(terms)

            def local(blocks, state):
                return fn(jax.tree.map(_gathered, blocks, specs), state)

            # Unchecked, as in `as_stacked`: each device's term is what it holds.
            return jax.shard_map(
                local, in_specs=(specs, P()), out_specs=P(), check_vma=False
            )(terms, state)

        return mapped

    def over_term_blocks(self, fn):
        def mapped(terms, state):
            splits = [_tree.partitions(leaf) for leaf in jax.tree.leaves(terms)]
            specs = jax.tree.map(lambda leaf: P(*_tree.partitions(leaf)), terms)
            # Unchecked, as in `as_stacked`: results are each device's blocks.
            return jax.shard_map(
                lambda blocks, state: fn(blocks, splits, state),
                in_specs=(self._block_specs(terms), P()),
                out_specs=(specs, P()),
                check_vma=False,
            )(terms, state)

        return mapped

    def _block_specs(self, terms: Any) -> Any:
        """The specs that hand each device its block of each term."""
        return jax.tree.map(
            lambda leaf: P(*_tree.partitions(leaf), unreduced=set(self.axes)), terms
        )

    def __repr__(self) -> str:
        return f"Unreduced({sorted(self.axes)})"


def _padded_partitions(leaf: Any) -> tuple[Any, ...]:
    parts = _tree.partitions(leaf)
    return (*parts, *(None,) * (jnp.ndim(leaf) - len(parts)))


def _gathered(block: jax.Array, spec: P) -> jax.Array:
    """A device's block of a leaf split as ``spec``, gathered whole."""
    for dim, names in enumerate(spec.partitions):
        if names is not None:
            block = jax.lax.all_gather(block, names, axis=dim, tiled=True)
    return block
