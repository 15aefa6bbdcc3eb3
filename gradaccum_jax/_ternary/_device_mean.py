"""The mean of updates across devices with ternary codes on the wire: the
ternary codec (`gradaccum_jax.codecs.ternary`) with TernGrad's rounding."""

from __future__ import annotations

import optax

from gradaccum_jax import _checks
from gradaccum_jax._codecs import _mean
from gradaccum_jax._codecs._protocol import CodecState
from gradaccum_jax._codecs._ternary import ternary_codec
from gradaccum_jax._ternary._error_feedback import TernaryState
from gradaccum_jax._ternary._leaves import (
    DEFAULT_MIN_SIZE,
    check_updates,
    common_config,
    real_leaves,
)

_CALLER = "ternary_average_across_devices"


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

    It is `gradaccum_jax.compressed_average_across_devices` with
    ``codecs.ternary(clip_sigma=..., rounding="stochastic")``, its state a
    `TernaryState`. The codes travel as digits of uint32 words (7 per word
    with 8 devices, 1/7 of a float32 psum); leaves smaller than
    ``min_size`` are averaged exactly in float32. A leaf split over another
    mesh axis by explicit sharding (tensor-parallel params within a
    ``shard_map`` over ``axis_name`` alone) keeps its split: each device
    codes and sends its own block. With ``error_feedback`` (Karimireddy et
    al., ICML 2019) each device keeps its clipping error for the next step
    (not its rounding noise: see `gradaccum_jax.codecs.ternary`). The
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
    codec = ternary_codec(clip_sigma, "stochastic", min_size, "ternary codes")
    config = _mean.Reduce(codec, axis, error_feedback, caller=_CALLER)

    def init_fn(params):
        real_leaves(params, f"{_CALLER}: params")
        state = _mean.state_init(config, params, seed)
        return TernaryState(state.key, state.residual, state.auto_splits)

    def update_fn(
        updates, state, params=None, *, weight=None, leaf_layouts=None, **extra_args
    ):
        del params, extra_args
        check_updates(updates, state.residual, _CALLER, min_size, config.keeps_residual)
        means, new_state, _ = _mean.reduce_with_codec(
            config,
            updates,
            CodecState(state.key, state.residual, (), state.auto_splits),
            weight,
            layouts=leaf_layouts,
        )
        return means, TernaryState(new_state.key, new_state.residual, state.auto_splits)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
