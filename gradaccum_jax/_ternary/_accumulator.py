"""`ternary_accumulate`: a window kept as int8 code sums and float32 scales."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import _checks, _tree
from gradaccum_jax._accumulation import (
    AccumulationTransformation,
    ShouldSkipUpdateFunction,
)
from gradaccum_jax._accumulation._configuration import configure
from gradaccum_jax._accumulation._multisteps import configured_transformation
from gradaccum_jax._codecs._ternary_kernels import (
    checked_arguments,
    codes_from_bits,
    poison_if_nonfinite,
    scale_and_bound,
    ternary_dequantize,
)
from gradaccum_jax._compression import _random
from gradaccum_jax._compression._leaves import (
    DEFAULT_MIN_SIZE,
    NoResidual,
    is_compressed,
    keeps_no_array,
    real_leaves,
    slots,
    with_slots,
)
from gradaccum_jax._reduction import WindowReduction
from gradaccum_jax._statistic import WindowStatistic
from gradaccum_jax._window._accumulator import WindowAccumulator
from gradaccum_jax._window._size import AdaptiveWindow

# Largest every_k each code-sum dtype can hold: a window adds at most one
# code in {-1, 0, 1} per micro-step, so |sum| <= every_k.
_CODE_SUM_DTYPES = ((127, jnp.int8), (32767, jnp.int16))


class TernaryAccumulatorState(NamedTuple):
    """One window of `gradaccum_jax.ternary_accumulate`, stored in
    ``MultiStepsState.acc_grads``.

    Attributes:
      key: ``uint32[2] = (seed, micro-step counter)``, the counter of the
        random bits (see ``_compression._random``), advanced on every micro-step
        that adds; kept by reset.
      code_sums: per leaf, the window's sum of ternary codes (int8, or int16
        when every_k > 127); for leaves smaller than ``min_size``, the exact
        float32 weighted sum instead.
      scales: per compressed leaf, the window's float32 scale (the running
        maximum of the micro-steps' scales); a `NoResidual` (the leaf's
        shape, no array) for uncompressed leaves. The window's sum is
        ``code_sums * scales``.
    """

    key: jax.Array
    code_sums: optax.Updates
    scales: optax.Updates


def _code_sum_dtype(max_codes: int) -> Any:
    """The smallest integer dtype that holds a sum of ``max_codes`` codes."""
    for limit, dtype in _CODE_SUM_DTYPES:
        if max_codes <= limit:
            return dtype
    raise ValueError(
        f"ternary_accumulate: `every_k` (or `max_every_k`) must be <= "
        f"{_CODE_SUM_DTYPES[-1][0]} so that a window's code sums fit in int16, "
        f"got {max_codes}. Beyond that an int32 code sum would take as much "
        "memory as a float32 accumulator: use MultiSteps instead."
    )


def _ternary_window_accumulator(
    seed: int,
    clip_sigma: float | None,
    min_size: int = DEFAULT_MIN_SIZE,
    code_sum_dtype: Any = jnp.int8,
) -> WindowAccumulator:
    """A `WindowAccumulator` storing ternary code sums and per-leaf scales.

    Each micro-step's weighted gradient ``v = w * g`` is clipped (TernGrad)
    and the window's scale grows to ``s' = max(s, scale(v))``, where
    ``scale(v)`` is the clipping bound (``max|v|`` without clipping; see
    ``_ternary_kernels.scale_and_bound``: one reduction of ``g``). When it
    grows, the code sums so far are stochastically rounded to the new scale
    (``S <- round(S * s / s')``, unbiased), then ``v``'s TernGrad codes
    against ``s'`` are added. Every step is unbiased given the past, so
    ``E[total()] = sum_i w_i clip(g_i)`` over the window, exactly
    ``sum_i w_i g_i`` with ``clip_sigma=None``: unlike the average-scale
    trick, a later, larger micro-batch is neither clipped to the first one's
    scale nor mis-weighted. ``|S| <= micro-steps added``, and sums saturate
    at the dtype's range rather than wrap.
    """

    code_sums = _CodeSums.of(code_sum_dtype)

    def init(params):
        return _window_init(seed, min_size, code_sum_dtype, params)

    def add(acc, grads, weight):
        return _window_add(acc, grads, weight, clip_sigma, code_sums)

    def total(acc):
        def leaf_total(code_sum, scale):
            if keeps_no_array(scale):
                return code_sum
            return ternary_dequantize(code_sum, scale)

        return jax.tree.map(leaf_total, acc.code_sums, acc.scales)

    def reset(acc):
        return TernaryAccumulatorState(
            acc.key,
            jax.tree.map(_tree.zeros_like, acc.code_sums),
            jax.tree.map(_tree.zeros_like, acc.scales),
        )

    def for_device(acc, device):
        # Each device's window draws its own bits: devices that shared one
        # stream would round their terms alike, adding up their errors.
        return acc._replace(key=_random.derive(acc.key, device))

    return WindowAccumulator(
        init=init, add=add, total=total, reset=reset, for_device=for_device
    )


class _CodeSums(NamedTuple):
    """How a window's code sums are stored: their integer dtype, the
    ``limit`` they saturate at (``|S| <= limit``) and the fraction bits of
    their fixed-point re-rounding."""

    dtype: Any
    limit: int
    fraction_bits: int

    @classmethod
    def of(cls, dtype: Any) -> _CodeSums:
        limit = int(jnp.iinfo(dtype).max)
        # Fraction bits of the fixed-point re-rounding: |S| * 2**bits must fit
        # int32 (24 for int8 sums, 16 for int16 ones).
        fraction_bits = min(_random.PROBABILITY_BITS, 31 - limit.bit_length())
        return cls(dtype, limit, fraction_bits)


def _window_init(
    seed: int, min_size: int, code_sum_dtype: Any, params: Any
) -> TernaryAccumulatorState:
    """An empty window: zero code sums (float32 sums for small leaves) and
    zero scales, with the seed's random stream."""
    real_leaves(params, "ternary_accumulate: params", "ternary compression")

    def code_sum_init(param):
        if is_compressed(param, min_size):
            return _tree.zeros_like(param, code_sum_dtype)
        return _tree.zeros_like(param, jnp.float32)

    def scale_init(param):
        if is_compressed(param, min_size):
            return jnp.zeros((), jnp.float32)
        return NoResidual(tuple(np.shape(param)))

    return TernaryAccumulatorState(
        _random.seed_state(seed),
        jax.tree.map(code_sum_init, params),
        jax.tree.map(scale_init, params),
    )


def _window_add(
    acc: TernaryAccumulatorState,
    grads: Any,
    weight: Any,
    clip_sigma: float | None,
    code_sums: _CodeSums,
) -> TernaryAccumulatorState:
    """The window with ``weight * grads`` added (see `_add_leaf`); the same
    window where ``weight`` is 0."""
    _checks.floating_leaves(grads, "ternary_accumulate: gradients")
    real_leaves(grads, "ternary_accumulate: gradients", "ternary compression")
    _checks.same_structure(
        grads, acc.code_sums, "ternary_accumulate: gradients", "the parameters"
    )
    weight = jnp.asarray(weight, jnp.float32)
    leaves, treedef = jax.tree.flatten(grads)
    sums = jax.tree.leaves(acc.code_sums)
    scales = slots(acc.scales)
    pairs = [
        _add_leaf(acc.key, i, weight, clip_sigma, code_sums, *args)
        for i, args in enumerate(zip(leaves, sums, scales, strict=True))
    ]
    new_acc = TernaryAccumulatorState(
        _random.advance(acc.key),
        jax.tree.unflatten(treedef, [pair[0] for pair in pairs]),
        with_slots(acc.scales, [pair[1] for pair in pairs]),
    )
    # A zero weight (a skipped micro-batch) must change nothing, even if
    # its gradients hold NaN (0 * NaN is NaN): a select, not a multiply.
    return jax.tree.map(lambda new, old: jnp.where(weight != 0, new, old), new_acc, acc)


def _add_leaf(
    key: jax.Array,
    index: int,
    weight: jax.Array,
    clip_sigma: float | None,
    code_sums: _CodeSums,
    grad: jax.Array,
    code_sum: jax.Array,
    scale: Any,
) -> tuple[jax.Array, Any]:
    """``(code sum, scale)`` of leaf ``index`` after adding ``weight * grad``:
    the scale grows to cover it, the sum so far is re-rounded to that scale
    (`_rescale`) and the codes of ``weight * grad`` are added; small leaves
    add ``weight * grad`` to their float32 sum."""
    value = weight * grad.astype(jnp.float32)
    if keeps_no_array(scale):
        return code_sum + value, scale
    # The statistics of w * g from those of g: no w * g written out.
    step_scale, bound, finite = scale_and_bound(
        grad.astype(jnp.float32), clip_sigma, weight
    )
    new_scale = poison_if_nonfinite(finite, jnp.maximum(scale, step_scale))
    random_bits = _random.bits(_random.stream(key, index), value)
    kept = _rescale(code_sum, scale, new_scale, random_bits, code_sums.fraction_bits)
    # One draw serves both roundings: each stays unbiased on its own,
    # and mirroring the bits where v > 0 makes the covariance of the
    # two terms <= 0 for either sign of v (the re-rounding adds +1 for
    # small bits, the code +1 for large ones or -1 for small ones),
    # so sharing the draw can only lower the variance of their sum.
    mirrored = jnp.where(value > 0, ~random_bits, random_bits)
    codes = codes_from_bits(value, new_scale, bound, mirrored)
    limit = code_sums.limit
    new_sum = jnp.clip(kept + codes.astype(jnp.int32), -limit, limit)
    # A NaN scale marks the window as poisoned until reset.
    new_sum = jnp.where(jnp.isfinite(new_scale), new_sum, 0)
    return new_sum.astype(code_sums.dtype), new_scale


def _rescale(code_sum, scale, new_scale, random_bits, fraction_bits):
    """round(S * s / s') in int32, unbiased: fixed point, exact at s = s'."""
    ratio = jnp.where(new_scale > 0, scale / jnp.where(new_scale > 0, new_scale, 1), 0)
    # ratio <= 1 in fixed point; rounding it to 2**-fraction_bits is
    # the one deterministic rounding (at most |S| * 2**-25 codes).
    ratio = jnp.round(jnp.minimum(ratio, 1) * 2**fraction_bits)
    scaled = code_sum.astype(jnp.int32) * ratio.astype(jnp.int32)
    fraction = scaled & ((1 << fraction_bits) - 1)
    draw = (random_bits >> (32 - fraction_bits)).astype(jnp.int32)
    return (scaled >> fraction_bits) + (draw < fraction).astype(jnp.int32)


def ternary_accumulate(
    opt: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], jax.Array],
    *,
    seed: int = 0,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
    max_every_k: int | None = None,
    use_grad_mean: bool = True,
    should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
    skip_nonfinite: bool = False,
    count_skipped: bool = False,
    track_noise_scale: bool = False,
    noise_scale_decay: float = 0.95,
    noise_scale_estimator: str = "sampled",
    unreduced_axes: str | Sequence[str] = (),
    window_reduction: WindowReduction | None = None,
    statistics: Mapping[str, WindowStatistic] | None = None,
) -> AccumulationTransformation:
    """Gradient accumulation with a ternary accumulator (~1 byte per parameter).

    `MultiSteps` whose window sum is stored as integer sums of TernGrad codes
    (Wen et al., NeurIPS 2017) plus one float32 scale per leaf (a scanned
    stack of layers too, unlike the ternary codec's scale per layer),
    instead of a float32 sum: about a quarter of the accumulator memory (int8 code sums,
    or int16 when a window can exceed 127 micro-steps). The emitted gradient
    is an unbiased estimate of the window's (weighted) mean of the clipped
    micro-batch gradients, exactly unbiased for the mean of the gradients
    with ``clip_sigma=None``. The ternary guide, section "How
    ternary_accumulate keeps a window", has the scale rule, the variance,
    weights, sharding and the per-device windows of ``unreduced_axes``.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> opt = ga.ternary_accumulate(optax.sgd(1.0), 2, clip_sigma=None, min_size=1)
    >>> params = {"w": jnp.zeros(1024)}
    >>> state = opt.init(params)
    >>> ga.measure.state_nbytes(state.acc_grads) < ga.measure.state_nbytes(params) // 3
    True
    >>> for g in (1.0, 3.0):
    ...     updates, state = opt.update({"w": jnp.full(1024, g)}, state, params)
    >>> round(float(updates["w"].mean()), 1)  # unbiased: the window's -mean
    -2.0

    Args:
      opt: the inner optimizer, run once per window.
      every_k: micro-steps per window: an int in [1, 32767], or a function of
        the gradient step as in `MultiSteps`.
      seed: an integer in [0, 2**32 - 1] seeding the stochastic rounding.
      clip_sigma: TernGrad's clipping of each micro-step, in standard
        deviations; None disables it. Must be > 0.
      min_size: leaves with fewer elements accumulate exactly in float32.
      max_every_k: for a callable ``every_k``, the largest window it returns;
        it picks the code-sum dtype (int8 up to 127, else int16, the default
        for callables). Code sums saturate, never wrap, past it.
      use_grad_mean: as in `MultiSteps`.
      should_skip_update_fn: as in `MultiSteps`.
      skip_nonfinite: as in `MultiSteps`.
      count_skipped: as in `MultiSteps`.
      track_noise_scale: must be False: a ternary window never holds the
        exact sum whose squared norm the noise scale needs. Track it with a
        float window (`MultiSteps`, or `ternary_window_reduction` for
        ternary codes on the wire).
      noise_scale_decay: as in `MultiSteps`.
      noise_scale_estimator: as in `MultiSteps`: ``"sampled"`` or ``"all"``.
      unreduced_axes: one mesh axis over which the gradients arrive as
        per-device terms (`local_value_and_grad`): each device keeps its own
        ternary window, reduced once per window in float32. Checkpoint
        ``reduce_window(state)``, not the state (whose unreduced window
        weight orbax cannot save).
      window_reduction: as in `MultiSteps`, with ``unreduced_axes`` only:
        how each device's decoded window (its float term of the window's
        sum) is summed over the devices; None: one float32 all-reduce,
        `gradaccum_jax.ternary_window_reduction` puts codes on the wire
        too (a second rounding, still unbiased).
      statistics: as in `MultiSteps`: more window statistics, by name;
        their ``close`` sees the decoded window, which holds the codes'
        rounding.

    Returns:
      An `AccumulationTransformation` (``init``, ``update``, ``flush``,
      ``reset``, ``stats``, ``has_updated``), as `MultiSteps` gives; the
      state's ``acc_grads`` is a `gradaccum_jax.extend.TernaryAccumulatorState`.
    """
    _no_noise_scale(every_k, track_noise_scale)
    code_sum_dtype = _code_sum_dtype(_window_limit(every_k, max_every_k))
    seed, clip_sigma, min_size = checked_arguments(seed, clip_sigma, min_size)
    accumulator = _ternary_window_accumulator(
        seed, clip_sigma, min_size, code_sum_dtype
    )
    config = configure(
        opt,
        every_k,
        every_k_argument="every_k",
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        skip_nonfinite=skip_nonfinite,
        count_skipped=count_skipped,
        window_accumulator=accumulator,
        unreduced_axes=unreduced_axes,
        window_reduction=window_reduction,
        track_noise_scale=track_noise_scale,
        noise_scale_decay=noise_scale_decay,
        noise_scale_estimator=noise_scale_estimator,
        statistics=statistics,
    )
    return configured_transformation(config)


def _no_noise_scale(every_k: Any, track_noise_scale: Any) -> None:
    """Refuses the gradient noise scale on a ternary window.

    Its estimate needs ``|G_win|^2``, the squared norm of the window's sum.
    The codes' rounding adds its variance to the decoded sum's squared norm
    and the accumulator keeps no float sum to take it from (on a
    closed-form regression, before this refusal, ``|G|^2`` came out
    several times the truth). Only the window knows its
    rounding (each micro-step's codes and re-roundings), so it is refused
    rather than reported wrong.
    """
    adaptive = isinstance(every_k, AdaptiveWindow)
    if track_noise_scale is True or adaptive:
        argument = "every_k" if adaptive else "track_noise_scale"
        raise ValueError(
            f"ternary_accumulate: `{argument}` asks for the gradient noise "
            "scale, which a ternary window cannot measure without bias (the "
            "codes' rounding variance adds to the window's squared norm: "
            "B_simple came out 12x too small on a closed-form regression). "
            "Accepted: track_noise_scale=False and an int or callable "
            "every_k. Track it with a float window (MultiSteps) or, for "
            "ternary codes on the wire, MultiSteps(..., window_reduction="
            "ternary_window_reduction(seed), unreduced_axes=...)."
        )


def _window_limit(every_k: Any, max_every_k: int | None) -> int:
    """The most micro-steps a window of ``every_k`` may hold, ``every_k`` and
    ``max_every_k`` checked: what its code sums must fit."""
    if callable(every_k):
        if max_every_k is None:
            return _CODE_SUM_DTYPES[-1][0]
        return _checks.positive_int("max_every_k", max_every_k)
    limit = _checks.positive_int("every_k", every_k)
    if max_every_k is not None:
        limit = max(limit, _checks.positive_int("max_every_k", max_every_k))
    return limit
