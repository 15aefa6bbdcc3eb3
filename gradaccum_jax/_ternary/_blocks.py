"""A leaf seen as the block one device holds, inside a manual ``shard_map``.

Where a leaf is split over mesh axes that a ``shard_map`` makes manual (a
tensor-parallel term of a per-device window, ``f32[32,32@model]{U:data}``,
in a map manual over every axis), each device sees only its block, and its
type no longer says where the block lies. A `Split` says it: one entry per
dimension, as in a ``PartitionSpec`` (None, a mesh axis or a tuple of
them), ``()`` for a leaf held whole. From it, the ternary transformations
compute what depends on the whole leaf (its scale's sums and maxima, each
element's global index for the random bits) with collectives over those
axes, and everything else (codes, packing, residuals) on the block, so no
device gathers the others' blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

# Per dimension: None, a mesh axis name or a tuple of them; () when whole.
Split = tuple[Any, ...]

WHOLE: Split = ()


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AutoSplits:
    """How each param leaf was split over Auto mesh axes when ``init`` saw it.

    On Auto axes the types under ``jax.jit`` do not say how the compiler
    split a leaf, so a codec would code it whole and XLA would move the
    codes over ``model`` to lay them out. ``init`` given placed arrays (not
    traced) reads each one's split from its sharding and keeps it here, and
    the reduction codes each device's block where it lies (see
    `gradaccum_jax._codecs._auto_blocks`). A static pytree node: it is
    part of the tree definition, holds no array, and passes through
    ``jax.jit`` and checkpoints (restored into the target ``init`` made).

    Attributes:
      splits: per param leaf, a ``PartitionSpec``-like tuple of its entries
        over Auto axes (``()``: whole, or not known); ``()`` for all when no
        leaf is known to be split.
    """

    splits: tuple[Split, ...] = ()


def axes_of(split: Split) -> tuple[str, ...]:
    """The mesh axes ``split`` cuts the leaf over, in order."""
    axes: list[str] = []
    for part in split:
        if part is not None:
            axes.extend((part,) if isinstance(part, str) else part)
    return tuple(axes)


def whole_shape(block_shape: tuple[int, ...], split: Split) -> tuple[int, ...]:
    """The shape of the leaf whose block, split as ``split``, is this one."""
    parts = (*split, *(None,) * (len(block_shape) - len(split)))
    return tuple(
        size if part is None else size * jax.lax.axis_size(part)
        for size, part in zip(block_shape, parts, strict=True)
    )


def block_offsets(block_shape: tuple[int, ...], split: Split) -> list[Any]:
    """Where the block starts in the leaf, per dimension (uint32 or 0).

    A dimension split over axes ``a`` is cut into contiguous blocks in the
    order of ``axis_index(a)`` (row-major over a tuple of axes), as
    ``PartitionSpec`` lays them out.
    """
    parts = (*split, *(None,) * (len(block_shape) - len(split)))
    return [
        0
        if part is None
        else jax.lax.axis_index(part).astype(jnp.uint32) * jnp.uint32(size)
        for size, part in zip(block_shape, parts, strict=True)
    ]


def total(value: jax.Array, split: Split) -> jax.Array:
    """``value`` (a block's partial sum) summed over the leaf's blocks."""
    axes = axes_of(split)
    return jax.lax.psum(value, axes) if axes else value


def maximum(value: jax.Array, split: Split) -> jax.Array:
    """``value`` (a block's partial maximum) maximized over the leaf's blocks."""
    axes = axes_of(split)
    return jax.lax.pmax(value, axes) if axes else value


def size(block_size: int, split: Split) -> int:
    """The number of elements of the leaf whose block has ``block_size``."""
    counts = [jax.lax.axis_size(axis) for axis in axes_of(split)]
    return functools.reduce(lambda a, b: a * b, counts, block_size)
