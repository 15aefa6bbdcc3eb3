"""A codec plugged into a cross-device mean or sum: what every codec shares.

`reduce_with_codec` runs on each device inside a map over the devices. It
sums the leaves a codec does not compress exactly (with the total weight,
in one float32 all-reduce), hands the codec each device's input (its share
of the mean plus what it has not sent before), keeps the error-feedback
residual, drops a device of zero weight (a select: its NaNs stay out),
marks a leaf that some device could not code as NaN, and advances the
random counter.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _checks, _tree, _weights
from gradaccum_jax._codecs import _auto_blocks
from gradaccum_jax._codecs._protocol import (
    Codec,
    CodecState,
    CodecSum,
    Wire,
    checked_sum,
)
from gradaccum_jax._compression import (
    _auto_splits,
    _blocks,
    _error_feedback,
    _leaves,
    _random,
)


class Reduce(NamedTuple):
    """One configured reduction with a codec.

    Attributes:
      codec: the codec.
      axis: the mapped axis (or tuple of axes) summed over.
      error_feedback: keep each device's residual for the next call.
      mean: the (weighted) mean of the updates (each device's input is its
        share of it); False: the plain sum of per-device terms.
      report_sq_excess: also return the codec's `CodecSum.sq_excess`.
      caller: the public name, for messages.
      coder: what codes the leaves, for messages (default: the codec).
      residual_dtype: the error-feedback residual's dtype (float32 or
        bfloat16); the input and the codes are float32 either way.
    """

    codec: Codec
    axis: Any
    error_feedback: bool
    mean: bool = True
    report_sq_excess: bool = False
    caller: str = "compressed_average_across_devices"
    coder: str | None = None
    residual_dtype: Any = jnp.float32

    @property
    def coder_name(self) -> str:
        """What codes the leaves, for messages."""
        return self.coder or f"the codec {self.codec.name}"

    @property
    def keeps_residual(self) -> bool:
        """Whether a residual is kept (see `_compression._error_feedback`)."""
        return _error_feedback.keeps_residual(
            self.error_feedback, self.codec.keeps_residual
        )

    def coded(self, leaf: Any) -> bool:
        """Whether the codec compresses ``leaf`` (whole)."""
        return coded(self.codec, leaf)


def compresses(codec: Codec, shape: tuple[int, ...]) -> bool:
    """Whether ``codec`` codes a leaf of ``shape``: as it says, but never a
    leaf of one element. A scalar saves nothing coded, and the scalars
    reduced with the updates say what the others mean: a window's weight
    (whether it steps, what divides its sum), ``diloco``'s presence
    weight (whether the anchor moves). Coded, a ternary code of one
    magnitude could send 0 for them."""
    return int(np.prod(shape, dtype=np.int64)) > 1 and bool(codec.compresses(shape))


def coded(codec: Codec, leaf: Any, split: _blocks.Split = _blocks.WHOLE) -> bool:
    """Whether ``codec`` compresses ``leaf`` (static: from its shape), or
    the leaf of which ``leaf`` is the block split as ``split``: ``init``
    decided from the whole leaf, and a block may fall under a size
    threshold (``min_size``, PowerSGD's factors) that the leaf does not."""
    shape = tuple(np.shape(leaf))
    if _blocks.axes_of(split):
        shape = _blocks.whole_shape(shape, split)
    return compresses(codec, shape)


def state_init(config: Reduce, params: Any, seed: int) -> CodecState:
    """The state before the first call: zero residuals, the codec's own,
    and how the params lie over Auto mesh axes where they are placed."""
    key = _random.seed_state(seed)
    shapes = [
        jax.ShapeDtypeStruct(np.shape(leaf), jnp.float32)
        for leaf in jax.tree.leaves(params)
        if coded(config.codec, leaf)
    ]
    return CodecState(
        key,
        _error_feedback.residual_init(
            params, config.coded, config.keeps_residual, config.residual_dtype
        ),
        config.codec.init(shapes, key),
        _auto_splits.seen_splits(jax.tree.leaves(params)),
    )


def check_updates(config: Reduce, updates: Any, state: CodecState) -> None:
    """Raises, naming the leaf, where ``updates`` do not fit ``state``: not
    real floating point, another tree or shape than the params', a leaf
    coded where no residual was kept, a codec state of another codec."""
    _leaves.check_updates(updates, state.residual, config.caller, config.coder_name)
    if config.keeps_residual:
        _error_feedback.check_grown(
            updates, state.residual, config.coded, config.caller, config.codec.name
        )
        _error_feedback.check_dtype(
            updates, state.residual, config.residual_dtype, config.caller
        )
    check_codec_state(
        config, [np.shape(x) for x in jax.tree.leaves(updates)], state.codec
    )


def check_codec_state(
    config: Reduce, shapes: list[tuple[int, ...]], codec_state: Any
) -> None:
    """Raises if ``codec_state`` is not what ``config.codec`` keeps for
    params of leaf ``shapes`` (a state made, or restored, for another codec:
    PowerSGD's factors handed to top-k, or none handed to PowerSGD)."""
    coded_shapes = [
        jax.ShapeDtypeStruct(shape, jnp.float32)
        for shape in shapes
        if compresses(config.codec, shape)
    ]
    expected = jax.eval_shape(
        lambda: config.codec.init(coded_shapes, _random.seed_state(0))
    )
    _checks.made_like(
        codec_state,
        expected,
        f"{config.caller}: the state's codec part for {config.codec.name}",
        "codec",
    )


def reduce_with_codec(
    config: Reduce,
    updates: Any,
    state: CodecState,
    weight: Any,
    splits: list[_blocks.Split] | None = None,
    layouts: list[_blocks.Split] | None = None,
) -> tuple[Any, CodecState, jax.Array]:
    """The mean (or sum) of ``updates`` over the devices, the new state, and
    what the codes add to its squared norm (0 unless asked and known).

    ``splits`` as in `Wire.splits`, for every leaf (None: all whole);
    ``layouts``, each leaf's split over Auto mesh axes where the caller
    knows it (`_compression._auto_splits.layouts_of`).
    """
    num_devices = _checks.bound_axis_size(config.axis, config.caller)
    leaves, treedef = jax.tree.flatten(updates)
    splits = splits or [_blocks.WHOLE] * len(leaves)
    residuals = _leaves.slots(state.residual)
    compressed = [i for i, x in enumerate(leaves) if coded(config.codec, x, splits[i])]
    exact = [i for i in range(len(leaves)) if i not in compressed]
    results = list(leaves)
    exact_results, share, has_weight = _exact(
        config, leaves, exact, weight, num_devices
    )
    for i, result in exact_results.items():
        results[i] = result

    inputs = _inputs(config, leaves, residuals, compressed, share)
    wire = Wire(
        config.axis,
        num_devices,
        jax.lax.axis_index(config.axis),
        [splits[i] for i in compressed],
        tuple(compressed),
        config.error_feedback,
        config.report_sq_excess,
    )
    layouts = _auto_splits.layouts_of(leaves, state.auto_splits, layouts)
    coded_sum = _sum_on_blocks(
        config.codec,
        inputs,
        state.codec,
        state.key,
        wire,
        [layouts[i] for i in compressed],
    )
    new_residuals = list(residuals)
    for j, i in enumerate(compressed):
        finite = coded_sum.finite[j]
        after = None
        if config.keeps_residual:
            new_residuals[i] = after = _error_feedback.fed_back(
                inputs[j],
                coded_sum.sent[j],
                finite & has_weight,
                residuals[i],
                _residual_bits(config, state.key, i, wire, inputs[j], splits[i]),
            )
        total = coded_sum.sums[j]
        total = total(after) if callable(total) else total
        result = jnp.where(finite, total, jnp.nan)
        results[i] = jnp.where(has_weight, result, 0.0).astype(leaves[i].dtype)
    # A zero total weight (nothing seen anywhere) or a non-finite leaf
    # leaves the codec's state as it was (a warm start poisoned by a NaN
    # would spoil every later call), as it leaves the residuals.
    keep = has_weight & jnp.all(jnp.stack([jnp.asarray(True), *coded_sum.finite]))
    codec_state = jax.tree.map(
        lambda new, old: jnp.where(keep, new, old), coded_sum.state, state.codec
    )
    new_state = CodecState(
        _random.advance(state.key),
        _leaves.with_slots(state.residual, new_residuals),
        codec_state,
        state.auto_splits,
    )
    sq_excess = coded_sum.sq_excess
    sq_excess = jnp.zeros([], jnp.float32) if sq_excess is None else sq_excess
    return (
        jax.tree.unflatten(treedef, results),
        new_state,
        jnp.where(has_weight, sq_excess, 0.0),
    )


def _inputs(
    config: Reduce,
    leaves: list[jax.Array],
    residuals: list[Any],
    compressed: list[int],
    share: jax.Array,
) -> list[jax.Array]:
    """This device's float32 input of each coded leaf (``compressed``: their
    indices): its share of the result, plus what it did not send before."""
    inputs = [
        _weights.weighted(share, leaves[i].astype(jnp.float32)) for i in compressed
    ]
    if not config.keeps_residual:
        return inputs
    return [
        x + residuals[i].reshape(x.shape)
        for x, i in zip(inputs, compressed, strict=True)
    ]


# The residuals' rounding draws from a stream of its own, not the codec's.
_RESIDUAL_STREAM = 0x5E5D0A1


def _residual_bits(
    config: Reduce,
    key: jax.Array,
    leaf: int,
    wire: Wire,
    like: jax.Array,
    split: _blocks.Split,
) -> jax.Array | None:
    """Random bits to round leaf ``leaf``'s residual to bfloat16 with (None
    for a float32 residual): this device's, numbered in the whole leaf."""
    if jnp.dtype(config.residual_dtype) == jnp.float32:
        return None
    words = _random.stream(_random.derive(key, _RESIDUAL_STREAM), leaf, wire.device)
    return _random.bits(words, like, split)


def _sum_on_blocks(
    codec: Codec,
    inputs: list[jax.Array],
    state: Any,
    key: jax.Array,
    wire: Wire,
    auto_splits: list[_blocks.Split],
) -> CodecSum:
    """``codec.sum`` with each input seen as the block its device holds.

    An input split over other mesh axes by explicit sharding (a
    tensor-parallel ``f32[32,64@model]`` leaf, inside a ``shard_map`` over
    the reduction axis alone) is coded where it lies: in a ``shard_map``
    manual over the axes that split it, each device codes its own block,
    told the split by `Wire.splits` (what the window's map does for its
    terms). Nothing is gathered, and a codec never reshapes a split array,
    which JAX cannot do without moving it. Inputs split over Auto axes
    (``auto_splits``, see `_auto_blocks`) are coded where they lie too.
    """
    specs = [P(*_tree.partitions(x)) for x in inputs]
    split_axes = _tree.mesh_axes_in(tuple(part for spec in specs for part in spec))
    if not split_axes:
        if any(_blocks.axes_of(split) for split in auto_splits):
            return _auto_blocks.sum_on_auto_blocks(
                codec, inputs, state, key, wire, auto_splits
            )
        return checked_sum(codec, inputs, state, key, wire, deferred=True)
    blocks_wire = wire._replace(splits=[tuple(spec) for spec in specs])
    # Unchecked: the sums and flags a codec returns are the same on every
    # device of the split axes, but many come from ``all_gather``, whose
    # result JAX types as varying (it has no invariant gather a codec could
    # use on every release), so a checked map would refuse the P() outputs.
    return jax.shard_map(
        lambda inputs, state, key, device: checked_sum(
            codec, inputs, state, key, blocks_wire._replace(device=device)
        ),
        in_specs=(specs, P(), P(), P()),
        out_specs=CodecSum._make([specs, specs, P(), P(), P()]),
        axis_names=set(split_axes),
        check_vma=False,
    )(inputs, state, key, wire.device)


def _exact(
    config: Reduce,
    leaves: list[jax.Array],
    exact: list[int],
    weight: Any,
    num_devices: int,
) -> tuple[dict[int, jax.Array], jax.Array, jax.Array]:
    """The total weight and the uncompressed leaves' sums in one all-reduce.

    Returns those leaves' results (means or sums) by index, this device's
    share of the result and whether the total weight is nonzero.
    """
    # A device's term is a select, not a multiply, so a weight-0 device's
    # NaN gradients contribute nothing (0 * NaN).
    if weight is None:
        raw = jnp.float32(1.0)
        sums = _blocks.psum_list(
            [leaves[i].astype(jnp.float32) for i in exact], config.axis
        )
        total = jnp.float32(num_devices)
    else:
        raw = _weights.scalar_weight(weight, config.caller)
        sums = [_weights.weighted(raw, leaves[i].astype(jnp.float32)) for i in exact]
        total, *sums = _blocks.psum_list([raw, *sums], config.axis)
    if not config.mean:
        return (
            {i: s.astype(leaves[i].dtype) for i, s in zip(exact, sums, strict=True)},
            jnp.float32(1.0),
            jnp.asarray(True),
        )
    share, has_weight = _weights.share(raw, total)
    inverse_total = _weights.share(jnp.float32(1.0), total)[0]
    means = {
        i: (leaf_sum * inverse_total).astype(leaves[i].dtype)
        for i, leaf_sum in zip(exact, sums, strict=True)
    }
    return means, share, has_weight
