"""`codecs.topk`: the largest entries of each chunk, quantized, indices packed.

Each device sends, per chunk of `CHUNK` consecutive elements of a leaf,
its ``k = ceil(density * chunk)`` entries of largest magnitude (SparseLoCo,
arXiv 2508.15706; DeMo, arXiv 2411.19870): each entry's index in its chunk
and its value, quantized to ``bits`` against the chunk's largest magnitude,
packed together in one uint16 (or uint32) word, plus one float32 scale per
chunk. Sparse sums do not compose in an all-reduce (the devices' supports
differ), so the payloads are all-gathered and every device adds them up in
the same order; where the gather would move more bytes than a float32
all-reduce of the leaf (a high density, many devices), each device's
decoded entries are summed by that all-reduce instead. Error feedback keeps
everything that was not sent: the other entries, and the values' rounding.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks, _placement
from gradaccum_jax._codecs._protocol import Codec, CodecSum, Wire, at_least, no_state
from gradaccum_jax._ternary._leaves import DEFAULT_MIN_SIZE

# Elements per chunk (SparseLoCo's); 12 index bits.
CHUNK = 4096

_BITS = (2, 4, 8, 32)


def topk(density: float, bits: int = 2, *, min_size: int = DEFAULT_MIN_SIZE) -> Codec:
    """The top ``density`` of each chunk by magnitude, values in ``bits``.

    Per chunk of 4096 elements (a smaller leaf is one chunk) each device
    picks its ``ceil(density * 4096)`` entries of largest magnitude. A value
    is sent as its sign and a magnitude among ``2**(bits - 1)`` levels
    ``s * m / 2**(bits - 1)``, ``m = 1 .. 2**(bits - 1)``, ``s`` the chunk's
    largest (rounded to nearest: 2 bits send ``s / 2`` or ``s``); 32 bits
    send the float32 value. Index and code share one uint16 word where
    they fit (12 + 2 or 4 bits), else a uint32. The payloads are
    all-gathered (or summed densely by a float32 all-reduce where that
    moves fewer bytes). Top-k is biased: use it with error feedback, which
    keeps everything not sent.

    Example:

    >>> from gradaccum_jax import codecs
    >>> codecs.topk(0.01)
    topk(density=0.01, bits=2, min_size=256)

    Args:
      density: the fraction of each chunk sent, in (0, 1].
      bits: 2, 4, 8 or 32 per value.
      min_size: leaves with fewer elements are summed exactly in float32.

    Returns:
      A `gradaccum_jax.extend.Codec`.
    """
    if (
        isinstance(density, bool)
        or not isinstance(density, numbers.Real)
        or not 0 < density <= 1
    ):
        raise ValueError(f"`density` must be a number in (0, 1], got {density!r}.")
    bits = _checks.integer_in("bits", bits, _BITS)
    min_size = _checks.nonnegative_int("min_size", min_size)

    def codec_sum(inputs: list[jax.Array], state: Any, key: jax.Array, wire: Wire):
        del key
        encoded = [_encode(x, density, bits) for x in inputs]
        payloads = [(entries, scale) for entries, scale, _ in encoded]
        sent = [
            _sent(x, index, scale, density, bits)
            for (_, scale, index), x in zip(encoded, inputs, strict=True)
        ]
        gathered = {
            j: jax.lax.all_gather(p, wire.axis)
            for j, p in enumerate(payloads)
            if _gathers(inputs[j], density, bits, wire.num_devices)
        }
        dense = [j for j in range(len(inputs)) if j not in gathered]
        dense_sums = dict(
            zip(dense, _psum_list([sent[j] for j in dense], wire.axis), strict=True)
        )
        sums, finite = [], []
        for j, x in enumerate(inputs):
            if j in gathered:
                entries, scales = gathered[j]
                sums.append(
                    _placement.on_each_device(
                        lambda e, s, x=x: _decode(e, s, x, density, bits),
                        entries,
                        scales,
                    )
                )
                finite.append(jnp.all(jnp.isfinite(scales)))
            else:
                sums.append(dense_sums[j])
                finite.append(jnp.all(jnp.isfinite(dense_sums[j])))
        return CodecSum(sums, sent, finite, state)

    return Codec(
        f"topk(density={density}, bits={bits}, min_size={min_size})",
        at_least(min_size),
        no_state,
        codec_sum,
    )


def _layout(size: int, density: float) -> tuple[int, int, int]:
    """``(chunks, chunk, k)`` for a leaf of ``size`` elements."""
    chunk = min(CHUNK, size)
    return -(-size // chunk), chunk, min(chunk, max(1, math.ceil(density * chunk)))


def _entry_dtype(chunk: int, bits: int) -> Any:
    """The word holding an index and its code (its index alone for 32 bits)."""
    used = max(chunk - 1, 1).bit_length() + (0 if bits == 32 else bits)
    return jnp.uint16 if used <= 16 else jnp.uint32


def payload_nbytes(size: int, density: float, bits: int) -> int:
    """The bytes one device sends for a leaf of ``size`` elements."""
    chunks, chunk, k = _layout(size, density)
    entry = np.dtype(_entry_dtype(chunk, bits)).itemsize + (4 if bits == 32 else 0)
    return chunks * (k * entry + 4)


def _gathers(x: jax.Array, density: float, bits: int, num_devices: int) -> bool:
    """Whether gathering the payloads receives fewer bytes than a float32
    all-reduce of the leaf (ring estimates: ``(n - 1) payload`` against
    ``2 (n - 1) / n * 4 size``)."""
    gather = (num_devices - 1) * payload_nbytes(x.size, density, bits)
    return gather < 2 * (num_devices - 1) / num_devices * 4 * x.size


def _chunked(x: jax.Array, density: float) -> jax.Array:
    """``x`` flat, padded with zeros to whole chunks, as rows of a chunk."""
    chunks, chunk, _ = _layout(x.size, density)
    return jnp.pad(x.reshape(-1), (0, chunks * chunk - x.size)).reshape(chunks, chunk)


def _encode(
    x: jax.Array, density: float, bits: int
) -> tuple[Any, jax.Array, jax.Array]:
    """This device's payload, ``entries`` and ``scales`` per chunk, and the
    int32 indices of the entries it sent in each chunk."""
    _, chunk, k = _layout(x.size, density)
    flat = _chunked(x, density)
    index = _top_k_indices(flat, k)
    values = jnp.take_along_axis(flat, index, axis=1)
    scale = jnp.max(jnp.abs(values), axis=1)
    # A chunk holding a NaN or an infinity gets an infinite scale, which
    # every device sees in the gathered scales.
    scale = jnp.where(jnp.all(jnp.isfinite(flat), axis=1), scale, jnp.inf)
    dtype = _entry_dtype(chunk, bits)
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


def _sent(
    x: jax.Array, index: jax.Array, scale: jax.Array, density: float, bits: int
) -> jax.Array:
    """This device's payload as the others decode it, shaped like ``x``.

    Written as a select over ``x``'s chunks (the decoded value where an
    entry was sent, else 0), not as a scatter into zeros: the caller's
    residual ``x - sent`` then fuses into one pass with no float buffer
    the size of the leaf, only the mask of sent entries (a byte an
    element). Each sent value is the float `_decode` adds up.
    """
    chunks, chunk, _ = _layout(x.size, density)
    flat = _chunked(x, density)
    rows = jnp.arange(chunks)[:, None]
    mask = (
        jnp.zeros((chunks, chunk), jnp.bool_)
        .at[rows, index]
        .set(True, unique_indices=True)
    )
    if bits == 32:
        decoded = flat
    else:
        levels = 2 ** (bits - 1)
        decoded = _value(flat < 0, _magnitude(flat, scale, levels), scale, levels)
    return jnp.where(mask, decoded, 0.0).reshape(-1)[: x.size].reshape(x.shape)


def _top_k_indices(flat: jax.Array, k: int) -> jax.Array:
    """The indices of each chunk's (row's) ``k`` entries of largest
    magnitude, computed where ``flat`` lies.

    XLA's partitioner cannot split a TopK over a sharded batch dimension:
    it gathers the operand whole to every device first (in ``diloco``'s
    map over stacked workers, each worker's every chunk, over the workers'
    and the ``model`` axes: 1 MiB per 512 KiB leaf on ``data`` 2 x
    ``model`` 4). A sort would be split, but is some 40 times slower than
    the TopK on CPU.
    """
    return _placement.on_each_device(lambda x: _rows_top_k(x, k), flat)


# Chunks whose magnitudes one TopK reads at a time: 4 MiB of float32 at
# chunks of 4096.
_TOP_K_ROWS = 256


def _rows_top_k(flat: jax.Array, k: int) -> jax.Array:
    """`_top_k_indices` on one device, `_TOP_K_ROWS` chunks at a time.

    The TopK reads its operand from memory: the magnitudes of a whole leaf
    would be a float32 buffer the leaf's size, those of a few chunks are
    a few MiB. The last batch starts early enough to end at the last chunk
    (it recomputes a few rows, to the same indices).
    """
    chunks = flat.shape[0]
    if chunks <= _TOP_K_ROWS:
        return jax.lax.top_k(jnp.abs(flat), k)[1]

    def batch(i, index):
        start = jnp.minimum(i * _TOP_K_ROWS, chunks - _TOP_K_ROWS)
        rows = jax.lax.dynamic_slice_in_dim(flat, start, _TOP_K_ROWS)
        top = jax.lax.top_k(jnp.abs(rows), k)[1]
        return jax.lax.dynamic_update_slice_in_dim(index, top, start, 0)

    batches = -(-chunks // _TOP_K_ROWS)
    return jax.lax.fori_loop(0, batches, batch, jnp.zeros((chunks, k), jnp.int32))


def _decode(
    entries: Any, scales: jax.Array, like: jax.Array, density: float, bits: int
) -> jax.Array:
    """The dense sum of ``n`` devices' payloads (stacked on a leading axis),
    shaped like ``like``; added device by device, in order, so that every
    device computes the same float sums."""
    chunks, chunk, k = _layout(like.size, density)
    if bits == 32:
        index, values = entries
        index = index.astype(jnp.int32)
    else:
        levels = 2 ** (bits - 1)
        index_bits = max(chunk - 1, 1).bit_length()
        words = entries.astype(jnp.uint32)
        index = (words & ((1 << index_bits) - 1)).astype(jnp.int32)
        code = words >> index_bits
        magnitude = ((code & (levels - 1)) + 1).astype(jnp.float32)
        values = _value((code & levels) != 0, magnitude, scales, levels)
    rows = jnp.arange(chunks)[:, None]
    total = jnp.zeros((chunks, chunk), jnp.float32)
    # One scatter-add per device, in order, into the sum itself: a device's
    # indices are distinct within a chunk, so each element is added to in
    # the devices' order, the same floats everywhere (a dense add of each
    # device's scattered payload did the same in two passes over the leaf
    # per device).
    for d in range(values.shape[0]):
        total = total.at[rows, index[d]].add(values[d], unique_indices=True)
    return total.reshape(-1)[: like.size].reshape(like.shape)


def _psum_list(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    return list(jax.lax.psum(values, axis)) if values else []
