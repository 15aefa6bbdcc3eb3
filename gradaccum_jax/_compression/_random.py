"""Counter-based random bits for the ternary transformations' stochastic rounding.

One mechanism serves `ternarize`, `ternary_average_across_devices` and
`ternary_accumulate`: every element's 32 random bits are a hash of
``(seed, step, leaf index, device index, element index)``. Nothing random is
generated sequentially, so the draws are computed inside the elementwise
pass that consumes them (XLA fuses the hash into the rounding), at a few
integer operations per element instead of threefry's 20 rounds.

- A state holds ``uint32[2] = (seed, step)``: plain arrays, checkpointable,
  and the step counter is all that makes the next step's draws new. The
  counter wraps after 2**32 steps (the draws then repeat).
- `stream` hashes ``(seed, step, leaf, device)`` into two 32-bit words
  ``(k0, k1)`` by chaining the mixer below twice from different constants,
  so two distinct streams share both words with probability ~2**-64.
- `bits` hashes each element index ``i`` as ``mix((i ^ k0) * PHI + k1)``,
  with ``mix`` Wellons' "lowbias32" (two multiply / xor-shift rounds, the
  32-bit integer hash with the lowest measured avalanche bias of its
  kind; https://nullprogram.com/blog/2018/07/31/). Within a stream the
  hash inputs are distinct, so draws never repeat; two streams feed the
  hash a common input only at index pairs fixed by both key words, which
  for n elements happens with probability ~n / 2**32 per pair of streams,
  at scattered indices (the xor with ``k0``), never for whole runs.

How many bits rounding uses, and the bias that leaves: a Bernoulli(p)
draw compares the top 24 bits with ``floor(p * 2**24)`` (`bernoulli`), so
``P(1) = floor(p * 2**24) / 2**24``: at most 2**-24 below ``p``, the
resolution of ``p`` itself as a float32 in [0.5, 1) (``jax.random.uniform``
has 2**-23). In integer arithmetic, exact: no float uniform is formed.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _tree
from gradaccum_jax._compression import _blocks

# Resolution of a Bernoulli draw: the top PROBABILITY_BITS bits of a hash.
PROBABILITY_BITS = 24
PROBABILITY_ONE = float(2**PROBABILITY_BITS)

# Elements a uint32 index can number.
_INDEX_LIMIT = 2**32
_PHI = np.uint32(0x9E3779B9)  # 2**32 / golden ratio, odd: a bijective multiply.
_STREAM_SALTS = (np.uint32(0x243F6A88), np.uint32(0x85A308D3))  # digits of pi


def mix(x: jax.Array) -> jax.Array:
    """Wellons' lowbias32 integer hash, a bijection of uint32 (elementwise)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def seed_state(seed: int) -> jax.Array:
    """The counter state ``uint32[2] = (seed, step 0)``."""
    return jnp.array([seed, 0], jnp.uint32)


def advance(state: jax.Array) -> jax.Array:
    """The next step's counter state (the step word plus one, wrapping)."""
    return state + jnp.array([0, 1], jnp.uint32)


def derive(state: jax.Array, index: Any) -> jax.Array:
    """A counter state of its own for ``index``: the seed word hashed with it.

    For users of one state that must not draw the same bits: the devices of
    a window, DiLoCo's fragments. The step word is kept, so they advance
    together; two indices (or an index and another seed) share a seed word
    with probability 2**-32.
    """
    state = jnp.asarray(state, jnp.uint32)
    seed = mix(mix(state[0] ^ _STREAM_SALTS[1]) ^ jnp.asarray(index, jnp.uint32))
    return jnp.stack([seed, state[1]])


def stream(state: jax.Array, leaf: int, device: Any = 0) -> jax.Array:
    """The two key words ``uint32[2]`` of one (seed, step, leaf, device) stream."""
    state = jnp.asarray(state, jnp.uint32)
    words = (state[0], state[1], jnp.uint32(leaf), jnp.asarray(device, jnp.uint32))
    keys = []
    for salt in _STREAM_SALTS:
        h = jnp.uint32(salt)
        for word in words:
            h = mix(h ^ word)
        keys.append(h)
    return jnp.stack(keys)


def stream_from_key(key: jax.Array) -> jax.Array:
    """A stream from a JAX PRNG key (typed or raw uint32 key data)."""
    if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    return jax.random.bits(key, (2,), jnp.uint32)


def bits(key: jax.Array, like: Any, split: _blocks.Split = _blocks.WHOLE) -> jax.Array:
    """32 random bits per element of ``like``, from a `stream` ``key``.

    ``like`` is an array, tracer or ``jax.ShapeDtypeStruct``: the bits take
    its shape and its explicit-sharding partitions, so that an FSDP leaf
    (``f32[64@data,8]``) gets bits sharded like itself, each device hashing
    only its own block. Elements are numbered by their global row-major
    index, so the bits do not depend on the sharding. Inside a
    ``shard_map`` manual over the axes that split the leaf, ``like`` is
    this device's block and ``split`` says how the leaf is split (see
    `_blocks`): its elements are numbered in the whole leaf all the same.

    A leaf of 2**32 elements or more (a stacked weight of a 70B-class
    model) outgrows a uint32 index: its leading dimensions, down to where
    fewer than 2**32 elements remain, select a stream of their own (their
    row-major index hashed into the second key word), and the trailing
    ones number the elements within it. Smaller leaves take the plain
    path, so their bits do not change.
    """
    whole = _blocks.whole_shape(tuple(like.shape), split)
    first = _first_indexed_dimension(whole)
    word = key[1]
    if first:  # 2**32 elements or more: a stream per leading index
        leading = element_index(like, key, split, dims=range(first))
        word = word ^ mix(leading ^ _STREAM_SALTS[0])
    index = element_index(like, key, split, dims=range(first, len(whole)))
    return mix((index ^ key[0]) * _PHI + word)


def _first_indexed_dimension(whole: tuple[int, ...]) -> int:
    """The first dimension from which the trailing ones hold fewer than
    2**32 elements (0 for a leaf of fewer than 2**32)."""
    first, count = len(whole), 1
    while first and count * whole[first - 1] < _INDEX_LIMIT:
        first -= 1
        count *= whole[first]
    if first == len(whole) and whole:
        raise ValueError(
            f"ternary codes: a leaf of shape {whole} has a dimension of "
            f"{whole[-1]} elements, 2**32 or more, which its random bits "
            "cannot number; split that dimension in two (reshape)."
        )
    return first


def element_index(
    like: Any,
    tie: jax.Array,
    split: _blocks.Split = _blocks.WHOLE,
    dims: Any = None,
) -> jax.Array:
    """The row-major index of each element of ``like``, uint32, sharded like it.

    Over ``dims`` (all by default; a range of consecutive dimensions): the
    index of the element's position in those dimensions alone, which must
    hold fewer than 2**32 positions (`bits` picks them).

    A sum of one iota per dimension rather than ``iota(size).reshape``: a
    reshape cannot keep a partitioned dimension, and each device then builds
    only its own block of indices (XLA fuses the sum into its consumer).

    The strides and a block's offsets are made to depend on ``tie`` (the
    stream's key words). Computed from the shape and the device alone, the
    indices depend on nothing a loop carries, and XLA hoists them out of
    the loop that draws the bits (a window's emission, DiLoCo's sync, each
    of which runs on some calls only): a uint32 array the size of the leaf,
    then written on every call, whether the loop runs or not (the offsets
    of the blocks of a tensor-parallel leaf, untied, did the same). Tied to
    the key, they are computed in the loop, fused into the rounding.

    A block of a leaf split as ``split`` numbers its elements from its
    offsets in the whole leaf, with the whole leaf's strides.
    """
    shape = tuple(like.shape)
    dims = range(len(shape)) if dims is None else dims
    whole = _blocks.whole_shape(shape, split)
    offsets = _blocks.block_offsets(shape, split)
    sharding = _tree.explicit_sharding(like)
    if all(whole[dim] <= 1 for dim in dims):  # a single position
        return jnp.zeros(shape, jnp.uint32, out_sharding=sharding)
    # 0, written so that XLA cannot fold it: it folds ``key * 0``,
    # ``key ^ key``, and constants passed through an optimization barrier.
    zero = jnp.minimum(tie[0], jnp.uint32(0))
    terms, stride = [], 1
    for dim in reversed(dims):
        if whole[dim] > 1:
            iota = jax.lax.broadcasted_iota(
                jnp.uint32, shape, dim, out_sharding=sharding
            )
            terms.append((iota + (offsets[dim] + zero)) * (jnp.uint32(stride) + zero))
        stride *= whole[dim]
    return functools.reduce(jnp.add, terms)


def threshold(probability: jax.Array) -> jax.Array:
    """``floor(p * 2**24)`` as int32, for p in [0, 1] (see `bernoulli`)."""
    return (probability * PROBABILITY_ONE).astype(jnp.int32)


def bernoulli(random_bits: jax.Array, threshold_: jax.Array) -> jax.Array:
    """True with probability ``threshold / 2**24`` (exactly), per element.

    ``threshold_`` is `threshold` of a probability; the top 24 bits of
    ``random_bits`` are compared with it.
    """
    top = (random_bits >> (32 - PROBABILITY_BITS)).astype(jnp.int32)
    return top < threshold_


def with_own_streams(state: Any, index: int) -> Any:
    """``state`` with each random stream in it derived for ``index``.

    One reduction's states used side by side (DiLoCo's fragments, each
    reduced with the same ``outer_reduction``) would otherwise start from
    the same seed and step, and draw alike. A state node (a NamedTuple)
    that draws random bits says how to give it a stream of its own, a
    ``with_own_stream(index)`` method (`CodecState`, `TernaryState`); any
    other node is returned as it is.
    """

    def has_stream(node: Any) -> bool:
        return isinstance(node, tuple) and hasattr(node, "with_own_stream")

    return jax.tree.map(
        lambda node: node.with_own_stream(index) if has_stream(node) else node,
        state,
        is_leaf=has_stream,
    )
