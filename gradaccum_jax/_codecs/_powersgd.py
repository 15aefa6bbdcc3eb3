"""`codecs.powersgd`: a warm-started rank-r approximation of each matrix.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), one step of power
iteration per call: with ``M_d`` each device's input as a matrix and ``Q``
the previous call's right factor (the same on every device),

    P = orth(sum_d M_d Q)        (all-reduce 1: every leaf's P in one)
    Q = sum_d M_d^T P            (all-reduce 2)
    sum_d M_d ~ P Q^T

and ``Q`` is kept for the next call (the warm start that makes one
iteration per step enough). Device d's share of the sum is ``P (M_d^T
P)^T``; error feedback keeps ``M_d`` less that.

A leaf of rank 2 is one matrix; a leaf of rank 3 or more is a scanned
stack of layers (its leading axis), each layer's ``shape[1] x
prod(shape[2:])`` matrix compressed on its own, never mixed with the
others. Vectors, and matrices whose factors would not be smaller than
themselves, are summed exactly in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks
from gradaccum_jax._codecs._protocol import Codec, CodecSum, Wire
from gradaccum_jax._ternary import _blocks
from gradaccum_jax._ternary._leaves import DEFAULT_MIN_SIZE


def matrices(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(layers, rows, columns)`` of a leaf of rank >= 2: one matrix per
    layer of a scanned leaf (rank >= 3: its leading axis)."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    return shape[0], shape[1], int(np.prod(shape[2:], dtype=np.int64))


def powersgd(rank: int, *, min_size: int = DEFAULT_MIN_SIZE) -> Codec:
    """Each matrix sent as a rank-``rank`` product, warm-started, per layer.

    Two small all-reduces per call (the left factors ``P``, then the right
    ``Q``, of every leaf in one each): ``rank * (rows + columns)`` floats
    per matrix instead of ``rows * columns``. A leaf of rank >= 3 is a
    scanned stack of layers, its leading axis: each layer's matrix (its
    other axes, the second against the rest) is compressed on its own.
    Vectors, leaves under ``min_size`` elements and matrices whose factors
    are no smaller than themselves are summed exactly in float32. Low rank
    is biased: use it with error feedback, which keeps what the factors
    miss. A leaf split over another mesh axis (tensor parallelism) is
    gathered whole over that axis on each device before it is factored.

    Example:

    >>> from gradaccum_jax import codecs
    >>> codecs.powersgd(rank=4)
    powersgd(rank=4, min_size=256)

    Args:
      rank: the rank of the approximation, an integer >= 1.
      min_size: leaves with fewer elements are summed exactly in float32.

    Returns:
      A `gradaccum_jax.extend.Codec` whose state is ``Q`` per leaf.
    """
    rank = _checks.positive_int("rank", rank)
    min_size = _checks.nonnegative_int("min_size", min_size)

    def compresses(shape: tuple[int, ...]) -> bool:
        if len(shape) < 2 or int(np.prod(shape, dtype=np.int64)) < max(min_size, 1):
            return False
        _, rows, columns = matrices(shape)
        return rank * (rows + columns) < rows * columns

    def init(shapes: list[jax.ShapeDtypeStruct], key: jax.Array) -> list[jax.Array]:
        base = jax.random.key(jnp.asarray(key)[0])
        factors = []
        for j, shape in enumerate(shapes):
            layers, _, columns = matrices(tuple(shape.shape))
            factors.append(
                jax.random.normal(
                    jax.random.fold_in(base, j), (layers, columns, rank), jnp.float32
                )
            )
        return factors

    def codec_sum(inputs: list[jax.Array], state: Any, key: jax.Array, wire: Wire):
        del key
        wholes = [
            _whole(x, split) for x, split in zip(inputs, wire.splits, strict=True)
        ]
        stacks = [m.reshape(matrices(m.shape)) for m in wholes]
        p_sums = _psum_list(
            [
                jnp.einsum("lmc,lcr->lmr", m, q)
                for m, q in zip(stacks, state, strict=True)
            ],
            wire.axis,
        )
        ps = [jnp.linalg.qr(p)[0] for p in p_sums]
        own_qs = [
            jnp.einsum("lmc,lmr->lcr", m, p) for m, p in zip(stacks, ps, strict=True)
        ]
        q_sums = _psum_list(own_qs, wire.axis)
        sums, sent, finite = [], [], []
        for j, x in enumerate(inputs):
            shape = wholes[j].shape
            approx = jnp.einsum("lmr,lcr->lmc", ps[j], q_sums[j]).reshape(shape)
            own = jnp.einsum("lmr,lcr->lmc", ps[j], own_qs[j]).reshape(shape)
            sums.append(_own_block(approx, x, wire.splits[j]))
            sent.append(_own_block(own, x, wire.splits[j]))
            finite.append(
                jnp.isfinite(jnp.sum(p_sums[j])) & jnp.isfinite(jnp.sum(q_sums[j]))
            )
        return CodecSum(sums, sent, finite, q_sums)

    return Codec(
        f"powersgd(rank={rank}, min_size={min_size})", compresses, init, codec_sum
    )


def _whole(block: jax.Array, split: _blocks.Split) -> jax.Array:
    """The whole leaf of which ``block`` is this device's block."""
    for dim, names in enumerate(split):
        if names is not None:
            block = jax.lax.all_gather(block, names, axis=dim, tiled=True)
    return block


def _own_block(whole: jax.Array, block: jax.Array, split: _blocks.Split) -> jax.Array:
    """This device's block of ``whole``, shaped like ``block``."""
    if not _blocks.axes_of(split):
        return whole
    offsets = _blocks.block_offsets(block.shape, split)
    return jax.lax.dynamic_slice(
        whole, [jnp.asarray(o, jnp.int32) for o in offsets], block.shape
    )


def _psum_list(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    return list(jax.lax.psum(values, axis)) if values else []
