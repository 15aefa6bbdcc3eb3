"""`codecs.topk`: the largest entries of each chunk, quantized, indices packed.

Each device sends, per chunk of 4096 consecutive elements of a leaf, its
``k = ceil(density * chunk)`` entries of largest magnitude (SparseLoCo,
arXiv 2508.15706; DeMo, arXiv 2411.19870): each entry's index in its chunk
and its value, quantized to ``bits`` against a scale per chunk, packed
together in one uint16 (or uint32) word, or, at a density where that is
smaller, a map of the whole chunk's codes (the payloads of `_chunks`).
Error feedback keeps everything that was not sent: the other entries, and
the values' rounding.

Sparse sums do not compose in an all-reduce (the devices' supports
differ). Two collectives sum them:

- ``"all_gather"``: the payloads are all-gathered and every device adds
  them up in the same order. The sum is exact over what was sent; each
  device receives ``n - 1`` payloads.
- ``"reduce_scatter"`` (a sparse reduce-scatter, as Ok-Topk, Li and
  Hoefler 2022): the leaf is cut into ``n`` shards, one per device, its
  owner. Each device sends each owner the top-k of its shard (an
  all-to-all); the owner adds them to its own input there, taken whole,
  selects the top-k of that sum (at a density of its own) and the owners'
  selections are all-gathered. About two payloads received per device,
  whatever ``n``. What an owner does not send of its shard's sum stays in
  its own residual (it is part of the owner's share: see `_owners_sum`),
  so error feedback still loses nothing.

Where either would move more bytes than a float32 all-reduce of the leaf
(a high density, many devices for ``"all_gather"``), each device's decoded
entries are summed by that all-reduce instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks, _placement
from gradaccum_jax._codecs import _chunks
from gradaccum_jax._codecs._protocol import (
    Codec,
    CodecSum,
    Wire,
    as_rows,
    at_least,
    from_rows,
    no_state,
)
from gradaccum_jax._compression import _blocks
from gradaccum_jax._compression._leaves import DEFAULT_MIN_SIZE

_BITS = (1, 2, 4, 8, 32)
_COLLECTIVES = ("all_gather", "reduce_scatter")


def topk(
    density: float,
    bits: int = 2,
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    collective: str = "all_gather",
    owner_density: float | None = None,
) -> Codec:
    """The top ``density`` of each chunk by magnitude, values in ``bits``.

    Per chunk of 4096 elements (a smaller leaf is one chunk) each device
    picks its ``ceil(density * 4096)`` entries of largest magnitude. A value
    is sent as its sign and a magnitude among ``2**(bits - 1)`` levels
    ``s * m / 2**(bits - 1)``, ``m = 1 .. 2**(bits - 1)``, ``s`` the chunk's
    largest (rounded to nearest: 2 bits send ``s / 2`` or ``s``); 32 bits
    send the float32 value. One bit sends the sign alone, every value of a
    chunk at one level, ``sum(v**2) / sum(|v|)`` over its sent entries
    ``v`` (what stays of them is orthogonal to them: none of their
    direction waits in the residual). Index and code share one uint16 word
    where they fit (12 + 1 to 4 bits), else a uint32. No zero is sent: a
    chunk with fewer nonzero elements than ``k`` sends those (a code has
    no zero; the slots left repeat its last entry, which the decoding
    drops). Where it is smaller,
    a chunk goes as a map instead: every element's code, 0 where nothing
    was sent, packed in base ``2**bits + 1`` (20 to a uint32 word in one
    bit: 1.6 bits an element whatever the density, against 16 bits an
    entry; in 2, 4 and 8 bits, 13, 7 and 3 to a word), and its entries
    are the nonzero ones at or above its ``k``-th magnitude (every tie
    goes). Top-k is biased: use it with error feedback, which keeps
    everything not sent.

    ``collective`` says how the devices' entries are summed:

    - ``"all_gather"`` (default): every device's payload is all-gathered
      and added up on every device, exactly. Each device receives ``n - 1``
      payloads over ``n`` devices: the bytes grow with the devices.
    - ``"reduce_scatter"``: each of the ``n`` devices owns ``1 / n`` of
      each leaf (its chunks are cut within the shard, so a shard of fewer
      than 4096 elements is one chunk). Each device sends every owner the
      top ``density`` of its shard (an all-to-all); the owner adds them
      to its own input there, selects the top ``owner_density`` of that
      sum and the owners' selections are all-gathered: each device
      receives ``(n - 1) / n`` of the ``n`` shards' payloads twice, as in
      an all-reduce of a payload, whatever ``n``. The sum is selected
      twice: what an owner does not send of its shard's sum is kept in
      that owner's residual, for its next call.

    Either falls back to a float32 all-reduce of the sent entries for a
    leaf where that receives fewer bytes (a high density).

    Example:

    >>> from gradaccum_jax import codecs
    >>> codecs.topk(0.01)
    topk(density=0.01, bits=2, min_size=256)
    >>> codecs.topk(0.035, collective="reduce_scatter")
    topk(density=0.035, bits=2, min_size=256, collective='reduce_scatter')
    >>> codecs.topk(0.5, bits=1, collective="reduce_scatter")
    topk(density=0.5, bits=1, min_size=256, collective='reduce_scatter')

    Args:
      density: the fraction of each chunk a device sends, in (0, 1].
      bits: 1, 2, 4, 8 or 32 per value.
      min_size: leaves with fewer elements are summed exactly in float32.
      collective: ``"all_gather"`` or ``"reduce_scatter"``, as above.
      owner_density: with ``"reduce_scatter"``, the fraction of each chunk
        of its shard's sum an owner sends, in (0, 1] (default
        ``density``). The sum of ``n`` devices' entries holds up to ``n``
        times as many: a larger share sends more of it for the bytes of
        the second hop alone.

    Returns:
      A `gradaccum_jax.extend.Codec`.
    """
    density = _checks.fraction("density", density)
    bits = _checks.integer_in("bits", bits, _BITS)
    min_size = _checks.nonnegative_int("min_size", min_size)
    collective = _checks.one_of("collective", collective, _COLLECTIVES)
    if owner_density is not None:
        owner_density = _checks.fraction("owner_density", owner_density)
        if collective != "reduce_scatter":
            raise ValueError(
                "`owner_density` is the owners' share of their shards' sums, "
                "which only collective='reduce_scatter' selects; got "
                f"owner_density={owner_density!r} with collective={collective!r}."
            )
    selection = _Selection(
        density,
        bits,
        collective,
        density if owner_density is None else owner_density,
    )
    route = _gather_sum if collective == "all_gather" else _owners_sum

    def codec_sum(inputs: list[jax.Array], state: Any, key: jax.Array, wire: Wire):
        del key
        # Each leaf through the route, or where the route would receive
        # more than a float32 all-reduce of it, its sent entries through
        # one such all-reduce.
        dense = [
            j
            for j, x in enumerate(inputs)
            if _received_bytes(selection, x.size, wire.num_devices)
            >= _dense_bytes(x.size, wire.num_devices)
        ]
        dense_sent = [_dense_sent(inputs[j], selection) for j in dense]
        dense_sums = _blocks.psum_list(dense_sent, wire.axis)
        leaves = {
            j: _Leaf(total, sent, jnp.all(jnp.isfinite(total)))
            for j, sent, total in zip(dense, dense_sent, dense_sums, strict=True)
        }
        for j, x in enumerate(inputs):
            if j not in leaves:
                leaves[j] = route(x, selection, wire)
        ordered = [leaves[j] for j in range(len(inputs))]
        return CodecSum(
            [leaf.sum for leaf in ordered],
            [leaf.sent for leaf in ordered],
            [leaf.finite for leaf in ordered],
            state,
        )

    options = ""
    if collective != "all_gather":
        options = f", collective={collective!r}"
    if owner_density is not None:
        options += f", owner_density={selection.owner_density}"
    return Codec(
        f"topk(density={density}, bits={bits}, min_size={min_size}{options})",
        at_least(min_size),
        no_state,
        codec_sum,
    )


class _Selection(NamedTuple):
    """A top-k codec's settings (see `topk`)."""

    density: float
    bits: int
    collective: str
    owner_density: float


def _received_bytes(selection: _Selection, size: int, num_devices: int) -> float:
    """What each device receives to sum a leaf of ``size`` elements with
    ``selection`` (ring estimates: an all-gather or all-to-all of ``S``
    bytes in all receives ``(n - 1) / n S``)."""
    n, bits = num_devices, selection.bits
    if selection.collective == "all_gather":
        return (n - 1) * _chunks.payload_nbytes(
            _chunks.leaf_layout(size, selection.density), bits
        )
    # The all-to-all and the all-gather each move n shards' payloads.
    shard = _chunks.shard_layout(size, selection.density, n)
    owners = shard._replace(
        k=_chunks.entries_per_chunk(shard.chunk, selection.owner_density)
    )
    return (n - 1) * (
        _chunks.payload_nbytes(shard, bits) + _chunks.payload_nbytes(owners, bits)
    )


def _dense_bytes(size: int, num_devices: int) -> float:
    """What each device receives in a float32 all-reduce of ``size``."""
    return 2 * (num_devices - 1) / num_devices * 4 * size


class _Leaf(NamedTuple):
    """One leaf's `CodecSum` parts."""

    sum: jax.Array
    sent: jax.Array
    finite: jax.Array


def _dense_sent(x: jax.Array, selection: _Selection) -> jax.Array:
    """This device's top-k of ``x`` (chunked as for ``"all_gather"``) as
    the others decode it, to be summed by a float32 all-reduce."""
    layout = _chunks.leaf_layout(x.size, selection.density)
    rows = as_rows(x, layout.chunk, layout.chunks)
    _, scale, chosen = _chunks.encode(rows, layout.k, selection.bits)
    return from_rows(_chunks.sent(rows, chosen, scale, layout.k, selection.bits), x)


def _gather_sum(x: jax.Array, selection: _Selection, wire: Wire) -> _Leaf:
    """``"all_gather"``: every device's payload gathered and added up."""
    layout, bits = _chunks.leaf_layout(x.size, selection.density), selection.bits
    rows = as_rows(x, layout.chunk, layout.chunks)
    entries, scale, chosen = _chunks.encode(rows, layout.k, bits)
    entries, scales = jax.lax.all_gather((entries, scale), wire.axis)
    total = _placement.on_each_device(
        lambda e, s: _chunks.decode_sum(e, s, layout.chunk, layout.k, bits),
        entries,
        scales,
    )
    return _Leaf(
        from_rows(total, x),
        from_rows(_chunks.sent(rows, chosen, scale, layout.k, bits), x),
        jnp.all(jnp.isfinite(scales)),
    )


def _owners_sum(x: jax.Array, selection: _Selection, wire: Wire) -> _Leaf:
    """``"reduce_scatter"``: each shard's entries summed by its owner, the
    owners' top-k gathered.

    This device's share of the sum (`CodecSum.sent`) is what it sent the
    other owners and, on its own shard, its input less what it did not
    send of the shard's sum. The shares add up to the sum, and the
    residual ``input - share`` keeps on the owner's shard everything its
    selection left out, every device's entries included, for its next
    call (which takes its own shard whole).
    """
    n, bits = wire.num_devices, selection.bits
    layout = _chunks.shard_layout(x.size, selection.density, n)
    rows = as_rows(x, layout.chunk, n * layout.chunks)
    entries, scale, chosen = _chunks.encode(rows, layout.k, bits)
    sent = _chunks.sent(rows, chosen, scale, layout.k, bits)

    def to_owners(a: jax.Array) -> jax.Array:
        by_owner = a.reshape(n, layout.chunks, *a.shape[1:])
        return jax.lax.all_to_all(by_owner, wire.axis, 0, 0)

    # Packed words on both sides of the all-to-all (see
    # `_placement.held_by_each_device`).
    received, received_scales = _placement.held_by_each_device(
        jax.tree.map(to_owners, _placement.held_by_each_device((entries, scale)))
    )
    start = wire.device * layout.chunks
    own = jax.lax.dynamic_slice_in_dim(rows, start, layout.chunks)
    # Its own entries are in ``own``, whole; the others' added in order.
    others = jnp.arange(n) != wire.device
    owned = _chunks.add_payloads(
        own, received, received_scales, layout.k, bits, include=others
    )

    k = _chunks.entries_per_chunk(layout.chunk, selection.owner_density)
    owner_entries, owner_scale, owner_chosen = _chunks.encode(owned, k, bits)
    owner_sent = _chunks.sent(owned, owner_chosen, owner_scale, k, bits)
    sent = jax.lax.dynamic_update_slice_in_dim(sent, own - owned + owner_sent, start, 0)
    entries, scales = jax.lax.all_gather((owner_entries, owner_scale), wire.axis)
    total = _placement.on_each_device(
        lambda e, s: _chunks.decode_shards(e, s, layout.chunk, k, bits),
        entries,
        scales,
    )
    return _Leaf(
        from_rows(total, x),
        from_rows(sent, x),
        jnp.all(jnp.isfinite(scales)),
    )
