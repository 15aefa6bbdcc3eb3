"""Streaming DiLoCo's fragments: which params sync together, and when.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) syncs the
parameters in F fragments, each at its own step of the H-step cycle, so that
one sync moves about 1/F of the parameters and the peak bandwidth drops F
times. A fragment is a list of pieces, one per param leaf it touches: a
whole leaf, or a contiguous block of a leaf's rows along its
``fragment_axis`` (a scanned model's layer axis, as Streaming DiLoCo's and
MaxText's fragments are groups of layers). The pieces are chosen from the
leaves' shapes, dtypes and types alone, so every worker, ``init`` and
``update`` agree on them without communicating.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from gradaccum_jax import _checks, _tree


class Piece(NamedTuple):
    """The part of param leaf ``leaf`` (its index among the flat leaves) that
    one fragment syncs: rows ``[start, stop)`` along ``axis``, or the whole
    leaf when ``axis`` is None."""

    leaf: int
    axis: int | None = None
    start: int = 0
    stop: int = 0


Fragment = tuple[Piece, ...]


def leaf_nbytes(leaf: Any) -> int:
    """Bytes of one leaf (array, tracer or ``jax.ShapeDtypeStruct``)."""
    return (
        int(np.prod(np.shape(leaf), dtype=np.int64))
        * np.dtype(jax.numpy.result_type(leaf)).itemsize
    )


def assign(params: Any, count: int, fragment_axis: Any) -> tuple[Fragment, ...]:
    """Splits ``params`` into ``count`` fragments of about equal bytes.

    Leaves with a split axis (from ``fragment_axis``) are cut along it into
    ``count`` contiguous blocks of near-equal rows, the first ``rows %
    count`` blocks one row longer (``np.array_split``'s rule); fragment
    ``f`` takes block ``f`` of every such leaf. The whole leaves then go,
    by decreasing bytes (ties by index), each to the fragment with the
    fewest bytes so far (ties: the lowest). Without split leaves the
    ``count`` largest leaves start one fragment each, so none is empty.
    Deterministic; each fragment lists its pieces by increasing leaf index.

    Raises:
      ValueError: naming the argument or the leaf, if there are fewer whole
        leaves than ``count`` and nothing is split, if a split axis has
        fewer rows than ``count``, or if it is sharded over a mesh axis.
    """
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves = [leaf for _, leaf in paths_and_leaves]
    axes = split_axes(params, fragment_axis, count)
    pieces: list[list[Piece]] = [[] for _ in range(count)]
    totals = [0] * count
    for index, ((path, leaf), axis) in enumerate(
        zip(paths_and_leaves, axes, strict=True)
    ):
        if axis is None:
            continue
        _check_splittable(path, leaf, axis, count)
        bounds = np.cumsum([0, *_block_rows(np.shape(leaf)[axis], count)])
        row_bytes = leaf_nbytes(leaf) // np.shape(leaf)[axis]
        for f in range(count):
            pieces[f].append(Piece(index, axis, int(bounds[f]), int(bounds[f + 1])))
            totals[f] += row_bytes * int(bounds[f + 1] - bounds[f])
    whole = [i for i, axis in enumerate(axes) if axis is None]
    nothing_split = not any(pieces)
    if nothing_split:
        _checks.fragments_fit(count, len(leaves))
    sizes = {i: leaf_nbytes(leaves[i]) for i in whole}
    for rank, index in enumerate(sorted(whole, key=lambda i: (-sizes[i], i))):
        if nothing_split and rank < count:
            group = rank  # the largest leaves start one group each
        else:
            group = min(range(count), key=totals.__getitem__)
        pieces[group].append(Piece(index))
        totals[group] += sizes[index]
    return tuple(tuple(sorted(group)) for group in pieces)


def split_axes(params: Any, fragment_axis: Any, count: int) -> list[int | None]:
    """Per flat leaf of ``params``, the axis it is cut along, or None.

    ``fragment_axis`` is None, an axis, or a pytree prefix of ``params``
    with those as leaves. A leaf with no such axis (a scalar) is whole, and
    so is every leaf with one fragment.
    """
    if count == 1 or fragment_axis is None:
        return [None] * len(jax.tree.leaves(params))
    try:
        per_leaf = jax.tree.leaves(
            jax.tree.map(
                lambda axis, subtree: jax.tree.map(lambda _: axis, subtree),
                fragment_axis,
                params,
                is_leaf=lambda node: node is None,
            ),
            is_leaf=lambda node: node is None,
        )
    except ValueError as error:
        raise ValueError(
            "diloco: `fragment_axis` must be None, an integer >= 0 or a pytree "
            "prefix of the params with those as leaves (e.g. {'embed': None, "
            f"'layers': 0}}); it does not match the params: {error}"
        ) from None
    leaves = jax.tree.leaves(params)
    return [
        axis if axis is not None and axis < np.ndim(leaf) else None
        for axis, leaf in zip(per_leaf, leaves, strict=True)
    ]


def _block_rows(rows: int, count: int) -> list[int]:
    """``rows`` in ``count`` contiguous blocks, the first ``rows % count``
    one row longer."""
    return [rows // count + (f < rows % count) for f in range(count)]


def _check_splittable(path: Any, leaf: Any, axis: int, count: int) -> None:
    """Raises unless ``leaf`` has ``count`` rows along ``axis``, held whole
    on each device (cutting a sharded axis would move rows between devices)."""
    name = jax.tree_util.keystr(path)
    rows = np.shape(leaf)[axis]
    if rows < count:
        raise ValueError(
            f"diloco: `fragments` ({count}) splits param {name} of shape "
            f"{np.shape(leaf)} along axis {axis} (`fragment_axis`), which has "
            f"{rows} rows: each fragment takes at least one row of every split "
            f"leaf. Use fragments <= {rows}, or keep this leaf whole (None for "
            "it in a `fragment_axis` pytree)."
        )
    partitions = _tree.partitions(leaf)
    sharded = partitions[axis] if axis < len(partitions) else None
    if sharded is not None:
        raise ValueError(
            f"diloco: param {name} ({jax.typeof(leaf)}) is sharded over "
            f"{sharded!r} along axis {axis}, the axis `fragment_axis` splits "
            "it along: a fragment's rows would be gathered from other devices "
            "at every sync. Shard the leaf along another axis, or keep it "
            "whole (None for it in a `fragment_axis` pytree)."
        )


def sync_offsets(sync_every: int, count: int) -> tuple[int, ...]:
    """The cycle step (0-based) at which each fragment syncs.

    Fragment ``f`` syncs on the call that completes step
    ``(f + 1) * H // F`` of the cycle, i.e. at offset ``(f + 1) * H // F - 1``:
    evenly staggered, the last fragment at the end of the cycle (so with one
    fragment, every ``H`` calls, as in DiLoCo). Distinct for ``F <= H``.
    """
    return tuple((f + 1) * sync_every // count - 1 for f in range(count))


def take(leaves: list[Any], fragment: Fragment) -> list[Any]:
    """The whole leaves a fragment touches, in its order."""
    return [leaves[piece.leaf] for piece in fragment]


def put(leaves: list[Any], fragment: Fragment, values: list[Any]) -> list[Any]:
    """``leaves`` with the fragment's leaves replaced by ``values``."""
    leaves = list(leaves)
    for piece, value in zip(fragment, values, strict=True):
        leaves[piece.leaf] = value
    return leaves


def cut(leaves: list[Any], fragment: Fragment) -> list[Any]:
    """The fragment's pieces of its whole leaves (`take`'s result)."""
    return [
        leaf
        if piece.axis is None
        else jax.lax.slice_in_dim(leaf, piece.start, piece.stop, axis=piece.axis)
        for leaf, piece in zip(leaves, fragment, strict=True)
    ]


def paste(leaves: list[Any], fragment: Fragment, values: list[Any]) -> list[Any]:
    """The fragment's whole leaves with its pieces replaced by ``values``.

    Inside a loop that carries the whole leaves, an update of a slice is
    done in place: the other rows are neither copied nor moved.
    """
    return [
        value
        if piece.axis is None
        else jax.lax.dynamic_update_slice_in_dim(leaf, value, piece.start, piece.axis)
        for leaf, piece, value in zip(leaves, fragment, values, strict=True)
    ]
