"""Integer codes summed over devices exactly, several per uint32 word.

Each device's code ``c`` in ``[-L, L]`` is sent as the digit ``c + L`` in
``[0, 2L]`` of a base ``B = 2Ln + 1`` number held in a uint32 word. Over n
devices one digit sums to at most ``2Ln < B``, so digits never carry into
each other and one integer psum adds all of them at once, exactly; a word
holds the k digits with ``B**k < 2**32``. Ternary codes (L = 1) over 8
devices: 7 per word; int4 codes (L = 7): 4; int8 codes (L = 127): 2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree
from gradaccum_jax._compression import _blocks


def digits_per_word(num_devices: int, levels: int) -> int:
    """How many base-(2 levels n + 1) digits a uint32 word holds."""
    base, count = 2 * levels * num_devices + 1, 0
    while base ** (count + 1) < 2**32:
        count += 1
    return count


def packed_sum(
    codes: list[jax.Array], axis: Any, num_devices: int, levels: int
) -> list[jax.Array]:
    """Sums each array of integer codes in ``[-levels, levels]`` over ``axis``.

    Returns their int32 sums. Each array is packed on its own and all the
    words go in one variadic all-reduce: a concatenation would make the
    packing (into which XLA fuses the codes' computation) find which array
    each word belongs to, a slower step. Codes split over other mesh axes by
    explicit sharding are packed where they lie (`_on_own_blocks`).
    """
    if not codes:
        return []
    if digits_per_word(num_devices, levels) < 2:  # too many devices: int32 sums
        return _blocks.psum_list([c.astype(jnp.int32) for c in codes], axis)

    def packed(codes):
        words = _blocks.psum_list([pack(c, num_devices, levels) for c in codes], axis)
        return [
            unpack_sums(leaf_words, c.shape, num_devices, levels)
            for leaf_words, c in zip(words, codes, strict=True)
        ]

    return _on_own_blocks(packed, codes)


def _on_own_blocks(fn, arrays: list[jax.Array]) -> list[jax.Array]:
    """``fn(arrays)`` with each array seen as the block its device holds.

    Packing reshapes the codes, and a reshape cannot keep an arbitrary split
    of an array (JAX rejects it on Explicit axes; on Auto ones XLA moves the
    codes between devices to lay them out). Run in a ``shard_map`` manual
    over the mesh axes the arrays are explicitly split over, each device
    packs, sums and unpacks its own block: the codes keep their split.
    """
    specs = [P(*_tree.partitions(array)) for array in arrays]
    split_axes = _tree.mesh_axes_in(tuple(part for spec in specs for part in spec))
    if not split_axes:
        return fn(arrays)
    return jax.shard_map(
        fn, in_specs=(specs,), out_specs=specs, axis_names=set(split_axes)
    )(arrays)


# Row lengths tried for `_plane_view`, longest first.
_ROW_LENGTHS = (1024, 256, 64, 16, 1)


def _plane_view(size: int, per_word: int) -> tuple[int, int]:
    """``(rows, columns)``: the 2-D view of ``size`` codes that `pack` packs.

    The longest row length in `_ROW_LENGTHS` that divides ``size`` and
    leaves at least 16 rows per digit, so that padding the rows to a
    multiple of ``per_word`` adds less than 1/16 to the words.
    """
    for columns in _ROW_LENGTHS:
        if size % columns == 0 and size // columns >= 16 * per_word:
            return size // columns, columns
    return size, 1


def packed_words(size: int, num_devices: int, levels: int) -> int:
    """How many uint32 words `pack` makes of ``size`` codes."""
    per_word = digits_per_word(num_devices, levels)
    rows, columns = _plane_view(size, per_word)
    return -(-rows // per_word) * columns


def pack(codes: jax.Array, num_devices: int, levels: int) -> jax.Array:
    """Integer codes as base-(2 levels n + 1) digits, packed in uint32 words.

    Returns flat words. The codes are viewed as rows (`_plane_view`), the
    rows padded with code 0 to ``per_word * planes`` and cut into
    ``per_word`` planes of ``planes`` rows; digit j of a word is the code at
    the same place in plane j. Each digit is then a contiguous block of
    codes: packing consecutive codes into a word instead makes every digit a
    strided gather, which keeps XLA:CPU from vectorizing the packing.
    """
    per_word = digits_per_word(num_devices, levels)
    base = 2 * levels * num_devices + 1
    rows, columns = _plane_view(codes.size, per_word)
    planes = -(-rows // per_word)
    digits = jnp.pad(
        codes.reshape(rows, columns), ((0, planes * per_word - rows), (0, 0))
    )
    digits = (digits.astype(jnp.int32) + levels).astype(jnp.uint32)
    digits = digits.reshape(per_word, planes, columns)
    # Horner's rule, unrolled: an elementwise pass, not a reduction.
    words = digits[per_word - 1]
    for j in range(per_word - 2, -1, -1):
        words = words * jnp.uint32(base) + digits[j]
    return words.reshape(-1)


def unpack_sums(
    words: jax.Array, shape: tuple[int, ...], num_devices: int, levels: int
) -> jax.Array:
    """The int32 code sums, shaped ``shape``, held in psum-ed `pack` words."""
    per_word = digits_per_word(num_devices, levels)
    base = 2 * levels * num_devices + 1
    rows, columns = _plane_view(int(np.prod(shape, dtype=np.int64)), per_word)
    words = words.reshape(-1, columns)
    # Every digit of every word at once, by its place's power (a
    # broadcast XLA computes in each pass that reads the sums): the digits
    # concatenated plane by plane were a uint32 buffer the leaf's size.
    powers = np.asarray([base**place for place in range(per_word)], np.uint32)
    digits = (words[None] // powers[:, None, None]) % jnp.uint32(base)
    sums = digits.reshape(-1, columns).astype(jnp.int32) - levels * num_devices
    return sums[:rows].reshape(shape)
