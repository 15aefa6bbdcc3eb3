"""How leaves lie over Auto mesh axes, which their types do not say.

On Auto axes (an Auto mesh, or inside `diloco`'s map over stacked workers,
which makes every Explicit axis Auto) a leaf's type under ``jax.jit`` does
not say its split, so a codec would code it whole and XLA would move its
codes. The caller may say it (``diloco`` passes the split it read from
Explicit types as the ``update`` extra argument ``leaf_layouts``, so a
reduction of the user's own gets it too), or the reduction's state
(`AutoSplits`: how ``init``, given placed arrays, saw them split);
`layouts_of` picks one per leaf.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType

from gradaccum_jax import _placement, _tree
from gradaccum_jax._compression import _blocks


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AutoSplits:
    """How each param leaf was split over Auto mesh axes when ``init`` saw it
    (given placed arrays, not traced ones).

    A static pytree node: it is part of the tree definition, holds no
    array, and passes through ``jax.jit`` and checkpoints (restored into
    the target ``init`` made).

    Attributes:
      splits: per param leaf, a ``PartitionSpec``-like tuple of its entries
        over Auto axes (``()``: whole, or not known); ``()`` for all when no
        leaf is known to be split.
    """

    splits: tuple[_blocks.Split, ...] = ()


def seen_splits(leaves: list[Any]) -> AutoSplits:
    """How ``leaves`` lie over Auto mesh axes, read from their shardings:
    one entry per dimension of a split leaf.

    Known only for placed arrays (``init`` called on them, not under
    ``jax.jit``, whose tracers on Auto axes carry no split); an entry over
    an Explicit axis is left out (the type says it under ``jax.jit``).
    """
    splits = [_auto_split(leaf) for leaf in leaves]
    if not any(_blocks.axes_of(split) for split in splits):
        return AutoSplits()
    return AutoSplits(tuple(splits))


def _auto_split(leaf: Any) -> _blocks.Split:
    if not _placement.is_concrete(leaf):
        return _blocks.WHOLE
    sharding = leaf.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return _blocks.WHOLE
    auto = set(_placement.axes_typed(AxisType.Auto, mesh=sharding.mesh))
    parts = (*sharding.spec, *(None,) * (leaf.ndim - len(sharding.spec)))
    split = tuple(
        part if set(_tree.entry_axes(part) or {None}) <= auto else None
        for part in parts
    )
    return split if _blocks.axes_of(split) else _blocks.WHOLE


def layouts_of(
    leaves: list[Any],
    seen: AutoSplits,
    told: list[_blocks.Split] | None = None,
) -> list[_blocks.Split]:
    """Each leaf's split over Auto mesh axes, as the caller says (``told``:
    the ``leaf_layouts`` extra argument of a codec reduction's ``update``),
    else as ``init`` saw the params (``seen``, the state's
    `AutoSplits`).

    ``()`` (whole) for every leaf when neither says it for this many leaves
    (another reduction's updates), and for a leaf the split does not fit:
    one whose type is split already, a split over an axis that is not
    Auto or of a dimension it does not divide. ``leaves`` may go on past
    the params' (a reduction's own extra leaves: whole).
    """
    layouts = None if told is None else tuple(told)
    if layouts is None or len(layouts) != len(leaves):
        if not seen.splits or len(seen.splits) > len(leaves):
            return [_blocks.WHOLE] * len(leaves)
        layouts = (
            *seen.splits,
            *(_blocks.WHOLE,) * (len(leaves) - len(seen.splits)),
        )
    return [
        split if _fits(leaf, split) else _blocks.WHOLE
        for leaf, split in zip(leaves, layouts, strict=True)
    ]


def _fits(leaf: Any, split: _blocks.Split) -> bool:
    if any(part is not None for part in _tree.partitions(leaf)):
        return False
    return fits(tuple(np.shape(leaf)), split)


def fits(shape: tuple[int, ...], split: _blocks.Split) -> bool:
    """Whether a leaf of ``shape`` can be split as ``split``: over Auto axes
    of the current mesh, each of a size that divides its dimension."""
    axes = _blocks.axes_of(split)
    if not axes or len(split) > len(shape):
        return False
    if not set(axes) <= set(_placement.axes_typed(AxisType.Auto)):
        return False
    return all(
        size % count(part) == 0 for size, part in zip(shape, split, strict=False)
    )


def count(part: Any) -> int:
    """The number of devices over the mesh axes of one spec entry."""
    sizes = jax.sharding.get_abstract_mesh().shape
    return math.prod(sizes[name] for name in _tree.entry_axes(part))
