"""Streaming DiLoCo's fragments: which leaves sync together, and when.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) syncs the
parameters in F fragments, each at its own step of the H-step cycle, so that
one sync moves about 1/F of the parameters and the peak bandwidth drops F
times. A fragment here is a group of whole parameter leaves; the groups are
chosen from the leaves' shapes and dtypes alone, so every worker, ``init``
and ``update`` agree on them without communicating.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from gradaccum_jax import _checks


def leaf_nbytes(leaf: Any) -> int:
    """Bytes of one leaf (array, tracer or ``jax.ShapeDtypeStruct``)."""
    return (
        int(np.prod(np.shape(leaf), dtype=np.int64))
        * np.dtype(jax.numpy.result_type(leaf)).itemsize
    )


def assign(leaves: list[Any], count: int) -> tuple[tuple[int, ...], ...]:
    """Splits leaf indices into ``count`` groups of about equal bytes.

    Longest-processing-time first: leaves by decreasing bytes (ties by
    index), each to the group with the fewest bytes so far (ties: the lowest
    group). The ``count`` largest leaves start one group each, so no group
    is empty. Deterministic: a function of the leaves' shapes and dtypes.
    Each group lists its leaf indices in increasing order.

    Raises:
      ValueError: if there are fewer leaves than ``count``.
    """
    _checks.fragments_fit(count, len(leaves))
    sizes = [leaf_nbytes(leaf) for leaf in leaves]
    order = sorted(range(len(leaves)), key=lambda i: (-sizes[i], i))
    groups: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for rank, index in enumerate(order):
        group = rank if rank < count else min(range(count), key=totals.__getitem__)
        groups[group].append(index)
        totals[group] += sizes[index]
    return tuple(tuple(sorted(group)) for group in groups)


def sync_offsets(sync_every: int, count: int) -> tuple[int, ...]:
    """The cycle step (0-based) at which each fragment syncs.

    Fragment ``f`` syncs on the call that completes step
    ``(f + 1) * H // F`` of the cycle, i.e. at offset ``(f + 1) * H // F - 1``:
    evenly staggered, the last fragment at the end of the cycle (so with one
    fragment, every ``H`` calls, as in DiLoCo). Distinct for ``F <= H``.
    """
    return tuple((f + 1) * sync_every // count - 1 for f in range(count))


def take(leaves: list[Any], group: tuple[int, ...]) -> list[Any]:
    """The leaves of one fragment, in the group's order."""
    return [leaves[i] for i in group]


def put(leaves: list[Any], group: tuple[int, ...], values: list[Any]) -> list[Any]:
    """``leaves`` with the fragment's places replaced by ``values``."""
    leaves = list(leaves)
    for i, value in zip(group, values, strict=True):
        leaves[i] = value
    return leaves
