"""How one window's weighted gradient sum is stored: the `WindowAccumulator`.

The accumulation engine (`MultiSteps`) only ever calls these four pure
functions on the window; what they keep is theirs. `float_accumulator` keeps
one floating array per parameter; the ternary package plugs in int8 code
sums the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks


class WindowAccumulator(NamedTuple):
    """How one window's weighted gradient sum is stored.

    Attributes:
      init: ``init(params) -> acc``, the empty window for these params.
      add: ``add(acc, grads, weight) -> acc``, adds ``weight * grads``;
        ``weight`` is a float32 scalar. A zero weight must leave ``acc``
        unchanged even when ``grads`` holds NaN or Inf: that is how skipped
        micro-batches are dropped.
      total: ``total(acc) -> tree``, the window's weighted sum
        ``sum_i w_i g_i`` as floating arrays shaped like the params.
      reset: ``reset(acc) -> acc``, the empty window again (an accumulator
        may carry things across windows, such as a PRNG key).

    All four are pure functions of their arguments. The engine resets
    lazily: the first ``add`` of a window is given ``reset(acc)``, never a
    window that was already emitted.
    """

    init: Callable[[Any], Any]
    add: Callable[[Any, Any, jax.Array], Any]
    total: Callable[[Any], Any]
    reset: Callable[[Any], Any]


def float_accumulator(dtype: Any = jnp.float32) -> WindowAccumulator:
    """The window sum kept as one floating array per parameter.

    Args:
      dtype: floating dtype of the sum (``accumulator_dtype``).

    Returns:
      A `WindowAccumulator` whose state is a tree shaped like the params.
    """
    dtype = _checks.float_dtype("dtype", dtype)

    def init(params):
        return optax.tree.zeros_like(params, dtype=dtype)

    def add(acc, grads, weight):
        _checks.same_structure(
            grads, acc, "gradients", "the accumulator (built from the params at init)"
        )
        weight = weight.astype(dtype)
        # A select on the weight, not only a multiply by it: a zero-weight
        # micro-batch (skipped, or all padding with a 0/0 loss) may hold NaNs,
        # and 0 * NaN is NaN.
        return jax.tree.map(
            lambda a, g: jnp.where(weight != 0, a + weight * g.astype(dtype), a),
            acc,
            grads,
        )

    def total(acc):
        return acc

    def reset(acc):
        # A fresh zero, not `0 * acc`: 0 * NaN is NaN, and a NaN micro-batch
        # must not leak into the next window.
        return jax.tree.map(jnp.zeros_like, acc)

    return WindowAccumulator(init, add, total, reset)
