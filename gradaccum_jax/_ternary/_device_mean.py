"""The mean of updates across devices with ternary codes on the wire."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import _checks, _weights
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
)
from gradaccum_jax._ternary._quantize import (
    clip_to_sigma,
    stochastic_codes,
    ternary_dequantize,
)
from gradaccum_jax._ternary._random import seed_key, split_per_leaf


def packed_psum(codes: jax.Array, axis: Any, num_devices: int) -> jax.Array:
    """Sums flat int8 ternary codes over ``axis``; returns the int32 sums.

    Each device's code c in {-1, 0, 1} is sent as the digit c + 1 in {0, 1, 2}
    in a bit field of a uint32 word. The sum over n devices of one field is
    at most 2n, so fields of ``bit_length(2n)`` bits never carry into each
    other and one integer psum adds all fields at once, exactly. With 8
    devices that is 6 codes per 4 bytes (5.3 bits per code, 2/3 of an int8
    psum); up to 127 devices it is never more than the 8 bits of an int8
    psum, which would overflow beyond 127 devices anyway.
    """
    bits = (2 * num_devices).bit_length()
    per_word = 32 // bits
    if per_word < 2:  # more than 2**15 devices: plain int32 sums.
        return jax.lax.psum(codes.astype(jnp.int32), axis)
    size = codes.shape[0]
    digits = jnp.pad(codes, (0, -size % per_word)).astype(jnp.int32) + 1
    digits = digits.astype(jnp.uint32).reshape(-1, per_word)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    # The fields are disjoint, so summing them equals OR-ing them.
    words = jnp.sum(digits << shifts, axis=1, dtype=jnp.uint32)
    words = jax.lax.psum(words, axis)
    fields = (words[:, None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return fields.astype(jnp.int32).reshape(-1)[:size] - num_devices


def _device_share(
    weight: Any, axis: Any, num_devices: int, caller: str
) -> tuple[jax.Array, jax.Array]:
    """This device's share of a (weighted) mean, and whether any weight exists.

    ``1 / n`` without a weight; ``weight / psum(weight)`` with one, and 0
    (with ``has_weight`` False) when the total weight is 0.
    """
    if weight is None:
        return jnp.float32(1.0 / num_devices), jnp.bool_(True)
    weight = _weights.scalar_weight(weight, caller)
    return _weights.share(weight, jax.lax.psum(weight, axis))


def _pmax_stacked(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    """pmax of several scalars in one all-reduce."""
    if not values:
        return []
    return list(jax.lax.pmax(jnp.stack(values), axis))


def _psum_codes(
    codes: dict[int, jax.Array], axis: Any, num_devices: int
) -> dict[int, jax.Array]:
    """Sums each leaf's int8 codes over devices in one packed psum."""
    if not codes:
        return {}
    flat = jnp.concatenate([c.reshape(-1) for c in codes.values()])
    sums = packed_psum(flat, axis, num_devices)
    offsets = np.cumsum([0] + [c.size for c in codes.values()])
    return {
        i: sums[start:stop].reshape(c.shape)
        for (i, c), start, stop in zip(
            codes.items(), offsets[:-1], offsets[1:], strict=True
        )
    }


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
    agree on one scale per leaf, ``s = pmax(max|clipped x_d|)``. Each device
    then draws TernGrad's unbiased codes against ``s`` with its own key; the
    codes are summed over devices by one integer psum, and the result
    ``sum_d codes_d * s`` is bitwise identical on every device. Its
    expectation is the (weighted) mean of the clipped inputs: exactly the
    mean with ``clip_sigma=None``.

    On the wire: one uint32 word carries several devices' ternary codes as
    bit fields wide enough that the psum cannot carry between them (6 codes
    per word with 8 devices, i.e. 1/6 of a float32 psum; at most 1 byte per
    code up to 127 devices, more beyond), plus one float32 pmax per
    compressed leaf for the scales. Leaves smaller than ``min_size`` are
    averaged in float32.

    With ``error_feedback`` (Karimireddy et al., ICML 2019) each device keeps
    its own residual in float32 for the next step: its clipping error
    ``x_d - clip(x_d)``, the bias of the compressor. The rounding noise is
    unbiased and not fed back (doing so costs accuracy; see the module
    docstring), so ``E[sum of results] + sum_d residual_d`` equals the sum
    over steps of the (weighted) means of the updates, and with
    ``clip_sigma=None`` no residual is kept at all. A non-finite update on
    any device makes that step's
    result NaN on every device and leaves the residuals unchanged. A zero
    total weight gives zeros and leaves the residuals unchanged.

    Args:
      axis_name: the pmap / shard_map axis (or tuple of axes) to average over.
      seed: an integer in [0, 2**32 - 1]; every device starts from the same key
        and folds in its axis index, so the rounding noise is independent
        across devices yet the state is identical everywhere.
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
    caller = "ternary_average_across_devices"
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    keep_residual = keeps_residual(error_feedback, True, clip_sigma)

    def init_fn(params):
        return TernaryState(
            seed_key(seed), residual_init(params, min_size, keep_residual)
        )

    def update_fn(updates, state, params=None, *, weight=None, **extra_args):
        del params, extra_args
        check_updates(updates, state.residual, caller)
        num_devices = _checks.bound_axis_size(axis, caller)
        share, has_weight = _device_share(weight, axis, num_devices, caller)
        key, leaf_keys = split_per_leaf(state.key, updates)
        device_keys = [
            jax.random.fold_in(k, jax.lax.axis_index(axis))
            for k in jax.tree.leaves(leaf_keys)
        ]
        leaves, treedef = jax.tree.flatten(updates)
        residuals = jax.tree.flatten(state.residual, is_leaf=is_masked)[0]
        means, new_residuals = list(leaves), list(residuals)
        compressed = [
            i for i, leaf in enumerate(leaves) if is_compressed(leaf, min_size)
        ]

        for i, leaf in enumerate(leaves):
            if i not in compressed:
                mean = jax.lax.psum(share * leaf.astype(jnp.float32), axis)
                means[i] = mean.astype(leaf.dtype)

        # This device's share of the mean, plus what it failed to send before.
        inputs = {i: share * leaves[i].astype(jnp.float32) for i in compressed}
        if keep_residual:
            inputs = {i: x + residuals[i] for i, x in inputs.items()}
        clipped = {i: clip_to_sigma(x, clip_sigma) for i, x in inputs.items()}
        # One pmax for all leaves' scales. A non-finite input is marked +inf,
        # not NaN, because max is guaranteed to propagate inf to every device.
        local_scales = [
            jnp.where(
                jnp.all(jnp.isfinite(inputs[i])), jnp.max(jnp.abs(clipped[i])), jnp.inf
            )
            for i in compressed
        ]
        scales = dict(zip(compressed, _pmax_stacked(local_scales, axis), strict=True))
        codes = {
            i: stochastic_codes(clipped[i], scales[i], device_keys[i])
            for i in compressed
        }
        code_sums = _psum_codes(codes, axis, num_devices)

        for i in compressed:
            finite = jnp.isfinite(scales[i])
            mean = jnp.where(
                finite, ternary_dequantize(code_sums[i], scales[i]), jnp.nan
            )
            means[i] = jnp.where(has_weight, mean, 0.0).astype(leaves[i].dtype)
            if keep_residual:
                new_residuals[i] = jnp.where(
                    finite & has_weight, inputs[i] - clipped[i], residuals[i]
                )

        residual_treedef = jax.tree.structure(state.residual, is_leaf=is_masked)
        return (
            jax.tree.unflatten(treedef, means),
            TernaryState(key, jax.tree.unflatten(residual_treedef, new_residuals)),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
