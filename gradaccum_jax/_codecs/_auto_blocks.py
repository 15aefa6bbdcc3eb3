"""A codec run on each device's block of leaves split over Auto mesh axes.

Where a codec's inputs are split over mesh axes their types do not show
(Auto axes: on an Auto mesh, or inside `diloco`'s map over stacked
workers, which makes every Explicit axis Auto), the codec would see whole
leaves and reshape them (packing codes into words, cutting blocks of a
quantized leaf, a matrix view for PowerSGD): XLA then moves the codes
between devices to lay each reshape out, a gather over ``model`` of a
tensor-parallel leaf's codes. Told the split, the leaves
are viewed device-major, ``(m, *block)``, a local relabeling, and the
codec runs on each block in a ``jax.vmap`` over that axis, its mapped
axis sharded over the mesh axis (``spmd_axis_name``), named as the mesh
axis: the codec reads the block's place from `Wire.splits` and sums over
the blocks with collectives over the axis, exactly as in a ``shard_map``
manual over it (`_mean`), and nothing is gathered. A ``shard_map`` cannot
be used there: inside ``diloco``'s ``vmap`` over the workers, jax 0.10.2
mis-lowers a ``shard_map`` that is not manual over the vmapped axis.

Who says the split, and how: `gradaccum_jax._compression._auto_splits`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree
from gradaccum_jax._codecs._protocol import Codec, CodecSum, Wire, checked_sum
from gradaccum_jax._compression import _auto_splits, _blocks


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
        names = _tree.entry_axes(part)
        shape += [sizes[name] for name in names] + [size // _auto_splits.count(part)]
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
