"""PRNG keys of the ternary transformations, kept as checkpointable arrays.

A state holds raw uint32 key data rather than a typed key: plain arrays
survive orbax checkpoints and ``jax.device_get``.
"""

from __future__ import annotations

from typing import Any

import jax


def seed_key(seed: int) -> jax.Array:
    """Raw uint32 key data for ``seed``: plain arrays survive checkpointing."""
    return jax.random.key_data(jax.random.key(seed))


def split_per_leaf(key: jax.Array, tree: Any) -> tuple[jax.Array, Any]:
    """Returns the next state key and a tree of independent keys, one per leaf."""
    key, step_key = jax.random.split(jax.random.wrap_key_data(key))
    leaves, treedef = jax.tree.flatten(tree)
    leaf_keys = list(jax.random.split(step_key, len(leaves))) if leaves else []
    return jax.random.key_data(key), jax.tree.unflatten(treedef, leaf_keys)
