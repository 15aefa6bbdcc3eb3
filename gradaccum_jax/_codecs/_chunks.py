"""A leaf's chunks and the top-k payload of each: cut, selected, packed, decoded.

`codecs.topk` sends, per chunk of a leaf (or of one device's shard of it),
the ``k`` entries of largest magnitude, each value quantized against a
scale per chunk (float32), in one of two forms, whichever is smaller:

- the entries: each one's index in its chunk and its value's code, packed
  in one uint16 (or uint32) word (a low density). A code has no zero, so
  a chunk with fewer nonzero elements than ``k`` repeats its last nonzero
  entry in the slots left, and the decoding drops a repeated entry;
- a map of the chunk: every element's code, 0 where nothing was sent,
  several to a uint32 word in base ``2 levels + 1`` (`_packing.pack`: 20
  to a word in one bit, the sign alone). At a high density the map is the
  smaller: 1.6 bits an element, against 16 bits an entry.

This module is that payload; `_topk` decides which collective carries it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _placement, _tree
from gradaccum_jax._codecs import _packing
from gradaccum_jax._codecs._protocol import zero_from

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


def levels(bits: int) -> int:
    """The magnitudes a value's code can take in ``bits`` (with its sign)."""
    return 2 ** (bits - 1)


def entry_dtype(chunk: int, bits: int) -> Any:
    """The word holding an index and its code (its index alone for 32 bits)."""
    used = max(chunk - 1, 1).bit_length() + (0 if bits == 32 else bits)
    return jnp.uint16 if used <= 16 else jnp.uint32


def _entries_nbytes(chunk: int, k: int, bits: int) -> int:
    """The bytes of one chunk's ``k`` entries."""
    entry = np.dtype(entry_dtype(chunk, bits)).itemsize
    return k * (entry + (4 if bits == 32 else 0))


def _map_words(chunk: int, bits: int) -> int:
    """The uint32 words of one chunk's map (see `_pack_map`)."""
    return _packing.packed_words(chunk, 1, levels(bits))


def as_map(chunk: int, k: int, bits: int) -> bool:
    """Whether a chunk's payload is its map (fewer bytes than its entries;
    never for float32 values)."""
    return bits != 32 and 4 * _map_words(chunk, bits) < _entries_nbytes(chunk, k, bits)


def payload_nbytes(layout: Chunks, bits: int) -> int:
    """The bytes of one payload of the chunks of ``layout``."""
    chunk, k = layout.chunk, layout.k
    if as_map(chunk, k, bits):
        return layout.chunks * (4 * _map_words(chunk, bits) + 4)
    return layout.chunks * (_entries_nbytes(chunk, k, bits) + 4)


def encode(rows: jax.Array, k: int, bits: int) -> tuple[Any, jax.Array, jax.Array]:
    """The payload of ``rows`` (chunks): the entries or map of each chunk
    (see `as_map`) and its scale, and what says which entries were sent
    (`selection`).

    A chunk's scale is its sent entries' largest magnitude, the top level.
    In one bit, where every sent value is the sign times the scale, it is
    ``sum(v**2) / sum(|v|)`` over the sent entries ``v``: the level at which
    what stays of them (``v - sent``) is orthogonal to them, so that none
    of their direction is left behind. Their mean magnitude, the level
    nearest to them, leaves part of each large entry unsent on every call:
    with error feedback on constant inputs the residual then grew like
    ``sqrt(T)`` (the running mean's error falling 2x from T = 64 to 256,
    against 4x with this level; `tests/test_codecs.py`).
    """
    chunk = rows.shape[1]
    chosen = selection(rows, k, bits)
    finite = jnp.all(jnp.isfinite(rows), axis=1)
    if as_map(chunk, k, bits):
        mask = _sent_mask(rows, chosen, k, bits)
        scale = _scale(jnp.where(mask, jnp.abs(rows), 0.0), bits)
        # A chunk holding a NaN or an infinity gets an infinite scale,
        # which every device sees in the gathered scales.
        scale = jnp.where(finite, scale, jnp.inf)
        return _pack_map(rows, mask, scale, bits), scale, chosen
    values = jnp.take_along_axis(rows, chosen, axis=1)
    scale = jnp.where(finite, _scale(jnp.abs(values), bits), jnp.inf)
    dtype = entry_dtype(chunk, bits)
    if bits == 32:
        return (chosen.astype(dtype), values), scale, chosen
    top = levels(bits)
    magnitude = _magnitude(values, scale, top)
    code = (magnitude.astype(jnp.uint32) - 1) | jnp.where(values < 0, top, 0).astype(
        jnp.uint32
    )
    index_bits = max(chunk - 1, 1).bit_length()
    # Built in the entry's own dtype: a narrowing convert after the
    # packing is moved by XLA after the all-gather, which then carries
    # uint32 words (twice the bytes of uint16 entries).
    words = chosen.astype(dtype) | (code.astype(dtype) << index_bits)
    return _repeat_for_zeros(words, values), scale, chosen


def _repeat_for_zeros(words: jax.Array, values: jax.Array) -> jax.Array:
    """Each chunk's entry ``words`` with those of zero ``values`` replaced
    by the chunk's last nonzero entry, which `decode_entries` drops.

    A TopK lists a chunk's entries by decreasing magnitude, so where a
    chunk has fewer nonzero elements than ``k`` its zeros come last, each
    one a repeat of the entry before it. Sent as they are, they would
    decode to the lowest level (a code has no zero): in the devices' mean,
    an element no device had moved by a step of the chunk's scale.
    """
    nonzero = values != 0
    last = jnp.maximum(jnp.sum(nonzero, axis=1, keepdims=True) - 1, 0)
    return jnp.where(nonzero, words, jnp.take_along_axis(words, last, axis=1))


def selection(rows: jax.Array, k: int, bits: int) -> jax.Array:
    """What says which ``k`` entries of each chunk of ``rows`` are sent,
    computed where ``rows`` lies: their int32 indices (``chunks x k``), or
    for a map each chunk's ``k``-th largest magnitude (``chunks x 1``),
    the nonzero entries at or above it sent (at the same magnitude as the
    ``k``-th, every one goes; a map sends no zero).

    A map needs no indices: the index and value buffers of half the leaf
    at a density of 50 % are not made, and its ``k``-th magnitude is found
    by bisection (`_kth_magnitudes`), not by a TopK.

    XLA's partitioner cannot split a TopK over a sharded batch dimension:
    it gathers the operand whole to every device first (in ``diloco``'s
    map over stacked workers, each worker's every chunk, over the workers'
    and the ``model`` axes). A sort would be split, but is much slower
    than the TopK on CPU.
    """
    if as_map(rows.shape[1], k, bits):
        find, out = _kth_magnitudes, jax.ShapeDtypeStruct((1,), rows.dtype)
    else:
        find, out = _top_k_indices, jax.ShapeDtypeStruct((k,), jnp.int32)
    return _placement.on_each_device(
        lambda x: _by_batches(lambda some: find(some, k), x, out), rows
    )


def _top_k_indices(rows: jax.Array, k: int) -> jax.Array:
    """The indices of each row's ``k`` largest magnitudes (a TopK)."""
    return jax.lax.top_k(jnp.abs(rows), k)[1]


def _kth_magnitudes(rows: jax.Array, k: int) -> jax.Array:
    """Each row's ``k``-th largest magnitude, exactly, by bisection.

    The bit patterns of non-negative float32s order as their values do
    (as int32), so 31 halvings of ``[0, +inf]``'s patterns, each counting
    a row's magnitudes at or above the middle, end at the largest pattern
    with at least ``k`` magnitudes at or above it: the ``k``-th. Each
    halving is one pass over the rows that XLA fuses (a compare and a
    row sum), far faster than a TopK of half of each row
    (``benchmarks/bench_codecs.py select`` times both).
    """
    patterns = jax.lax.bitcast_convert_type(jnp.abs(rows), jnp.int32)
    chunks = rows.shape[0]
    # count(>= low) >= k always (every pattern is >= 0); count(>= high) < k
    # where the row is finite (high is +inf's pattern plus one, the first
    # NaN's: a row holding NaNs gets an infinite scale whatever is found).
    # Inside a shard_map the bounds must vary as the rows do: the loop's
    # carry keeps its type.
    varying = _tree.varying_axes(patterns)
    low = _tree.vary_over(jnp.zeros((chunks, 1), jnp.int32), varying)
    high = _tree.vary_over(jnp.full((chunks, 1), 0x7F800001, jnp.int32), varying)

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        enough = jnp.sum(patterns >= middle, axis=1, keepdims=True) >= k
        return jnp.where(enough, middle, low), jnp.where(enough, high, middle)

    low, _ = jax.lax.fori_loop(0, 31, halve, (low, high))
    return jax.lax.bitcast_convert_type(low, rows.dtype)


def _scale(magnitudes: jax.Array, bits: int) -> jax.Array:
    """Each chunk's scale from its sent magnitudes (0 where not sent)."""
    if bits != 1:
        return jnp.max(magnitudes, axis=1)
    level = _orthogonal_level(magnitudes)
    # The squares of a finite chunk may overflow float32 (an entry above
    # ~1.8e19): that chunk's level is taken again on its magnitudes over
    # their largest (finite where every entry is; inf marks a NaN or an
    # infinity, see `encode`).
    largest = jnp.max(magnitudes, axis=1, keepdims=True)
    safe = jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)
    rescaled = _orthogonal_level(magnitudes / safe) * safe[:, 0]
    return jnp.where(jnp.isfinite(level), level, rescaled)


def _orthogonal_level(magnitudes: jax.Array) -> jax.Array:
    """``sum(v**2) / sum(|v|)`` of each chunk's sent magnitudes (0 where
    none is sent)."""
    norm_1 = jnp.sum(magnitudes, axis=1)
    safe = jnp.where(norm_1 > 0, norm_1, 1.0)
    return jnp.sum(jnp.square(magnitudes), axis=1) / safe


def _magnitude(values: jax.Array, scale: jax.Array, levels: int) -> jax.Array:
    """Each value's magnitude in levels of its chunk's ``scale``, in [1,
    ``levels``] (rounded to nearest), as floats."""
    safe = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1.0)[:, None]
    return jnp.clip(jnp.round(jnp.abs(values) / safe * levels), 1, levels)


def _sent_mask(rows: jax.Array, chosen: jax.Array, k: int, bits: int) -> jax.Array:
    """True where `selection` ``chosen`` says an entry of ``rows`` was sent."""
    chunks, chunk = rows.shape
    if as_map(chunk, k, bits):
        picked = jnp.abs(rows) >= chosen
    else:
        picked = _picked_bits(chunks, chunk, chosen)
    return picked & (rows != 0)  # no zero is sent (see `_repeat_for_zeros`)


def _picked_bits(chunks: int, chunk: int, chosen: jax.Array) -> jax.Array:
    """True at each chunk's ``chosen`` entries, from one bit an element.

    A byte an element (a scatter of True into a boolean mask) was a buffer
    of a quarter of the leaf's float32 bytes, and its zeros another: the
    bits are set by a scatter of powers of two into uint32 words (a chunk's
    TopK indices are distinct, so adding them sets each bit once), and
    read where they are used, fused into the residual's pass.
    """
    words = -(-chunk // 32)
    powers = jnp.left_shift(jnp.uint32(1), (chosen % 32).astype(jnp.uint32))
    packed = (
        jnp.zeros((chunks, words), jnp.uint32)
        .at[jnp.arange(chunks)[:, None], chosen // 32]
        .add(powers)
    )
    spread = (packed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return spread.reshape(chunks, words * 32)[:, :chunk] == 1


def _pack_map(
    rows: jax.Array, mask: jax.Array, scale: jax.Array, bits: int
) -> jax.Array:
    """Each chunk's map: every element's code in ``[-levels, levels]``
    (the sign times the magnitude's level where ``mask`` says it is sent,
    else 0), packed in uint32 words chunk by chunk."""
    top = levels(bits)
    code = jnp.where(rows < 0, -1, 1) * _magnitude(rows, scale, top).astype(jnp.int32)
    code = jnp.where(mask, code, 0)
    return jax.vmap(lambda c: _packing.pack(c, 1, top))(code)


def _decode_map(words: jax.Array, scale: jax.Array, chunk: int, bits: int) -> jax.Array:
    """One device's chunks (``chunks x chunk`` float32) from its maps."""
    top = levels(bits)
    code = jax.vmap(lambda w: _packing.unpack_sums(w, (chunk,), 1, top))(words)
    return code.astype(jnp.float32) / top * scale[:, None]


def _value(
    negative: jax.Array, magnitude: jax.Array, scale: jax.Array, levels: int
) -> jax.Array:
    """The value a code stands for: its sign, magnitude and chunk's scale."""
    sign = jnp.where(negative, -1.0, 1.0)
    return sign * (magnitude / levels) * scale[..., None]


def sent(
    rows: jax.Array, chosen: jax.Array, scale: jax.Array, k: int, bits: int
) -> jax.Array:
    """The payload of ``rows`` as the others decode it, shaped like ``rows``
    (``chosen``: what `encode` returned of its `selection`).

    Written as a select over ``rows`` (the decoded value where an entry
    was sent, else 0), not as a scatter into zeros: the caller's residual
    ``x - sent`` then fuses into one pass with no float buffer the size of
    the leaf, only the mask of sent entries (a byte an element, or for a
    map, none). Each sent value is the float the decoding gives.
    """
    if bits == 32:
        decoded = rows
    else:
        top = levels(bits)
        decoded = _value(rows < 0, _magnitude(rows, scale, top), scale, top)
    return jnp.where(_sent_mask(rows, chosen, k, bits), decoded, 0.0)


# Chunks whose magnitudes one search (a TopK, a bisection) reads at a
# time: 4 MiB of float32 at chunks of 4096.
TOP_K_ROWS = 256


def _by_batches(find: Any, rows: jax.Array, out: jax.ShapeDtypeStruct) -> jax.Array:
    """``find(rows)`` on one device, `TOP_K_ROWS` chunks at a time
    (``out``: what ``find`` gives per chunk).

    A search reads its operand whole: the magnitudes of a whole leaf (or
    their bit patterns) would be a buffer the leaf's size, those of a few
    chunks are a few MiB. The last batch starts early enough to end at the
    last chunk (it recomputes a few rows, to the same result).
    """
    chunks = rows.shape[0]
    if chunks <= TOP_K_ROWS:
        return find(rows)

    def batch(i, found):
        start = jnp.minimum(i * TOP_K_ROWS, chunks - TOP_K_ROWS)
        some = jax.lax.dynamic_slice_in_dim(rows, start, TOP_K_ROWS)
        return jax.lax.dynamic_update_slice_in_dim(found, find(some), start, 0)

    batches = -(-chunks // TOP_K_ROWS)
    found = jnp.zeros((chunks, *out.shape), out.dtype)
    found = _tree.vary_over(found, _tree.varying_axes(rows))  # a loop carry
    return jax.lax.fori_loop(0, batches, batch, found)


def decode_entries(
    entries: Any, scales: jax.Array, chunk: int, bits: int
) -> tuple[jax.Array, jax.Array]:
    """The int32 indices and float32 values of entries (any leading axes
    before the chunks' ``k`` entries).

    A repeated entry (`_repeat_for_zeros`) gets an index past the chunk's
    end, its own, which the scatters that add or place the entries drop
    (``mode="drop"``): every index stays distinct within a chunk.
    """
    if bits == 32:
        index, values = entries
        return index.astype(jnp.int32), values
    top = levels(bits)
    index_bits = max(chunk - 1, 1).bit_length()
    words = entries.astype(jnp.uint32)
    index = (words & ((1 << index_bits) - 1)).astype(jnp.int32)
    repeated = jnp.concatenate(
        [jnp.zeros_like(words[..., :1], jnp.bool_), words[..., 1:] == words[..., :-1]],
        axis=-1,
    )
    index = jnp.where(repeated, chunk + jnp.arange(words.shape[-1]), index)
    code = words >> index_bits
    magnitude = ((code & (top - 1)) + 1).astype(jnp.float32)
    return index, _value((code & top) != 0, magnitude, scales, top)


def add_payloads(
    total: jax.Array,
    payloads: Any,
    scales: jax.Array,
    k: int,
    bits: int,
    include: jax.Array | None = None,
) -> jax.Array:
    """``total`` (chunks) plus ``n`` devices' payloads of ``k`` entries a
    chunk (stacked on a leading axis), added device by device, in order,
    so that every device computes the same floats; ``include``: a bool per
    device, False to leave that device's out.

    A loop over the devices, not unrolled: XLA would decode every
    device's payload before adding any (8 float32 copies of the leaf for
    maps with 8 devices; for entries, every device's indices and values at
    once, a quarter of the leaf). A device's entries are distinct within a
    chunk, so each element is added to in the devices' order (a dense add
    of each device's scattered payload did the same in two passes over the
    leaf per device).
    """
    n, chunk = scales.shape[0], total.shape[1]
    rows = jnp.arange(total.shape[0])[:, None]

    def add(d, total):
        payload = jax.tree.map(lambda a: a[d], payloads)
        if as_map(chunk, k, bits):
            values = _decode_map(payload, scales[d], chunk, bits)
            if include is not None:
                values = jnp.where(include[d], values, 0.0)
            return total + values
        index, values = decode_entries(payload, scales[d], chunk, bits)
        if include is not None:
            values = jnp.where(include[d], values, 0.0)
        return total.at[rows, index].add(values, unique_indices=True, mode="drop")

    varying = frozenset().union(
        *map(_tree.varying_axes, jax.tree.leaves((payloads, scales)))
    )
    return jax.lax.fori_loop(0, n, add, _tree.vary_over(total, varying))


def decode_sum(
    payloads: Any, scales: jax.Array, chunk: int, k: int, bits: int
) -> jax.Array:
    """The chunks of the sum of ``n`` devices' payloads (stacked on a
    leading axis)."""
    return add_payloads(
        own_zeros((scales.shape[1], chunk), scales), payloads, scales, k, bits
    )


def own_zeros(shape: tuple[int, ...], tie: jax.Array) -> jax.Array:
    """float32 zeros of ``shape`` that depend on ``tie`` (a leaf's own
    array): the starting point of a sum added to in place.

    Plain zeros of one shape are one value to XLA, which makes them once
    for every leaf of that shape and then copies them for each leaf it
    adds to in place: the copies and the shared zeros, a buffer more than
    the sums."""
    return jnp.broadcast_to(zero_from(tie), shape)


def decode_shards(
    payloads: Any, scales: jax.Array, chunk: int, k: int, bits: int
) -> jax.Array:
    """The chunks of a leaf whose ``n`` shards are the ``n`` devices'
    payloads (stacked on a leading axis, in the shards' order)."""
    n, chunks = scales.shape
    if as_map(chunk, k, bits):
        words = payloads.reshape(n * chunks, -1)
        return _decode_map(words, scales.reshape(-1), chunk, bits)
    index, values = decode_entries(payloads, scales, chunk, bits)
    index, values = (a.reshape(n * chunks, -1) for a in (index, values))
    zeros = own_zeros((n * chunks, chunk), scales)
    rows = jnp.arange(n * chunks)[:, None]
    return zeros.at[rows, index].set(values, unique_indices=True, mode="drop")
