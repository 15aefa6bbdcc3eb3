"""The mean of updates across devices with ternary codes on the wire."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _checks, _tree, _weights
from gradaccum_jax._ternary import _blocks, _random
from gradaccum_jax._ternary._error_feedback import (
    TernaryState,
    keeps_residual,
    residual_init,
)
from gradaccum_jax._ternary._leaves import (
    DEFAULT_MIN_SIZE,
    check_updates,
    common_config,
    is_compressed,
    is_masked,
    real_leaves,
)
from gradaccum_jax._ternary._quantize import (
    clip,
    scale_and_bound,
    stochastic_codes,
    ternary_dequantize,
)


def _digits_per_word(num_devices: int) -> int:
    """How many base-(2n + 1) digits a uint32 word holds."""
    base, count = 2 * num_devices + 1, 0
    while base ** (count + 1) < 2**32:
        count += 1
    return count


def packed_psum(codes: list[jax.Array], axis: Any, num_devices: int) -> list[jax.Array]:
    """Sums each array of int8 ternary codes over ``axis``: its int32 sums.

    Each device's code c in {-1, 0, 1} is sent as the digit c + 1 in {0, 1, 2}
    of a base ``B = 2n + 1`` number held in a uint32 word. Over n devices one
    digit sums to at most 2n < B, so digits never carry into each other and
    one integer psum adds all of them at once, exactly; a word holds the k
    digits with ``B**k < 2**32``. With 8 devices (base 17) that is 7 codes
    per 4 bytes (4.6 bits per code; bit fields of bit_length(2n) bits would
    hold 6), with 2 devices 13 (bit fields: 10), with 4 devices 10 (8).

    Each array is packed on its own and all the words go in one variadic
    all-reduce: a concatenation would make the packing (into which XLA
    fuses the codes' computation) find which array each word belongs to: a
    2-device step of a 4.7M parameter MLP took 97 ms with it, 80 ms without.

    Codes split over other mesh axes by explicit sharding (a
    tensor-parallel ``f32[32,32@model]`` leaf, within a ``shard_map`` over
    ``axis`` alone) are packed where they lie: see `_on_own_blocks`.
    """
    if _digits_per_word(num_devices) < 2:  # over 32767 devices: int32 sums
        return _psum_list([c.astype(jnp.int32) for c in codes], axis)

    def packed(codes):
        words = _psum_list([pack_codes(c, num_devices) for c in codes], axis)
        return [
            unpack_sums(leaf_words, c.shape, num_devices)
            for leaf_words, c in zip(words, codes, strict=True)
        ]

    return _on_own_blocks(packed, codes)


def _on_own_blocks(fn, arrays: list[jax.Array]) -> list[jax.Array]:
    """``fn(arrays)`` with each array seen as the block its device holds.

    Packing reshapes the codes, and a reshape cannot keep an arbitrary split
    of an array (JAX rejects it on Explicit axes; on Auto ones XLA moves the
    codes between devices to lay them out). Run in a ``shard_map`` manual
    over the mesh axes the arrays are explicitly split over, each device
    packs, sums over the devices of ``axis`` and unpacks its own block: the
    codes keep their split, and with a leaf split over m devices each
    device sends about 1/m of its words. ``fn`` must map each block to a
    block of the same shape. Arrays with no explicit split are passed whole.
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
    """``(rows, columns)``: the 2-D view of ``size`` codes that `pack_codes` packs.

    The longest row length in `_ROW_LENGTHS` that divides ``size`` and
    leaves at least 16 rows per digit, so that padding the rows to a
    multiple of ``per_word`` adds less than 1/16 to the words.
    """
    for columns in _ROW_LENGTHS:
        if size % columns == 0 and size // columns >= 16 * per_word:
            return size // columns, columns
    return size, 1


def pack_codes(codes: jax.Array, num_devices: int) -> jax.Array:
    """Int8 codes as base-(2n + 1) digits, `_digits_per_word` per uint32.

    Returns flat words. The codes are viewed as rows (`_plane_view`), the
    rows padded with code 0 to ``per_word * planes`` and cut into
    ``per_word`` planes of ``planes`` rows; digit j of a word is the code at
    the same place in plane j. Each digit is then a contiguous block of
    codes: packing consecutive codes into a word instead makes every digit a
    strided gather, and padding the flat codes puts a bounds check on every
    element. XLA:CPU fuses the codes' computation into the packing, and
    either keeps it from vectorizing: measured 9x slower on 4M codes.
    """
    per_word, base = _digits_per_word(num_devices), 2 * num_devices + 1
    rows, columns = _plane_view(codes.size, per_word)
    planes = -(-rows // per_word)
    digits = jnp.pad(
        codes.reshape(rows, columns), ((0, planes * per_word - rows), (0, 0))
    )
    digits = (digits + 1).astype(jnp.uint32).reshape(per_word, planes, columns)
    # Horner's rule, unrolled: an elementwise pass, not a reduction over 7.
    words = digits[per_word - 1]
    for j in range(per_word - 2, -1, -1):
        words = words * jnp.uint32(base) + digits[j]
    return words.reshape(-1)


def unpack_sums(
    words: jax.Array, shape: tuple[int, ...], num_devices: int
) -> jax.Array:
    """The int32 code sums, shaped ``shape``, held in psum-ed `pack_codes` words."""
    per_word, base = _digits_per_word(num_devices), 2 * num_devices + 1
    rows, columns = _plane_view(int(np.prod(shape, dtype=np.int64)), per_word)
    words = words.reshape(-1, columns)
    fields = []
    for _ in range(per_word):
        fields.append(words % jnp.uint32(base))
        words = words // jnp.uint32(base)
    sums = jnp.concatenate(fields).astype(jnp.int32) - num_devices
    return sums[:rows].reshape(shape)


def _pmax_stacked(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    """pmax of several scalars in one all-reduce."""
    if not values:
        return []
    return list(jax.lax.pmax(jnp.stack(values), axis))


def _psum_list(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    """psum of several arrays in one (variadic) all-reduce."""
    return list(jax.lax.psum(values, axis)) if values else []


def ternary_average_across_devices(
    axis_name: str | tuple[str, ...],
    seed: int,
    *,
    error_feedback: bool = True,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
) -> optax.GradientTransformationExtraArgs:
    """The mean of the updates across devices, sent as ternary codes.

    Inside ``jax.pmap`` / ``jax.shard_map`` over ``axis_name``, each device
    computes its share ``x_d = p_d * update_d + residual_d`` of the mean
    (``p_d = 1 / n``, or ``weight_d / sum(weight)`` when ``weight=`` is
    passed), clips it (TernGrad, Wen et al., NeurIPS 2017), and the devices
    agree on one scale per leaf, ``s = pmax(scale_d)``, where ``scale_d`` is
    the clipping bound of ``x_d``: TernGrad's ``max|clip(x_d)|`` whenever an
    element reaches the bound, found in one pass over the update (``max|x_d|``
    without clipping). Each device then draws TernGrad's unbiased codes
    against ``s`` with its own bits; the codes are summed over devices by
    one integer psum, and the result ``sum_d codes_d * s`` is bitwise
    identical on every device. Its expectation is the (weighted) mean of
    the clipped inputs: exactly the mean with ``clip_sigma=None``.

    The codes travel as digits of uint32 words (7 per word with 8 devices,
    1/7 of a float32 psum); leaves smaller than ``min_size`` are averaged
    exactly in float32. A leaf split over another mesh axis by explicit
    sharding (tensor-parallel params within a ``shard_map`` over
    ``axis_name`` alone) keeps its split: each device codes and sends its
    own block. With ``error_feedback`` (Karimireddy et al., ICML
    2019) each device keeps its clipping error for the next step. The
    ternary guide, section "The device mean on the wire", has the wire
    format, the residual's rules, and what a zero weight or a non-finite
    update does.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from gradaccum_jax import ternary_average_across_devices
    >>> tx = ternary_average_across_devices("data", seed=0, min_size=1)
    >>> def mean(update):
    ...     return tx.update(update, tx.init(update))[0]
    >>> x = jnp.tile(jnp.array([1.0, -1.0, 0.0, 2.0]), (8, 1))  # 8 devices, same update
    >>> out = jax.pmap(mean, axis_name="data")(x)
    >>> bool((out == out[0]).all()), out.shape  # one result, on every device
    (True, (8, 4))

    Args:
      axis_name: the pmap / shard_map axis (or tuple of axes) to average over.
      seed: an integer in [0, 2**32 - 1]; every device draws its own random
        bits from it, yet the state is the same on every device.
      error_feedback: keep each device's clipping error for the next step.
      clip_sigma: TernGrad's clipping in standard deviations of each
        device's share; None disables it. Must be > 0.
      min_size: leaves with fewer elements are averaged in float32.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a `TernaryState`
      whose update accepts an optional scalar ``weight=`` (what this device
      saw, e.g. its number of examples; see `MultiSteps`) and ignores
      other extra arguments.
    """
    axis = _checks.axis_name("axis_name", axis_name)
    seed, clip_sigma, min_size = common_config(seed, clip_sigma, min_size)
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    keep_residual = keeps_residual(error_feedback, True, clip_sigma)
    config = MeanConfig(axis, clip_sigma, min_size, keep_residual)

    def init_fn(params):
        real_leaves(params, f"{_CALLER}: params")
        return TernaryState(
            _random.seed_state(seed), residual_init(params, min_size, keep_residual)
        )

    def update_fn(updates, state, params=None, *, weight=None, **extra_args):
        del params, extra_args
        check_updates(updates, state.residual, _CALLER, min_size, keep_residual)
        return ternary_mean(config, updates, state, weight)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_CALLER = "ternary_average_across_devices"


class MeanConfig(NamedTuple):
    """The checked arguments of one `ternary_average_across_devices`."""

    axis: Any
    clip_sigma: float | None
    min_size: int
    keep_residual: bool
    # Whether `ternary_mean` also returns what the codes add to |mean|^2.
    report_sq_excess: bool = False


def ternary_mean_and_sq_excess(
    axis: Any,
    clip_sigma: float | None,
    min_size: int,
    updates: Any,
    state: TernaryState,
    splits: list[_blocks.Split] | None = None,
) -> tuple[Any, TernaryState, jax.Array]:
    """The unweighted ternary mean without error feedback, and by how much
    its codes change its squared norm (`_sq_excess`), the same on every
    device. ``splits`` as in `ternary_mean`."""
    config = MeanConfig(axis, clip_sigma, min_size, False, report_sq_excess=True)
    return ternary_mean(config, updates, state, None, splits)


def _sq_excess(
    inputs: dict[int, jax.Array],
    scales: dict[int, jax.Array],
    bounds: dict[int, jax.Array],
    splits: list[_blocks.Split],
    axis: Any,
) -> jax.Array:
    """``E|mean|^2 - |exact mean|^2``: what the codes of the compressed
    leaves add to the squared norm of the mean, given the inputs.

    A code of a device's share ``x``, clipped to ``c`` (``|c| <= s``), is
    ``s sign(c)`` with probability ``|c| / s``, else 0: unbiased for ``c``
    with variance ``s |c| - c^2``. The devices draw independently, so their
    variances add up in the mean's. Clipping takes ``x - c`` away: each
    device's ``|x|^2 - |c|^2`` is what that removes from the squared norm
    of its own share (the cross terms between devices' clipping errors,
    small next to it, are left out). Per element the excess is then
    ``s |c| - x^2``; each device sums its own in float32 (an extra pass
    over the shares, once per window) and one psum of a scalar adds them
    (a leaf held in blocks split over other axes first sums its blocks'
    over those).
    On a closed-form regression (`tests/test_noise_scale.py`) it makes the
    ``|G|^2`` estimated from a ternary window unbiased.
    """
    local = jnp.zeros([], jnp.float32)
    for i, x in inputs.items():
        clipped = clip(x, bounds[i])
        leaf = jnp.sum(scales[i] * jnp.abs(clipped) - jnp.square(x))
        split_axes = _blocks.axes_of(splits[i])
        local += jax.lax.psum(leaf, split_axes) if split_axes else leaf
    return jax.lax.psum(local, axis)


def ternary_mean(
    config: MeanConfig,
    updates: Any,
    state: TernaryState,
    weight: Any,
    splits: list[_blocks.Split] | None = None,
) -> tuple[Any, ...]:
    """One step: the mean of ``updates`` over the devices, and the new state.

    ``splits`` says, per leaf, how ``updates`` are blocks of leaves split
    over mesh axes manual here besides ``config.axis`` (see `_blocks`):
    each device then codes and sends its own block, with the scale and the
    random bits of the whole leaf. None: every leaf whole, or split by
    explicit sharding (which its type carries). With
    ``config.report_sq_excess`` a third result is `_sq_excess`.
    """
    num_devices = _checks.bound_axis_size(config.axis, _CALLER)
    device = jax.lax.axis_index(config.axis)
    leaves, treedef = jax.tree.flatten(updates)
    splits = splits or [_blocks.WHOLE] * len(leaves)
    residuals = jax.tree.leaves(state.residual, is_leaf=is_masked)
    compressed = [i for i, x in enumerate(leaves) if is_compressed(x, config.min_size)]
    exact = [i for i in range(len(leaves)) if i not in compressed]
    means, new_residuals = list(leaves), list(residuals)
    exact_means, share, has_weight = _exact_means(
        leaves, exact, weight, config.axis, num_devices
    )
    for i, mean in exact_means.items():
        means[i] = mean

    # This device's share of the mean, plus what it failed to send before.
    inputs = {
        i: _weights.weighted(share, leaves[i].astype(jnp.float32)) for i in compressed
    }
    if config.keep_residual:
        inputs = {i: x + residuals[i] for i, x in inputs.items()}
    scales, bounds = _common_scales(config, leaves, inputs, share, splits)
    random_streams = {i: _random.stream(state.key, i, device) for i in inputs}
    code_sums = _summed_codes(
        inputs, scales, bounds, random_streams, splits, config.axis, num_devices
    )
    for i in compressed:
        finite = jnp.isfinite(scales[i])
        mean = jnp.where(finite, ternary_dequantize(code_sums[i], scales[i]), jnp.nan)
        means[i] = jnp.where(has_weight, mean, 0.0).astype(leaves[i].dtype)
        if config.keep_residual:
            new_residuals[i] = jnp.where(
                finite & has_weight,
                inputs[i] - clip(inputs[i], bounds[i]),
                residuals[i],
            )

    residual_treedef = jax.tree.structure(state.residual, is_leaf=is_masked)
    result = (
        jax.tree.unflatten(treedef, means),
        TernaryState(
            _random.advance(state.key),
            jax.tree.unflatten(residual_treedef, new_residuals),
        ),
    )
    if not config.report_sq_excess:
        return result
    sq_excess = _sq_excess(inputs, scales, bounds, splits, config.axis)
    return (*result, jnp.where(has_weight, sq_excess, 0.0))


def _exact_means(
    leaves: list[jax.Array],
    exact: list[int],
    weight: Any,
    axis: Any,
    num_devices: int,
) -> tuple[dict[int, jax.Array], jax.Array, jax.Array]:
    """Collective 1: the total weight and the uncompressed leaves' sums in
    one all-reduce. Returns those leaves' means by index, this device's
    share of the mean and whether the total weight is nonzero."""
    # A device's term is a select, not a multiply, so a weight-0 device's
    # NaN gradients contribute nothing (0 * NaN).
    if weight is None:
        raw = jnp.float32(1.0)
        sums = _psum_list([leaves[i].astype(jnp.float32) for i in exact], axis)
        total = jnp.float32(num_devices)
    else:
        raw = _weights.scalar_weight(weight, _CALLER)
        sums = [_weights.weighted(raw, leaves[i].astype(jnp.float32)) for i in exact]
        total, *sums = _psum_list([raw, *sums], axis)
    share, has_weight = _weights.share(raw, total)
    inverse_total = _weights.share(jnp.float32(1.0), total)[0]
    means = {
        i: (leaf_sum * inverse_total).astype(leaves[i].dtype)
        for i, leaf_sum in zip(exact, sums, strict=True)
    }
    return means, share, has_weight


def _common_scales(
    config: MeanConfig,
    leaves: list[jax.Array],
    inputs: dict[int, jax.Array],
    share: jax.Array,
    splits: list[_blocks.Split],
) -> tuple[dict[int, jax.Array], dict[int, jax.Array]]:
    """Collective 2: the scale every device codes each compressed leaf
    against (the pmax of the devices' clipping bounds, +inf where any input
    is not finite), and this device's clipping bounds, by leaf index."""
    bounds, local_scales = {}, []
    for i, x in inputs.items():
        if config.keep_residual:
            scale, bounds[i], finite = scale_and_bound(
                x, config.clip_sigma, split=splits[i]
            )
        else:
            # The statistics of share * g from g's own reductions: XLA:CPU
            # would write the product out for them, an extra pass. A
            # weight-0 device stays out even with non-finite gradients.
            scale, bounds[i], finite = scale_and_bound(
                leaves[i].astype(jnp.float32),
                config.clip_sigma,
                share,
                split=splits[i],
            )
            scale = jnp.where(share != 0, scale, 0.0)
            bounds[i] = jnp.where(share != 0, bounds[i], 0.0)  # not 0 * inf
            finite = finite | (share == 0)
        # A non-finite input is marked +inf, not NaN: max is guaranteed
        # to propagate inf to every device.
        local_scales.append(jnp.where(finite, scale, jnp.inf))
    # One pmax for all leaves' scales.
    scales = dict(zip(inputs, _pmax_stacked(local_scales, config.axis), strict=True))
    return scales, bounds


def _summed_codes(
    inputs: dict[int, jax.Array],
    scales: dict[int, jax.Array],
    bounds: dict[int, jax.Array],
    random_streams: dict[int, jax.Array],
    splits: list[_blocks.Split],
    axis: Any,
    num_devices: int,
) -> dict[int, jax.Array]:
    """Collective 3: this device's TernGrad codes of each input against its
    common scale, summed over the devices in one packed integer psum; the
    int32 code sums by leaf index."""
    codes = {
        i: stochastic_codes(x, scales[i], bounds[i], random_streams[i], splits[i])
        for i, x in inputs.items()
    }
    sums = packed_psum(list(codes.values()), axis, num_devices)
    return dict(zip(codes, sums, strict=True))
