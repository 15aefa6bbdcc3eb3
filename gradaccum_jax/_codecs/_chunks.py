"""A leaf's chunks and the top-k payload of each: cut, selected, packed, decoded.

`codecs.topk` sends, per chunk of a leaf (or of one device's shard of it),
the ``k`` entries of largest magnitude: each entry's index in its chunk and
its value, quantized against the chunk's largest magnitude, packed in one
uint16 (or uint32) word, plus one float32 scale per chunk. This module is
that payload; `_topk` decides which collective carries it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _placement

# Elements per chunk (SparseLoCo's); 12 index bits.
CHUNK = 4096


class Chunks(NamedTuple):
    """How a leaf is cut: ``chunks`` rows of ``chunk`` elements (the last
    padded with zeros), ``k`` entries sent per chunk."""

    chunks: int
    chunk: int
    k: int


def leaf_layout(size: int, density: float) -> Chunks:
    """The chunks of a leaf of ``size`` elements."""
    chunk = min(CHUNK, size)
    return Chunks(-(-size // chunk), chunk, entries_per_chunk(chunk, density))


def shard_layout(size: int, density: float, num_devices: int) -> Chunks:
    """The chunks of one of ``num_devices`` shards of a leaf of ``size``
    elements (every shard cut alike, the last ones padded with zeros)."""
    shard = -(-size // num_devices)
    chunk = min(CHUNK, shard)
    return Chunks(-(-shard // chunk), chunk, entries_per_chunk(chunk, density))


def entries_per_chunk(chunk: int, density: float) -> int:
    """``k``: ``density`` of a chunk, rounded up, at least one entry."""
    return min(chunk, max(1, math.ceil(density * chunk)))


def entry_dtype(chunk: int, bits: int) -> Any:
    """The word holding an index and its code (its index alone for 32 bits)."""
    used = max(chunk - 1, 1).bit_length() + (0 if bits == 32 else bits)
    return jnp.uint16 if used <= 16 else jnp.uint32


def payload_nbytes(layout: Chunks, bits: int) -> int:
    """The bytes of one payload of the chunks of ``layout``."""
    entry = np.dtype(entry_dtype(layout.chunk, bits)).itemsize
    entry += 4 if bits == 32 else 0
    return layout.chunks * (layout.k * entry + 4)


def encode(rows: jax.Array, k: int, bits: int) -> tuple[Any, jax.Array, jax.Array]:
    """The payload of ``rows`` (chunks), ``entries`` and ``scales`` per
    chunk, and the int32 indices of the entries sent in each chunk."""
    chunk = rows.shape[1]
    index = _top_k_indices(rows, k)
    values = jnp.take_along_axis(rows, index, axis=1)
    scale = jnp.max(jnp.abs(values), axis=1)
    # A chunk holding a NaN or an infinity gets an infinite scale, which
    # every device sees in the gathered scales.
    scale = jnp.where(jnp.all(jnp.isfinite(rows), axis=1), scale, jnp.inf)
    dtype = entry_dtype(chunk, bits)
    if bits == 32:
        return (index.astype(dtype), values), scale, index
    levels = 2 ** (bits - 1)
    magnitude = _magnitude(values, scale, levels)
    code = (magnitude.astype(jnp.uint32) - 1) | jnp.where(values < 0, levels, 0).astype(
        jnp.uint32
    )
    index_bits = max(chunk - 1, 1).bit_length()
    # Built in the entry's own dtype: a narrowing convert after the
    # packing is moved by XLA after the all-gather, which then carries
    # uint32 words (twice the bytes of uint16 entries).
    return index.astype(dtype) | (code.astype(dtype) << index_bits), scale, index


def _magnitude(values: jax.Array, scale: jax.Array, levels: int) -> jax.Array:
    """Each value's magnitude in levels of its chunk's ``scale``, in [1,
    ``levels``] (rounded to nearest), as floats."""
    safe = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1.0)[:, None]
    return jnp.clip(jnp.round(jnp.abs(values) / safe * levels), 1, levels)


def _value(
    negative: jax.Array, magnitude: jax.Array, scale: jax.Array, levels: int
) -> jax.Array:
    """The value a code stands for: its sign, magnitude and chunk's scale."""
    sign = jnp.where(negative, -1.0, 1.0)
    return sign * (magnitude / levels) * scale[..., None]


def sent(rows: jax.Array, index: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    """The payload of ``rows`` as the others decode it, shaped like ``rows``.

    Written as a select over ``rows`` (the decoded value where an entry
    was sent, else 0), not as a scatter into zeros: the caller's residual
    ``x - sent`` then fuses into one pass with no float buffer the size of
    the leaf, only the mask of sent entries (a byte an element). Each sent
    value is the float `decode_entries` gives.
    """
    chunks, chunk = rows.shape
    mask = (
        jnp.zeros((chunks, chunk), jnp.bool_)
        .at[jnp.arange(chunks)[:, None], index]
        .set(True, unique_indices=True)
    )
    if bits == 32:
        decoded = rows
    else:
        levels = 2 ** (bits - 1)
        decoded = _value(rows < 0, _magnitude(rows, scale, levels), scale, levels)
    return jnp.where(mask, decoded, 0.0)


def _top_k_indices(rows: jax.Array, k: int) -> jax.Array:
    """The indices of each chunk's (row's) ``k`` entries of largest
    magnitude, computed where ``rows`` lies.

    XLA's partitioner cannot split a TopK over a sharded batch dimension:
    it gathers the operand whole to every device first (in ``diloco``'s
    map over stacked workers, each worker's every chunk, over the workers'
    and the ``model`` axes: 1 MiB per 512 KiB leaf on ``data`` 2 x
    ``model`` 4). A sort would be split, but is some 40 times slower than
    the TopK on CPU.
    """
    return _placement.on_each_device(lambda x: _rows_top_k(x, k), rows)


# Chunks whose magnitudes one TopK reads at a time: 4 MiB of float32 at
# chunks of 4096.
TOP_K_ROWS = 256


def _rows_top_k(rows: jax.Array, k: int) -> jax.Array:
    """`_top_k_indices` on one device, `TOP_K_ROWS` chunks at a time.

    The TopK reads its operand from memory: the magnitudes of a whole leaf
    would be a float32 buffer the leaf's size, those of a few chunks are
    a few MiB. The last batch starts early enough to end at the last chunk
    (it recomputes a few rows, to the same indices).
    """
    chunks = rows.shape[0]
    if chunks <= TOP_K_ROWS:
        return jax.lax.top_k(jnp.abs(rows), k)[1]

    def batch(i, index):
        start = jnp.minimum(i * TOP_K_ROWS, chunks - TOP_K_ROWS)
        some = jax.lax.dynamic_slice_in_dim(rows, start, TOP_K_ROWS)
        top = jax.lax.top_k(jnp.abs(some), k)[1]
        return jax.lax.dynamic_update_slice_in_dim(index, top, start, 0)

    batches = -(-chunks // TOP_K_ROWS)
    return jax.lax.fori_loop(0, batches, batch, jnp.zeros((chunks, k), jnp.int32))


def decode_entries(
    entries: Any, scales: jax.Array, chunk: int, bits: int
) -> tuple[jax.Array, jax.Array]:
    """The int32 indices and float32 values of payloads (any leading axes
    before the chunks' ``k`` entries)."""
    if bits == 32:
        index, values = entries
        return index.astype(jnp.int32), values
    levels = 2 ** (bits - 1)
    index_bits = max(chunk - 1, 1).bit_length()
    words = entries.astype(jnp.uint32)
    index = (words & ((1 << index_bits) - 1)).astype(jnp.int32)
    code = words >> index_bits
    magnitude = ((code & (levels - 1)) + 1).astype(jnp.float32)
    return index, _value((code & levels) != 0, magnitude, scales, levels)


def scatter_add(total: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """``total`` (chunks) plus ``n`` devices' entries (stacked on a leading
    axis), added device by device, in order, so that every device computes
    the same floats: a device's indices are distinct within a chunk, so
    each element is added to in the devices' order (a dense add of each
    device's scattered payload did the same in two passes over the leaf
    per device)."""
    rows = jnp.arange(total.shape[0])[:, None]
    for d in range(values.shape[0]):
        total = total.at[rows, index[d]].add(values[d], unique_indices=True)
    return total


def decode_sum(entries: Any, scales: jax.Array, chunk: int, bits: int) -> jax.Array:
    """The chunks of the sum of ``n`` devices' payloads (stacked on a
    leading axis)."""
    index, values = decode_entries(entries, scales, chunk, bits)
    zeros = jnp.zeros((scales.shape[1], chunk), jnp.float32)
    return scatter_add(zeros, index, values)


def decode_shards(entries: Any, scales: jax.Array, chunk: int, bits: int) -> jax.Array:
    """The chunks of a leaf whose ``n`` shards are the ``n`` devices'
    payloads (stacked on a leading axis, in the shards' order)."""
    index, values = decode_entries(entries, scales, chunk, bits)
    n, chunks = scales.shape
    index, values = (a.reshape(n * chunks, -1) for a in (index, values))
    zeros = jnp.zeros((n * chunks, chunk), jnp.float32)
    rows = jnp.arange(n * chunks)[:, None]
    return zeros.at[rows, index].set(values, unique_indices=True)
