"""Control flow that keeps large buffers in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

from gradaccum_jax._tree import vary_over, varying_axes

Carry = TypeVar("Carry")


def run_if(pred: jax.Array, fn: Callable[[Carry], Carry], carry: Carry) -> Carry:
    """Returns ``fn(carry)`` if ``pred`` else ``carry``, updating buffers in place.

    Semantically ``lax.cond(pred, fn, lambda c: c, carry)``. It is written as
    a ``lax.while_loop`` that runs zero or one time because XLA aliases a
    while loop's carry with its result, whereas ``lax.cond`` on XLA:CPU
    copies every buffer it passes through (the parameters and optimizer
    moments, several times the model's size) even on the branch that does
    nothing. Praxis made the same substitution for the same reason. ``fn``
    must return a carry of the same structure, shapes and dtypes.

    Inside ``shard_map`` a carry leaf and ``fn``'s result for it may differ
    in the mesh axes they vary over (zeros or a psum result are the same on
    every device, a gradient is not); both are marked as varying over the
    union, which moves no data.
    """
    axes = jax.tree.map(
        lambda before, after: varying_axes(before) | varying_axes(after),
        carry,
        jax.eval_shape(fn, carry),
    )
    carry = jax.tree.map(vary_over, carry, axes)

    def body(trips_and_carry):
        trips, inner = trips_and_carry
        return trips - 1, jax.tree.map(vary_over, fn(inner), axes)

    trips = jnp.asarray(pred, jnp.int32)
    _, carry = jax.lax.while_loop(lambda tc: tc[0] > 0, body, (trips, carry))
    return carry
