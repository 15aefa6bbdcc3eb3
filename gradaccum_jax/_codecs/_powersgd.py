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
stack of layers (its leading axis), each layer's matrix compressed on
its own, never mixed with the others; with ``scanned=False``, one matrix
(an unscanned model's multi-axis kernel, such as attention's
``(d_model, heads, head_dim)``). A matrix of more than two axes is read
as its most square split into leading row axes and trailing column axes
(`column_axis`). Vectors, and matrices whose factors would not be
smaller than themselves, are summed exactly in float32.

With ``warmup=N`` the first N calls send every leaf's float32 sum and
leave ``Q`` as it was (PyTorch's ``start_powerSGD_iter``): the first
steps' gradients change fast, and the factors and the error-feedback
residual start on the slower ones that follow.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks, _tree
from gradaccum_jax._codecs._protocol import (
    Codec,
    CodecSum,
    Wire,
    at_least,
    made_after,
    made_now,
)
from gradaccum_jax._compression import _blocks
from gradaccum_jax._compression._leaves import DEFAULT_MIN_SIZE

# Calls a uint32 call counter numbers.
_COUNTER_LIMIT = 2**32


def _layered(shape: tuple[int, ...], scanned: bool) -> bool:
    """Whether ``shape``'s leading axis is a stack of layers."""
    return scanned and len(shape) >= 3


def column_axis(shape: tuple[int, ...], scanned: bool = True) -> int:
    """The first axis of a leaf of rank >= 2 that numbers its matrices'
    columns; the axes before it (after a scanned leaf's layer axis) number
    the rows.

    Of the ways to read the matrix axes as rows against columns, the most
    square one: the fewest floats in rank-r factors, ``r (rows + columns)``
    (ties: fewer row axes). It reads attention's ``(d_model, heads,
    head_dim)`` as ``d_model`` x ``heads * head_dim`` and its output
    projection ``(heads, head_dim, d_model)`` as ``heads * head_dim`` x
    ``d_model``, and a convolution's ``(kh, kw, c_in, c_out)`` as ``kh *
    kw * c_in`` x ``c_out``. Chosen from the whole leaf's shape: a device's
    block of a split leaf is read the same way.
    """
    first = 1 if _layered(shape, scanned) else 0
    axes = shape[first:]

    def factor_floats(at: int) -> tuple[int, int]:
        rows = int(np.prod(axes[:at], dtype=np.int64))
        return rows + int(np.prod(axes[at:], dtype=np.int64)), at

    return first + min(range(1, len(axes)), key=factor_floats)


def matrices(
    shape: tuple[int, ...], scanned: bool = True, columns_from: int | None = None
) -> tuple[int, int, int]:
    """``(layers, rows, columns)`` of a leaf of rank >= 2: one matrix per
    layer of a scanned leaf (rank >= 3, ``scanned``: its leading axis),
    else one matrix; its columns from axis ``columns_from`` on
    (`column_axis` of ``shape`` by default)."""
    at = column_axis(shape, scanned) if columns_from is None else columns_from
    first = 1 if _layered(shape, scanned) else 0
    return (
        shape[0] if first else 1,
        int(np.prod(shape[first:at], dtype=np.int64)),
        int(np.prod(shape[at:], dtype=np.int64)),
    )


def powersgd(
    rank: int,
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    warmup: int = 0,
    scanned: bool = True,
) -> Codec:
    """Each matrix sent as a rank-``rank`` product, warm-started, per layer.

    Two small all-reduces per call (the left factors ``P``, then the right
    ``Q``, of every leaf in one each): ``rank * (rows + columns)`` floats
    per matrix instead of ``rows * columns``. A leaf of rank >= 3 is a
    scanned stack of layers, its leading axis: each layer's matrix (its
    other axes) is compressed on its own. A model without scanned layers
    whose kernels have more than two axes (attention's ``(d_model, heads,
    head_dim)``) takes ``scanned=False``: such a leaf is one matrix (read
    as layers, a ``(32, 2, 16)`` kernel is 32 matrices of 2 x 16, which
    rank 1 barely compresses). Where a matrix has more than two axes, its
    leading axes are its rows and the others its columns, split where the
    matrix is most square (the fewest factor floats): ``(d_model, heads,
    head_dim)`` is ``d_model`` x ``heads * head_dim``, an output
    projection ``(heads, head_dim, d_model)`` is ``heads * head_dim`` x
    ``d_model``.
    Vectors, leaves under ``min_size`` elements and matrices whose factors
    are no smaller than themselves are summed exactly in float32. Low rank
    is biased: use it with error feedback, which keeps what the factors
    miss. A leaf split over another mesh axis (tensor parallelism, FSDP)
    is factored where it lies: each device multiplies its block, the
    products are summed over the blocks, and only the factors' blocks
    (``rank * rows`` or ``rank * columns`` floats) are gathered over the
    axes that split the rows (to orthogonalize ``P``) or the columns (to
    keep ``Q`` whole); a leaf split over a row axis other than its first,
    or over a column axis other than its first, is gathered whole.

    ``warmup`` calls first send the float32 sum of every leaf, one
    all-reduce, as PyTorch's PowerSGD hook does for its first
    ``start_powerSGD_iter`` steps: nothing is held back, and ``Q`` keeps
    its initial value until the first compressed call. The count is the
    codec state's call counter, so a restored state resumes it. The
    low-communication guide measures what a warm-up buys.

    Example:

    >>> from gradaccum_jax import codecs
    >>> codecs.powersgd(rank=4)
    powersgd(rank=4, min_size=256)

    Args:
      rank: the rank of the approximation, an integer >= 1.
      min_size: leaves with fewer elements are summed exactly in float32.
      warmup: how many first calls send the float32 sum instead, an
        integer in [0, 2**32 - 1].
      scanned: whether a leaf of rank >= 3 is a stack of layers on its
        leading axis (True) or one matrix (False).

    Returns:
      A `gradaccum_jax.extend.Codec` whose state is ``Q`` per leaf.
    """
    rank = _checks.positive_int("rank", rank)
    min_size = _checks.nonnegative_int("min_size", min_size)
    warmup = _checks.nonnegative_int("warmup", warmup)
    scanned = _checks.boolean("scanned", scanned)
    if warmup >= _COUNTER_LIMIT:
        raise ValueError(
            f"`warmup` must be an integer in [0, 2**32 - 1] (the state's call "
            f"counter is a uint32), got {warmup}."
        )

    def compresses(shape: tuple[int, ...]) -> bool:
        if len(shape) < 2 or not at_least(min_size)(shape):
            return False
        _, rows, columns = matrices(shape, scanned)
        return rank * (rows + columns) < rows * columns

    def init(shapes: list[jax.ShapeDtypeStruct], key: jax.Array) -> list[jax.Array]:
        base = jax.random.key(jnp.asarray(key)[0])
        factors = []
        for j, shape in enumerate(shapes):
            layers, _, columns = matrices(tuple(shape.shape), scanned)
            factors.append(
                jax.random.normal(
                    jax.random.fold_in(base, j), (layers, columns, rank), jnp.float32
                )
            )
        return factors

    def codec_sum(inputs: list[jax.Array], state: Any, key: jax.Array, wire: Wire):
        if not warmup:
            return _factored_sum(inputs, state, wire, scanned)
        # The counter is the same on every device: they all take one branch.
        warm = key[1] < jnp.uint32(warmup)
        out = _cond(
            warm,
            lambda: _float32_sum(inputs, state, wire),
            lambda: made_now(_factored_sum(inputs, state, wire, scanned)),
        )
        # A warm-up call sent the inputs themselves. They are chosen here,
        # out of the cond: inside a shard_map that does not check the
        # manual axes' types, nested in one that does, the inputs vary over
        # the outer axes and nothing can mark the factors' share so.
        sent = [jnp.where(warm, x, s) for x, s in zip(inputs, out.sent, strict=True)]
        return out._replace(sent=sent)

    return Codec(
        f"powersgd(rank={rank}, min_size={min_size}"
        + (f", warmup={warmup}" if warmup else "")
        + ("" if scanned else ", scanned=False")
        + ")",
        compresses,
        init,
        codec_sum,
    )


def _factored_sum(
    inputs: list[jax.Array], state: Any, wire: Wire, scanned: bool
) -> CodecSum:
    """One power iteration on every leaf's matrices: the module's scheme."""
    # Where each leaf's columns start, from its whole shape.
    ats = [
        column_axis(_whole_shape(x, split), scanned)
        for x, split in zip(inputs, wire.splits, strict=True)
    ]
    parts = [
        _matrix_split(x, split, scanned, at)
        for x, split, at in zip(inputs, wire.splits, ats, strict=True)
    ]
    stacks = [
        _whole(x, split).reshape(matrices(_whole_shape(x, split), scanned, at))
        if part is None
        else x.reshape(matrices(x.shape, scanned, at))
        for x, split, part, at in zip(inputs, wire.splits, parts, ats, strict=True)
    ]
    # Each block's product with its rows of Q, summed over the devices
    # and over the blocks of the matrix's columns in one all-reduce.
    qs = [
        _own_rows(q, m, part) for q, m, part in zip(state, stacks, parts, strict=True)
    ]
    p_sums = _grouped_psums(
        [jnp.einsum("lmc,lcr->lmr", m, q) for m, q in zip(stacks, qs, strict=True)],
        [_axes_with(wire.axis, part, "columns") for part in parts],
    )
    # Orthogonalized whole (its rows gathered: a factor, not the matrix).
    ps = [
        _own_p(jnp.linalg.qr(_gathered(p, part, "rows", 1))[0], m, part)
        for p, m, part in zip(p_sums, stacks, parts, strict=True)
    ]
    own_qs = _grouped_psums(
        [jnp.einsum("lmc,lmr->lcr", m, p) for m, p in zip(stacks, ps, strict=True)],
        [_axes_with((), part, "rows") for part in parts],
    )
    q_sums = _grouped_psums(own_qs, [wire.axis] * len(own_qs))
    sums, sent, new_state, finite = [], [], [], []
    for j, (x, split, part) in enumerate(zip(inputs, wire.splits, parts, strict=True)):

        def block(product: jax.Array, x=x, split=split, part=part) -> jax.Array:
            if part is None:  # factored whole: this device's block of it
                return _own_block(product.reshape(_whole_shape(x, split)), x, split)
            return product.reshape(x.shape)

        # The sum made after the residual (see `CodecSum.sums`): a product
        # the leaf's size, like this device's share.
        sums.append(
            lambda after, j=j, block=block: block(
                jnp.einsum("lmr,lcr->lmc", ps[j], made_after(q_sums[j], after))
            )
        )
        sent.append(block(jnp.einsum("lmr,lcr->lmc", ps[j], own_qs[j])))
        # Q whole again, the same on every device (a factor's blocks);
        # it holds every layer's, NaN where any block's input was.
        whole_q = _gathered(_gathered(q_sums[j], part, "columns", 1), part, "layers", 0)
        new_state.append(whole_q)
        finite.append(jnp.isfinite(jnp.sum(whole_q)))
    return CodecSum(sums, sent, finite, new_state)


def _cond(pred: jax.Array, first: Any, second: Any) -> Any:
    """``jax.lax.cond(pred, first, second)`` inside a ``shard_map`` too.

    There the branches' outputs must vary over the same manual axes (a
    psum's result varies over none, a device's own share over its axis):
    each output is marked (no data moves) as varying over the axes it
    varies over in either branch.
    """
    axes = jax.tree.map(
        lambda a, b: _tree.varying_axes(a) | _tree.varying_axes(b),
        jax.eval_shape(first),
        jax.eval_shape(second),
    )

    def typed(branch: Any) -> Any:
        return lambda: jax.tree.map(_tree.vary_over, branch(), axes)

    return jax.lax.cond(pred, typed(first), typed(second))


def _float32_sum(inputs: list[jax.Array], state: Any, wire: Wire) -> CodecSum:
    """Every input summed exactly in one float32 all-reduce (a warm-up call):
    ``Q`` as it was. Its ``sent`` are zeros: the caller puts the inputs
    there (nothing held back)."""
    sums = _blocks.psum_list(inputs, wire.axis)
    finite = []
    for total, split in zip(sums, wire.splits, strict=True):
        # A block's finiteness, agreed on over the axes that split its leaf.
        bad = jnp.logical_not(jnp.isfinite(jnp.sum(total))).astype(jnp.int32)
        axes = _blocks.axes_of(split)
        finite.append((jax.lax.psum(bad, axes) if axes else bad) == 0)
    return CodecSum(sums, [jnp.zeros_like(x) for x in inputs], finite, state)


class _MatrixSplit(NamedTuple):
    """How a block of a leaf splits its matrices (`matrices`): the mesh
    axes (a tuple, maybe empty) over its layers, rows and columns."""

    layers: tuple[str, ...]
    rows: tuple[str, ...]
    columns: tuple[str, ...]


def _matrix_split(
    block: jax.Array, split: _blocks.Split, scanned: bool, at: int
) -> _MatrixSplit | None:
    """How ``block`` splits its leaf's matrices, whose columns start at
    axis ``at``; None when an axis after the first of the rows or of the
    columns is split (they are not one range: the leaf is gathered whole)
    or when the leaf is whole."""
    if not _blocks.axes_of(split):
        return None
    parts = [
        _tree.entry_axes(part)
        for part in (*split, *(None,) * (block.ndim - len(split)))
    ]
    first = 1 if _layered(block.shape, scanned) else 0
    rows, columns = parts[first:at], parts[at:]
    if any(rows[1:]) or any(columns[1:]):
        return None
    return _MatrixSplit(parts[0] if first else (), rows[0], columns[0])


def _axes_with(axis: Any, part: _MatrixSplit | None, which: str) -> Any:
    """``axis`` (the devices' axis, or ``()``) with ``part``'s axes of
    ``which`` dimension of the matrices."""
    return (*_tree.entry_axes(axis), *(() if part is None else getattr(part, which)))


def _index(axes: tuple[str, ...]) -> jax.Array:
    """This device's block index over ``axes`` (row-major), 0 if none."""
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)


def _own_rows(q: jax.Array, m: jax.Array, part: _MatrixSplit | None) -> jax.Array:
    """The rows of the whole ``Q`` (layers, columns, rank) that multiply
    ``m``, this device's block of the matrices."""
    if part is None:
        return q
    layers, _, columns = m.shape
    start = (_index(part.layers) * layers, _index(part.columns) * columns, 0)
    return jax.lax.dynamic_slice(q, start, (layers, columns, q.shape[2]))


def _own_p(p: jax.Array, m: jax.Array, part: _MatrixSplit | None) -> jax.Array:
    """This device's rows of the whole orthogonalized ``P``."""
    if part is None:
        return p
    rows = m.shape[1]
    start = (0, _index(part.rows) * rows, 0)
    return jax.lax.dynamic_slice(p, start, (p.shape[0], rows, p.shape[2]))


def _gathered(factor: jax.Array, part: _MatrixSplit | None, which: str, dim: int):
    """``factor`` (a block of ``P`` or ``Q``) gathered over ``which``
    dimension's axes along ``dim``."""
    axes = () if part is None else getattr(part, which)
    if not axes:
        return factor
    return jax.lax.all_gather(factor, axes, axis=dim, tiled=True)


def _whole_shape(block: jax.Array, split: _blocks.Split) -> tuple[int, ...]:
    return _blocks.whole_shape(block.shape, split) if split else block.shape


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


def _grouped_psums(values: list[jax.Array], axes: list[Any]) -> list[jax.Array]:
    """Each value summed over its axes, those with the same axes in one
    (variadic) all-reduce."""
    out: list[Any] = [None] * len(values)
    for group in dict.fromkeys(axes):
        where = [i for i, a in enumerate(axes) if a == group]
        summed = [values[i] for i in where]
        if group:
            summed = _blocks.psum_list(summed, group)
        for i, value in zip(where, summed, strict=True):
            out[i] = value
    return out
