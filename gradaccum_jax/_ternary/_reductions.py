"""The ternary codec's front doors: `ternary_average_across_devices` and
`ternary_window_reduction`, the ``compressed_*`` pair with TernGrad's
stochastic rounding (`gradaccum_jax.codecs.ternary`)."""

from __future__ import annotations

import optax

from gradaccum_jax import _reduction
from gradaccum_jax._codecs._average import average
from gradaccum_jax._codecs._ternary import ternary
from gradaccum_jax._codecs._window import window_reduction
from gradaccum_jax._compression._leaves import DEFAULT_MIN_SIZE

_CODER = "ternary compression"


def ternary_average_across_devices(
    axis_name: str | tuple[str, ...],
    seed: int,
    *,
    error_feedback: bool = True,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
) -> optax.GradientTransformationExtraArgs:
    """The mean of the updates across devices, sent as ternary codes.

    `gradaccum_jax.compressed_average_across_devices` with
    ``codecs.ternary(clip_sigma=clip_sigma, rounding="stochastic",
    min_size=min_size)``: inside ``jax.pmap`` / ``jax.shard_map`` over
    ``axis_name`` each device clips its share of the (weighted) mean
    (TernGrad, Wen et al., NeurIPS 2017), the devices agree on one scale
    per leaf (per layer of a scanned leaf) by a pmax, and each draws
    TernGrad's unbiased codes with its own random bits; one packed integer
    all-reduce sums them (7 codes a uint32 word with 8 devices, 1/7 of a
    float32 mean's bytes), bitwise the same on every device. Its
    expectation is the mean of the clipped shares, the mean itself with
    ``clip_sigma=None``. With ``error_feedback`` each device keeps its
    clipping error (not its rounding noise) for the next call. The
    ternary guide, section "The device mean on the wire", has the wire
    format, the residual's rules, tensor-parallel leaves, a zero weight
    and a non-finite update.

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
      An ``optax.GradientTransformationExtraArgs`` with a
      `gradaccum_jax.extend.CodecState` whose update accepts an optional
      scalar ``weight=`` (what this device saw, e.g. its number of
      examples; see `MultiSteps`) and ``leaf_layouts=`` (as `diloco`
      passes it), and ignores other extra arguments.
    """
    codec = ternary(clip_sigma=clip_sigma, rounding="stochastic", min_size=min_size)
    caller = "ternary_average_across_devices"
    return average(axis_name, codec, seed, error_feedback, caller, _CODER)


def ternary_window_reduction(
    seed: int,
    *,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
) -> _reduction.WindowReduction:
    """Sums a window's per-device terms over devices as ternary codes.

    For `MultiSteps` with ``unreduced_axes`` (``window_reduction=``):
    `gradaccum_jax.compressed_window_reduction` with
    ``codecs.ternary(clip_sigma=clip_sigma, rounding="stochastic",
    min_size=min_size)`` and no error feedback. At the emitting call each
    device codes its term of the window's sum against one scale per leaf
    (per layer of a scanned leaf) shared by a pmax, and one packed integer
    all-reduce sums the codes (1/7 of the float32 bytes with 8 devices),
    bitwise the same on every device; a term split over another mesh axis
    is coded where it lies. With ``clip_sigma=None`` the sum is an unbiased
    estimate of the window's; clipping trades a small bias for less noise,
    and its error is not kept. It reports what the codes add to the sum's
    squared norm (``sq_excess``), so that a gradient noise scale tracked
    on the window stays unbiased. The ternary guide, section "Ternary
    window reduction", has why, and how a restored run emits the same
    updates.

    Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> from jax.sharding import AxisType
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    >>> reduction = ga.ternary_window_reduction(0, clip_sigma=None, min_size=1)
    >>> opt = ga.MultiSteps(
    ...     optax.sgd(1.0), 2, unreduced_axes="data", window_reduction=reduction
    ... )
    >>> def loss_fn(w, x):
    ...     return jnp.mean(x @ w)
    >>> w, x = jnp.zeros(4), jnp.ones((8, 4))
    >>> with jax.set_mesh(mesh):
    ...     state = opt.init(w)
    ...     grad_fn = jax.jit(ga.local_value_and_grad(loss_fn))
    ...     for _ in range(2):
    ...         _, grads = grad_fn(w, x)
    ...         updates, state = jax.jit(opt.update)(grads, state, w)
    >>> updates  # equal terms: the codes carry them exactly
    Array([-1., -1., -1., -1.], dtype=float32)

    Args:
      seed: an integer in [0, 2**32 - 1].
      clip_sigma: TernGrad's clipping threshold in standard deviations;
        None disables it (unbiased). Must be > 0.
      min_size: leaves with fewer elements are summed exactly in float32
        (leaves of one element always are: ternarizing one would send its
        float32 scale anyway).

    Returns:
      A `gradaccum_jax.extend.WindowReduction` for
      ``MultiSteps(..., window_reduction=...)``.
    """
    codec = ternary(clip_sigma=clip_sigma, rounding="stochastic", min_size=min_size)
    caller = "ternary_window_reduction"
    return window_reduction(codec, seed, False, caller, _CODER)
