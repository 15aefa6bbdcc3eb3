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

import functools
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _tree

# Per dimension: None, a mesh axis name or a tuple of them; () when whole.
Split = tuple[Any, ...]

WHOLE: Split = ()


def axes_of(split: Split) -> tuple[str, ...]:
    """The mesh axes ``split`` cuts the leaf over, in order."""
    return tuple(axis for part in split for axis in _tree.entry_axes(part))


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


def psum_list(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    """psum of several arrays over ``axis`` in one (variadic) all-reduce."""
    return list(jax.lax.psum(values, axis)) if values else []
