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

from gradaccum_jax import _checks, _weights


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
      dtype: floating dtype of the sum (``accumulator_dtype``). A dtype
        narrower than float32 keeps a running mean instead (see
        `RunningMean`).

    Returns:
      A `WindowAccumulator` whose state is a tree shaped like the params
      (a `RunningMean` for a dtype narrower than float32).
    """
    dtype = _checks.float_dtype("dtype", dtype)
    if dtype.itemsize < 4:
        return _running_mean_accumulator(dtype)

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


class RunningMean(NamedTuple):
    """A low-precision window: its weighted mean and its float32 total weight.

    Attributes:
      mean: ``sum_i w_i g_i / sum_i w_i`` per parameter, in the accumulator
        dtype (zeros for an empty window).
      weight: ``sum_i w_i``, a float32 scalar.
    """

    mean: Any
    weight: jax.Array


def _running_mean_accumulator(dtype: jnp.dtype) -> WindowAccumulator:
    """A window kept as a running weighted mean in ``dtype``.

    A sum in float16 overflows at 65504 (80 micro-batches of 1000), and one
    in bfloat16 stops growing once it is 256 times a term (8 mantissa bits):
    the mean of 512 ones comes out as 0.5. A mean stays within the range of
    the gradients and is updated as ``m + (w / W) (g - m)`` in float32, with
    ``W`` the float32 total, so a constant gradient is kept exactly and each
    micro-step rounds once, as optax's running mean does (measured in
    ``benchmarks/bench_low_precision.py``).
    """

    def init(params):
        return RunningMean(
            optax.tree.zeros_like(params, dtype=dtype), jnp.zeros([], jnp.float32)
        )

    def add(acc, grads, weight):
        _checks.same_structure(
            grads,
            acc.mean,
            "gradients",
            "the accumulator (built from the params at init)",
        )
        total = acc.weight + weight
        # w / W in float32: a weight (e.g. 70000 tokens) may not fit dtype.
        share, _ = _weights.share(weight, total)

        def step(m, g):
            m32 = m.astype(jnp.float32)
            new = m32 + share * (g.astype(jnp.float32) - m32)
            # As in the sum: a select, so a zero weight drops NaN gradients.
            return jnp.where(weight != 0, new.astype(dtype), m)

        return RunningMean(jax.tree.map(step, acc.mean, grads), total)

    def total(acc):
        # The sum in float32: in dtype it would overflow (float16).
        return jax.tree.map(lambda m: m.astype(jnp.float32) * acc.weight, acc.mean)

    def reset(acc):
        return RunningMean(
            jax.tree.map(jnp.zeros_like, acc.mean), jnp.zeros_like(acc.weight)
        )

    return WindowAccumulator(init, add, total, reset)
