"""`compressed_average_across_devices`: a codec on the wire of a device mean."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from gradaccum_jax import _checks
from gradaccum_jax._codecs import _mean
from gradaccum_jax._codecs._protocol import Codec, CodecState
from gradaccum_jax._compression._leaves import real_leaves

_CALLER = "compressed_average_across_devices"


def codec_argument(value: Any) -> Codec:
    """Validates ``codec``: a `gradaccum_jax.extend.Codec`."""
    if not isinstance(value, Codec):
        raise ValueError(
            "`codec` must be a Codec, one of gradaccum_jax.codecs (ternary(), "
            "quantized(bits=8), topk(density=0.01), powersgd(rank=4)) or a "
            f"gradaccum_jax.extend.Codec of your own, got {value!r}."
        )
    return value


def compressed_average_across_devices(
    axis_name: str | tuple[str, ...],
    codec: Codec,
    *,
    seed: int = 0,
    error_feedback: bool = True,
    residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """The mean of the updates across devices, sent compressed by ``codec``.

    Inside ``jax.pmap`` / ``jax.shard_map`` over ``axis_name`` (or as
    ``diloco(outer_reduction=)``), each device computes its share ``x_d =
    p_d * update_d + residual_d`` of the mean (``p_d = 1 / n``, or
    ``weight_d / sum(weight)`` with ``weight=``), and ``codec`` sums the
    shares over the devices with what it sends on the wire (codes, sparse
    entries, low-rank factors); the result is bitwise the same on every
    device. Leaves the codec does not compress (small ones, vectors for
    PowerSGD) are averaged exactly in float32, with the total weight, in
    one all-reduce.

    With ``error_feedback`` (Karimireddy et al., ICML 2019) each device
    keeps what it did not send, ``residual_d = x_d - sent_d``, and adds it
    to its next share, so nothing is lost over time: the running mean of
    the returned means tends to the true mean like 1/T. A device of zero
    weight contributes nothing (its NaNs included); a leaf that some device
    could not code (a NaN or an infinity) comes back NaN everywhere, and
    the residuals keep their values; a zero total weight returns zeros.

    Leaves split over other mesh axes (tensor-parallel params, HSDP) are
    coded where they lie, each device its own block: on Explicit axes as
    their types say; on Auto axes as ``init`` saw the params split, when it
    is given placed arrays (not under ``jax.jit``, whose types do not say
    it on Auto axes; the state keeps the split, ``CodecState.auto_splits``).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> tx = ga.compressed_average_across_devices(
    ...     "data", ga.codecs.quantized(bits=8, min_size=1)
    ... )
    >>> def mean(update):
    ...     return tx.update(update, tx.init(update))[0]
    >>> x = jnp.tile(jnp.array([1.0, -1.0, 0.5, 2.0]), (8, 1))  # 8 devices
    >>> jax.pmap(mean, axis_name="data")(x)[0]  # powers of 2: exact codes
    Array([ 1. , -1. ,  0.5,  2. ], dtype=float32)

    Args:
      axis_name: the pmap / shard_map axis (or tuple of axes) to average over.
      codec: what goes on the wire, from `gradaccum_jax.codecs`.
      seed: an integer in [0, 2**32 - 1]: the codec's random draws (each
        device draws its own from it; the state's counter is the same on
        every device).
      error_feedback: keep each device's unsent part for the next step.
      residual_dtype: ``jnp.float32`` or ``jnp.bfloat16``: the residual's
        dtype. bfloat16 halves its bytes (a float32 copy of every coded
        leaf, on each device); each step rounds it stochastically, so the
        roundings are unbiased (the low-communication guide measures the
        running mean's error against float32's).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `gradaccum_jax.extend.CodecState` (its residual per device) and whose
      update accepts an optional scalar ``weight=`` and ``leaf_layouts=``
      (each leaf's split over Auto mesh axes, as `diloco` passes it: each
      device then codes its own block).
    """
    return average(
        axis_name, codec, seed, error_feedback, _CALLER, residual_dtype=residual_dtype
    )


def average(
    axis_name: Any,
    codec: Any,
    seed: Any,
    error_feedback: Any,
    caller: str,
    coder: str | None = None,
    residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """`compressed_average_across_devices`, its messages naming ``caller``
    (and ``coder``, what codes the leaves: the codec by default)."""
    axis = _checks.axis_name("axis_name", axis_name)
    codec = codec_argument(codec)
    seed = _checks.prng_seed("seed", seed)
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    config = _mean.Reduce(
        codec,
        axis,
        error_feedback,
        caller=caller,
        coder=coder,
        residual_dtype=_checks.residual_dtype("residual_dtype", residual_dtype),
    )

    def init_fn(params):
        real_leaves(params, f"{config.caller}: params", config.coder_name)
        return _mean.state_init(config, params, seed)

    def update_fn(
        updates,
        state: CodecState,
        params=None,
        *,
        weight=None,
        leaf_layouts=None,
        **extra,
    ):
        del params, extra
        _mean.check_updates(config, updates, state)
        means, state, _ = _mean.reduce_with_codec(
            config, updates, state, weight, layouts=leaf_layouts
        )
        return means, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
