"""How a state keeps per-device terms between jitted calls: as rows.

No unreduced array may cross a jit boundary (newer JAX releases refuse one
as an input), and a state is saved and restored as it is. So between
calls every layout keeps its terms the same way: an ordinary array, the
devices' terms one after another along its leading dimension, each
device's block its own term (`stored_shape`). A term without a leading
dimension (a scalar), or with one of size 1, gets a new leading axis
instead: the two forms cannot be confused (`term_shape` inverts them).
"""

from __future__ import annotations

from typing import Any

import jax

from gradaccum_jax import _placement


def stored_shape(shape: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """The shape in which a state keeps a term of ``shape`` on ``devices``.

    The devices' terms one after another along the leading dimension;
    where there is none, or it has size 1, stacked on a new leading axis.
    The two forms cannot be confused: `term_shape` inverts this.
    """
    if stacks(shape):
        return (devices, *shape)
    return (devices * shape[0], *shape[1:])


def term_shape(stored: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """The shape of each term of an array stored as `stored_shape` says."""
    if stored[0] == devices:  # a leading dimension of 1 stacks, never merges
        return tuple(stored[1:])
    return (stored[0] // devices, *stored[1:])


def stacks(shape: tuple[int, ...]) -> bool:
    """Whether terms of ``shape`` are stored on a new leading axis."""
    return not shape or shape[0] == 1


def check_placed(terms: Any, layout: Any) -> None:
    """Raises if a stored term of the state arrived split otherwise than
    the state keeps it (one block of rows per device), as the types show
    on an Explicit mesh.

    ``terms``: a dict of the state's fields that hold terms, by name. A
    replicated term (restored from host arrays) is split where it lies,
    moving nothing; a term split otherwise would be resharded on every
    call, moving the window each micro-step: refused, naming the leaf.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(terms):
        expected = layout.stored_spec(leaf)
        parts = tuple(getattr(jax.typeof(leaf).sharding, "spec", ()) or ())
        if expected is None or all(part is None for part in parts):
            continue
        if _placement.normalized(parts) != _placement.normalized(tuple(expected)):
            raise ValueError(
                f"state{_field_path(path)} arrived split "
                f"{jax.sharding.PartitionSpec(*parts)}, but the state keeps it "
                f"split {expected} (one block of rows per device of mesh axes "
                f"{sorted(layout.axes)}); resharding it would move the window "
                "on every call. Declare the state's shardings as "
                "gradaccum_jax.state_shardings(tx, params) gives them (jit's "
                "in_shardings and out_shardings), or pass the state as "
                "`init` or `update` returned it."
            )


def _field_path(path: tuple) -> str:
    """``.acc_grads['w']`` for the key path ``['acc_grads']['w']``."""
    first, *rest = path
    return f".{first.key}{jax.tree_util.keystr(tuple(rest))}"
