"""Measured bytes: what a state holds, what a compiled program communicates.

Memory and communication claims are checked on real objects: the arrays of
a state, the collectives of compiled HLO, never a formula.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

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


_HLO_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
}  # fmt: skip
_HLO_ALL_REDUCE = re.compile(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(")
_HLO_SHAPE = re.compile(r"\b([a-z][a-z\d]*)\[([\d,]*)\]")
# Replica groups of one device each, listed ({{0}}, {{0},{1}}) or as an
# iota ([4,1]<=[4]): such an all-reduce moves no byte between devices.
_HLO_SINGLE_DEVICE_GROUPS = re.compile(
    r"replica_groups=(?:\{\{\d+\}(?:,\{\d+\})*\}|\[\d+,1\]<=)"
)


def _moves_data(instruction: str) -> bool:
    """Whether an all-reduce instruction's groups hold two or more devices."""
    return not _HLO_SINGLE_DEVICE_GROUPS.search(instruction)


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
        or one trip: once per emitted window) or ``"other"`` (a called
        computation, e.g. a cond branch).
    """

    nbytes: int
    operands: int
    place: str


_HLO_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_HLO_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


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
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    bodies = set(_HLO_WHILE_BODY.findall(text))
    found = []  # (computation, is_entry, nbytes, operands)
    computation, is_entry = None, False
    for line in text.splitlines():
        header = _HLO_COMPUTATION.match(line)
        if header and not line.startswith(" "):
            computation, is_entry = header.group(2), bool(header.group(1))
            continue
        match = _HLO_ALL_REDUCE.search(line)
        if match and _moves_data(line):
            shapes = _HLO_SHAPE.findall(match.group(1))
            found.append(
                (computation, is_entry, _shapes_nbytes(shapes, line), len(shapes))
            )
    return [
        AllReduce(
            nbytes,
            operands,
            "entry" if is_entry else "while-body" if name in bodies else "other",
        )
        for name, is_entry, nbytes, operands in found
    ]


def _shapes_nbytes(shapes: list[tuple[str, str]], where: str) -> int:
    total = 0
    for dtype, dims in shapes:
        if dtype not in _HLO_DTYPE_BYTES:
            raise ValueError(
                f"unknown HLO element type {dtype!r} in {where!r}: the byte "
                f"counts know {sorted(_HLO_DTYPE_BYTES)}."
            )
        total += (
            int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            * (_HLO_DTYPE_BYTES[dtype])
        )
    return total
