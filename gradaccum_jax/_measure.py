"""Measured bytes: what a state holds, what a compiled program all-reduces.

Memory and communication claims are checked on real objects: the arrays of
a state, the collectives of compiled HLO, never a formula.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np


def state_nbytes(tree: Any) -> int:
    """Returns the bytes actually held by the array leaves of a pytree.

    Use it to report memory measured on a real state (e.g. an optimizer
    state) rather than computed from a formula. Works on arrays,
    ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``, without
    allocating anything) and PRNG key arrays; non-array leaves (Python
    numbers, None, MaskedNode) count as 0. For an array sharded or
    replicated over several devices, this is the global array's size, i.e.
    ``n_devices`` times one device's copy for a pmapped state.

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


_HLO_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip
_HLO_ALL_REDUCE = re.compile(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(")
_HLO_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def all_reduce_nbytes(compiled: Any) -> int:
    """Returns the bytes reduced by all all-reduce ops of compiled HLO.

    Counts each all-reduce instruction's buffer once (its result shape,
    equal to its operand shape), per instruction in the text, not per
    execution: an all-reduce inside a loop body counts once. A ring
    all-reduce moves about twice that per device, the same factor for every
    dtype, so ratios between programs are ratios of bytes on the wire.
    Other collectives (all-gather, reduce-scatter) are not counted.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()`` (or ``jax.pmap``), or
        the text of its ``as_text()``.

    Returns:
      The sum over all-reduce ops of the number of bytes of their buffers.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    total = 0
    for match in _HLO_ALL_REDUCE.finditer(text):
        for dtype, dims in _HLO_SHAPE.findall(match.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            if dtype not in _HLO_DTYPE_BYTES:
                raise ValueError(
                    f"all_reduce_nbytes: unknown HLO element type {dtype!r} in "
                    f"{match.group(0)!r}."
                )
            total += size * _HLO_DTYPE_BYTES[dtype]
    return total
