"""Checking a batch and splitting it into strided micro-batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def checked_batch_size(batch: Any, num_microbatches: int, num_devices: int = 1) -> int:
    """Returns the leading axis size shared by every leaf of ``batch``.

    Raises a ValueError naming the offending leaf when a leaf has no leading
    axis or disagrees with the others, and naming ``num_microbatches`` and
    the batch size when one does not divide the other.
    """
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(
            "microbatched_value_and_grad: the batch (argument 1) has no array "
            "leaves, so there is nothing to split into micro-batches."
        )
    first_path, first_leaf = leaves[0]
    for path, leaf in leaves:
        if jnp.ndim(leaf) == 0:
            raise ValueError(
                f"microbatched_value_and_grad: batch leaf "
                f"{jax.tree_util.keystr(path)} is a scalar; every batch leaf "
                "needs a leading batch axis. Pass per-step constants as extra "
                "arguments after the batch instead."
            )
        if jnp.shape(leaf)[0] != jnp.shape(first_leaf)[0]:
            raise ValueError(
                f"microbatched_value_and_grad: batch leaves disagree on the "
                f"batch size: leaf {jax.tree_util.keystr(path)} has leading "
                f"axis {jnp.shape(leaf)[0]}, but leaf "
                f"{jax.tree_util.keystr(first_path)} has "
                f"{jnp.shape(first_leaf)[0]}. Every leaf of the batch must "
                "share its leading (batch) axis."
            )
    batch_size = jnp.shape(first_leaf)[0]
    if batch_size % (num_microbatches * num_devices):
        per_device = (
            ""
            if num_devices == 1
            else f" times the `data_axis` size {num_devices} (each device "
            "splits its own examples)"
        )
        raise ValueError(
            f"`num_microbatches`={num_microbatches}{per_device} does not divide "
            f"the batch size {batch_size}; choose a `num_microbatches` that "
            "divides it (or pad the batch and mask the padding with "
            "`weight_fn`)."
        )
    return batch_size


def strided_split(batch: Any, num_microbatches: int) -> Any:
    """Splits every leaf (B, ...) into (num_microbatches, B // num_microbatches, ...).

    Strided, as MaxText does: micro-batch i holds examples i, i + m,
    i + 2m, ... A batch sharded over devices along its batch axis keeps
    every micro-batch spread over the same devices, so no example moves
    between devices (a contiguous split would put micro-batch i on one
    device only).
    """

    def split_leaf(leaf: jax.Array) -> jax.Array:
        per_microbatch = leaf.shape[0] // num_microbatches
        leaf = leaf.reshape(per_microbatch, num_microbatches, *leaf.shape[1:])
        return jnp.swapaxes(leaf, 0, 1)

    return jax.tree.map(split_leaf, batch)
