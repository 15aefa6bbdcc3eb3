"""Weights of micro-batches and devices: one validation, one safe ratio.

A weight says how much one gradient counts in a mean: the number of
examples or valid tokens behind it. Every weighted mean in the package (a
window of micro-batches, the devices of a mapped axis, the micro-batches of
one step) reads its weights through `scalar_weight`, forms each weighted
term through `weighted` and divides through `share`, so they agree on what
is accepted, on what a zero weight drops and on what an empty total means.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax._tree import unreduced_axes


def scalar_weight(weight: Any, caller: str) -> jax.Array:
    """Returns ``weight`` as a float32 scalar: 1 when None, NaN when negative.

    A negative weight has no meaning in a mean. Where it is concrete it is
    rejected here; under ``jax.jit`` a traced value cannot raise, so it
    becomes NaN, which makes the mean it enters NaN (loudly wrong) instead
    of silently cancelling other gradients.

    Args:
      weight: None, or a real scalar (Python number or 0-d array).
      caller: the public name to put in error messages.

    Raises:
      ValueError: if ``weight`` is not a real scalar, or is concretely < 0.
    """
    if weight is None:
        return jnp.ones([], jnp.float32)
    if np.ndim(weight) != 0:
        raise ValueError(
            f"{caller}: `weight` must be a scalar (the number of examples or "
            f"tokens behind this gradient), got shape {np.shape(weight)}. Under "
            "shard_map a weight sharded as P(axis_name) arrives as a shape-(1,) "
            "block: pass `weight[0]`."
        )
    dtype = jnp.result_type(weight)
    if not jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(
        dtype, jnp.complexfloating
    ):
        raise ValueError(
            f"{caller}: `weight` must be a real number >= 0, got dtype {dtype}."
        )
    if unreduced_axes(weight):
        # A partial sum over devices: its sign (and its value) is known only
        # after the reduction, so it is not checked here.
        return weight.astype(jnp.float32)
    if not isinstance(weight, jax.core.Tracer) and float(np.asarray(weight)) < 0:
        raise ValueError(
            f"{caller}: `weight` must be >= 0 (a count of examples or tokens), "
            f"got {float(np.asarray(weight))}."
        )
    weight = jnp.asarray(weight, jnp.float32)
    return jnp.where(weight < 0, jnp.nan, weight)


def weighted(weight: jax.Array, term: Any) -> jax.Array:
    """``weight * term``, and 0 where ``weight`` is 0, even if ``term`` is NaN.

    A zero weight means "counts for nothing": a skipped micro-batch, or a
    micro-batch or device of padding only, whose mean loss is 0 / 0 and
    whose gradient is NaN. As a plain product it would count that NaN
    (``0 * NaN`` is NaN); the select drops it. The product's dtype is JAX's
    promotion of the operands' (cast ``weight`` first to keep ``term``'s).
    """
    product = weight * term
    return jnp.where(weight != 0, product, jnp.zeros_like(product))


def share(weight: jax.Array, total: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns ``(weight / total, total != 0)`` with 0 where the total is 0.

    A zero total (nothing was seen) gives a zero share, not 0/0 = NaN; the
    double ``where`` also keeps the untaken branch's NaN out of gradients
    taken through this function. A NaN total (a negative weight, see
    `scalar_weight`) stays NaN.
    """
    has_weight = total != 0
    safe_total = jnp.where(has_weight, total, 1.0)
    return jnp.where(has_weight, weight / safe_total, 0.0), has_weight
