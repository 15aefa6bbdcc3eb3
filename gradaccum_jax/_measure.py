"""Measured bytes: what a state holds, what a compiled program all-reduces.

Memory and communication claims are checked on real objects: the arrays of
a state, the collectives of compiled HLO, never a formula. The all-reduces
are a view of `gradaccum_jax.measure.collectives`, the one reader of HLO.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from gradaccum_jax._collectives import collectives


def state_nbytes(tree: Any) -> int:
    """Returns the bytes actually held by the array leaves of a pytree.

    Use it to report memory measured on a real state (e.g. an optimizer
    state) rather than computed from a formula. Works on arrays,
    ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``, without
    allocating anything) and PRNG key arrays; non-array leaves (Python
    numbers, None, MaskedNode) count as 0. For an array sharded or
    replicated over several devices, this is the global array's size, i.e.
    ``n_devices`` times one device's copy for a pmapped state.

    Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from gradaccum_jax import measure
    >>> params = {"w": jnp.zeros((256, 4), jnp.bfloat16)}
    >>> adam = optax.adam(1e-3)
    >>> measure.state_nbytes(params), measure.state_nbytes(adam.init(params))
    (2048, 4100)
    >>> measure.state_nbytes(jax.eval_shape(adam.init, params))  # nothing allocated
    4100

    Args:
      tree: any pytree, e.g. an optax state.

    Returns:
      The total number of bytes of its array leaves.
    """

    def leaf_nbytes(leaf):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            return int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize
        return 0

    return sum(leaf_nbytes(leaf) for leaf in jax.tree.leaves(tree))


def all_reduce_nbytes(compiled: Any) -> int:
    """Returns the bytes reduced by all all-reduce ops of compiled HLO.

    Counts each all-reduce instruction's buffer once (its result shape,
    equal to its operand shape), per instruction in the text, not per
    execution: an all-reduce inside a loop body counts once. A ring
    all-reduce moves about twice that per device, the same factor for every
    dtype, so ratios between programs are ratios of bytes on the wire.
    Other collectives (all-gather, reduce-scatter) are not counted, nor
    all-reduces over groups of one device (see `all_reduces`).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from gradaccum_jax import measure
    >>> mean = jax.pmap(lambda x: jax.lax.pmean(x, "data"), axis_name="data")
    >>> measure.all_reduce_nbytes(mean.lower(jnp.ones((8, 256))).compile())
    1024

    Args:
      compiled: ``jax.jit(f).lower(...).compile()`` (or ``jax.pmap``), or
        the text of its ``as_text()``.

    Returns:
      The sum over all-reduce ops of the number of bytes of their buffers.
    """
    return sum(reduction.nbytes for reduction in all_reduces(compiled))


class AllReduce(NamedTuple):
    """One all-reduce instruction of compiled HLO.

    Attributes:
      nbytes: bytes of its buffers (all operands of a fused tuple
        all-reduce together).
      operands: how many buffers it reduces (> 1 for a fused tuple one).
      place: ``"entry"`` (runs on every call), ``"while-body"`` (runs once
        per trip of a loop, e.g. the accumulators' emission, a loop of zero
        or one trip: once per emitted window) or ``"other"`` (a
        conditional's branch); `collectives`' ``place`` renamed.
    """

    nbytes: int
    operands: int
    place: str


# `collectives`' places, as `AllReduce` names them.
_PLACES = {"entry": "entry", "loop": "while-body", "branch": "other"}


def all_reduces(compiled: Any) -> list[AllReduce]:
    """Returns every all-reduce of compiled HLO with its size and place.

    Like `all_reduce_nbytes`, counts instructions in the text, not their
    executions; ``place`` tells which run on every call and which only
    inside a loop.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from gradaccum_jax import measure
    >>> mean = jax.pmap(lambda x: jax.lax.pmean(x, "data"), axis_name="data")
    >>> compiled = mean.lower(jnp.ones((8, 256))).compile()
    >>> [(op.nbytes, op.place) for op in measure.all_reduces(compiled)]
    [(1024, 'entry')]

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
      One `AllReduce` per all-reduce instruction, in program order; those
      whose replica groups are single devices (a one-device mesh axis)
      move nothing and are left out.
    """
    return [
        AllReduce(op.nbytes, len(op.shapes), _PLACES[op.place])
        for op in collectives(compiled)
        if op.kind == "all-reduce"
    ]
