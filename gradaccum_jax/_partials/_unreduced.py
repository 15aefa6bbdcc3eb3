"""Per-device terms as unreduced arrays, over Explicit mesh axes."""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree
from gradaccum_jax._partials._device_terms import DeviceTerms
from gradaccum_jax._partials._layout import TermsLayout


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


def _gathered(block: jax.Array, spec: P) -> jax.Array:
    """A device's block of a leaf split as ``spec``, gathered whole."""
    for dim, names in enumerate(spec.partitions):
        if names is not None:
            block = jax.lax.all_gather(block, names, axis=dim, tiled=True)
    return block
