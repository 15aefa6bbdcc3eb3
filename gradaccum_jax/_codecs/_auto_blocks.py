"""A codec run on each device's block of leaves split over Auto mesh axes.

Where a codec's inputs are split over mesh axes their types do not show
(Auto axes: on an Auto mesh, or inside `diloco`'s map over stacked
workers, which makes every Explicit axis Auto), the codec would see whole
leaves and reshape them (packing codes into words, cutting blocks of a
quantized leaf, a matrix view for PowerSGD): XLA then moves the codes
between devices to lay each reshape out, a gather over ``model`` of a
tensor-parallel leaf's codes. Told the split (`layouts_of`), the leaves
are viewed device-major, ``(m, *block)``, a local relabeling, and the
codec runs on each block in a ``jax.vmap`` over that axis, its mapped
axis sharded over the mesh axis (``spmd_axis_name``), named as the mesh
axis: the codec reads the block's place from `Wire.splits` and sums over
the blocks with collectives over the axis, exactly as in a ``shard_map``
manual over it (`_mean`), and nothing is gathered. A ``shard_map`` cannot
be used there: inside ``diloco``'s ``vmap`` over the workers, jax 0.10.2
mis-lowers a ``shard_map`` that is not manual over the vmapped axis.

Two say the split: a caller that read it from Explicit types before
making the axes Auto (``diloco``, which passes it to its
``outer_reduction``'s ``update`` as the extra argument ``leaf_layouts``, as
optax passes extras, so a reduction of the user's own gets it too), and
the codec's own state, where ``init`` kept how it saw placed params split
over Auto axes (`_blocks.AutoSplits`, `seen_splits`): on an Auto mesh
nothing else can, since under ``jax.jit`` the compiler chooses the split.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement
from gradaccum_jax._codecs._protocol import Codec, CodecSum, Wire, checked_sum
from gradaccum_jax._ternary import _blocks


def seen_splits(leaves: list[Any]) -> _blocks.AutoSplits:
    """How ``leaves`` lie over Auto mesh axes, read from their shardings:
    one entry per dimension of a split leaf.

    Known only for placed arrays (``init`` called on them, not under
    ``jax.jit``, whose tracers on Auto axes carry no split); an entry over
    an Explicit axis is left out (the type says it under ``jax.jit``).
    """
    splits = [_auto_split(leaf) for leaf in leaves]
    if not any(_blocks.axes_of(split) for split in splits):
        return _blocks.AutoSplits()
    return _blocks.AutoSplits(tuple(splits))


def _auto_split(leaf: Any) -> _blocks.Split:
    if not _placement.is_concrete(leaf):
        return _blocks.WHOLE
    sharding = leaf.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return _blocks.WHOLE
    auto = set(_placement.axes_typed(AxisType.Auto, mesh=sharding.mesh))
    parts = (*sharding.spec, *(None,) * (leaf.ndim - len(sharding.spec)))
    split = tuple(
        part if _names(part) and set(_names(part)) <= auto else None for part in parts
    )
    return split if _blocks.axes_of(split) else _blocks.WHOLE


def layouts_of(
    leaves: list[Any],
    seen: _blocks.AutoSplits,
    told: list[_blocks.Split] | None = None,
) -> list[_blocks.Split]:
    """Each leaf's split over Auto mesh axes, as the caller says (``told``:
    the ``leaf_layouts`` extra argument of a codec reduction's ``update``),
    else as ``init`` saw the params (``seen``, the state's
    `_blocks.AutoSplits`).

    ``()`` (whole) for every leaf when neither says it for this many leaves
    (another reduction's updates), and for a leaf the split does not fit:
    one whose type is split already, a split over an axis that is not
    Auto or of a dimension it does not divide. ``leaves`` may go on past
    the params' (a reduction's own extra leaves: whole).
    """
    layouts = None if told is None else tuple(told)
    if layouts is None or len(layouts) != len(leaves):
        if not seen.splits or len(seen.splits) > len(leaves):
            return [_blocks.WHOLE] * len(leaves)
        layouts = (
            *seen.splits,
            *(_blocks.WHOLE,) * (len(leaves) - len(seen.splits)),
        )
    return [
        split if _fits(leaf, split) else _blocks.WHOLE
        for leaf, split in zip(leaves, layouts, strict=True)
    ]


def _fits(leaf: Any, split: _blocks.Split) -> bool:
    if any(part is not None for part in _partitions(leaf)):
        return False
    return fits(tuple(np.shape(leaf)), split)


def fits(shape: tuple[int, ...], split: _blocks.Split) -> bool:
    """Whether a leaf of ``shape`` can be split as ``split``: over Auto axes
    of the current mesh, each of a size that divides its dimension."""
    axes = _blocks.axes_of(split)
    if not axes or len(split) > len(shape):
        return False
    if not set(axes) <= set(_placement.axes_typed(AxisType.Auto)):
        return False
    return all(
        size % _count(part) == 0 for size, part in zip(shape, split, strict=False)
    )


def _partitions(leaf: Any) -> tuple[Any, ...]:
    spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
    return tuple(spec or ())


def _names(part: Any) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)


def _count(part: Any) -> int:
    sizes = jax.sharding.get_abstract_mesh().shape
    return math.prod(sizes[name] for name in _names(part))


def sum_on_auto_blocks(
    codec: Codec,
    inputs: list[jax.Array],
    state: Any,
    key: jax.Array,
    wire: Wire,
    splits: list[_blocks.Split],
) -> CodecSum:
    """``codec.sum`` on each device's block of ``inputs``, split as ``splits``
    over Auto mesh axes (see the module's docstring); the results whole."""
    mesh = jax.sharding.get_abstract_mesh()
    order = tuple(
        axis
        for axis in mesh.axis_names
        if any(axis in _blocks.axes_of(split) for split in splits)
    )
    views = [
        _device_major(x, split, order) for x, split in zip(inputs, splits, strict=True)
    ]
    blocks_wire = wire._replace(splits=list(splits))

    def block_sum(blocks, state, key, device):
        device_wire = blocks_wire._replace(device=device)
        return checked_sum(codec, list(blocks), state, key, device_wire)

    fn = block_sum
    # The outermost map takes the first axis of `order`, each leaf's leading
    # device dimension; a leaf not split over an axis goes to it whole.
    for axis in reversed(order):
        dims = [0 if axis in _blocks.axes_of(split) else None for split in splits]
        fn = jax.vmap(
            fn,
            in_axes=(dims, None, None, None),
            out_axes=CodecSum._make([dims, dims, 0, None, None]),
            axis_name=axis,
            spmd_axis_name=axis,
        )
    result = fn([view for view, _ in views], state, key, wire.device)
    perms = [perm for _, perm in views]
    return result._replace(
        sums=[
            _whole(s, perm, x)
            for s, perm, x in zip(result.sums, perms, inputs, strict=True)
        ],
        sent=[
            _whole(s, perm, x)
            for s, perm, x in zip(result.sent, perms, inputs, strict=True)
        ],
        # A codec may find a block not finite without a collective over the
        # blocks: the leaf is finite where all its blocks are.
        finite=[jnp.all(f) for f in result.finite],
        # The same on every block (the map returns it unmapped), and kept so:
        # left to the compiler, a state the sync's loop carries (PowerSGD's
        # Q in `diloco`) may be laid out split over the blocks' axes and
        # gathered after the loop, on every call, whether it ran or not.
        state=jax.tree.map(
            lambda leaf: jax.lax.with_sharding_constraint(leaf, P()), result.state
        ),
    )


def _device_major(
    x: jax.Array, split: _blocks.Split, order: tuple[str, ...]
) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` as ``(m_a, m_b, ..., *block)``: one leading dimension per mesh
    axis that splits it, in ``order``, then the block each device holds.

    Each split dimension is cut into (devices, block) and the device parts
    moved to the front: both steps only relabel what each device holds
    (the view is pinned there, so that the compiler keeps it). Returns the
    view and the permutation that made it (`_whole` undoes both).
    """
    sizes = jax.sharding.get_abstract_mesh().shape
    parts = (*split, *(None,) * (x.ndim - len(split)))
    shape: list[int] = []
    labels: list[str | None] = []
    for size, part in zip(x.shape, parts, strict=True):
        names = _names(part)
        shape += [sizes[name] for name in names] + [size // _count(part)]
        labels += [*names, None]
    devices = sorted(
        (i for i, label in enumerate(labels) if label is not None),
        key=lambda i: order.index(labels[i]),
    )
    perm = (*devices, *(i for i, label in enumerate(labels) if label is None))
    view = jnp.transpose(jnp.reshape(x, shape), perm)
    spec = P(*(labels[i] for i in devices), *(None,) * (view.ndim - len(devices)))
    return jax.lax.with_sharding_constraint(view, spec), perm


def _whole(view: jax.Array, perm: tuple[int, ...], like: jax.Array) -> jax.Array:
    """The inverse of `_device_major`: ``view`` shaped like ``like``."""
    return jnp.reshape(
        jnp.transpose(view, tuple(int(i) for i in np.argsort(perm))), like.shape
    )
