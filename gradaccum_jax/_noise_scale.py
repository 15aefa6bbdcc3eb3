"""The gradient noise scale, from what accumulation already computes.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training" (arXiv:1812.06162), appendix A: the squared norm of a gradient
averaged over B examples has expectation ``|G|^2 + tr(S) / B``, with ``G``
the true gradient and ``S`` the per-example gradient covariance. Measured
at two batch sizes (a micro-batch and the window) the two unknowns follow
without bias, and so does the *simple noise scale*
``B_simple = tr(S) / |G|^2``, the batch size beyond which a larger batch
stops paying off (about the critical batch size).

Weighted micro-batches (micro-batch i of weight ``w_i``, its number of
examples, with mean gradient ``g_i``; ``W = sum w_i``, ``k`` micro-batches
of nonzero weight, ``G_win = sum w_i g_i / W``): a micro-batch's squared
norm has ``E[|g_i|^2] = |G|^2 + tr(S) / w_i`` and the window's
``E[C] = |G|^2 + tr(S) / W``, ``C = |G_win|^2``. Any set of ``n`` measured
micro-batches of total weight ``V`` then gives, with
``A = sum over them of w_i |g_i|^2``::

    E[A] = V |G|^2 + n tr(S)

    tr(S) = (A - V C) / (n - V / W),   |G|^2 = C - tr(S) / W

unbiased for any choice of the measured set made without looking at the
gradients. Measuring every micro-batch (``n = k``, ``V = W``) gives
``tr(S) = (A - W C) / (k - 1)``; with equal weights b these are the
paper's formulas with ``B_small = b``, ``B_big = k b``, and so is one
measured micro-batch (``B_small = w_j``). Without weights (every
``w_i = 1``) the unit of ``B_simple`` is micro-batches, not examples. A
window of one micro-batch measures one batch size only: it gives no
estimate.

Two estimators (``noise_scale_estimator``) pick the measured set of a
window of ``m`` slots (micro-batches)::

    "all":      every micro-batch of nonzero weight
    "sampled":  the one in slot j, j ~ U{0..m-1}

The sampled estimate is unbiased for each draw ``j``, not only on average
over the draws: a window whose micro-batches differ in size is measured
at the two batch sizes it actually holds, ``w_j`` and ``W``. (Scaling the
drawn norm up to ``A ~ m w_j |g_j|^2`` instead, with ``n = k`` and
``V = W``, is unbiased only on average over ``j``: with sizes alternating
2 and 14 a window's ``tr(S)`` came out 45% low where a 2 was drawn and 48%
high where a 14 was, and every run draws the same slots.) It reads the
gradients for a norm on one micro-step per window instead of every one
(XLA:CPU does not fuse the norm into the accumulation pass: a second read
of the gradients each time), and pays in variance: one micro-batch stands
for the window. The slot is a fixed hash of the window's index
(`sampled_slot`): no PRNG state, the same draw on every device and after a
checkpoint. A sampled window that closes before slot ``j`` is filled
(`flush`) gives no estimate.

Under data parallelism with ``unreduced_axes`` each device's gradient of a
micro-batch is a small batch of its own: every device keeps its own terms
of ``A``, ``V``, ``n`` and ``k`` (sampled: of its own micro-batch in slot
``j``), summed with the window at the emission, so ``n`` counts the
devices' micro-batches in the slot.

The accumulator keeps ``A``, ``V``, ``n`` and ``k`` (the statistic's
``observe``, once per micro-step; `noise_scale_statistic` is a
`WindowStatistic` of the engine) and, at each emission (`close_window`),
folds the window's estimate into an exponential moving average of
``|G|^2`` and of ``tr(S)`` separately, with bias correction; ``B_simple``
is the ratio of the two averages, as the paper advises (a ratio of noisy
estimates is biased, its average too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks, _partials, _tree
from gradaccum_jax._control import run_if
from gradaccum_jax._statistic import WindowStatistic


class NoiseScaleState(NamedTuple):
    """What the accumulator keeps for the noise scale
    (``MultiStepsState.statistics["noise_scale"]``).

    Attributes:
      sq_norm_sum: ``A = sum w_i |g_i|^2`` over the current window's
        measured micro-batches (``"sampled"``: ``w_j |g_j|^2`` once slot j
        is filled, 0 before), float32 (per-device terms with
        ``unreduced_axes``, like the window).
      micro_batches: ``k``, micro-batches of nonzero weight in the current window,
        float32 (a count summed over devices like ``A``).
      measured_weight: ``V``, the total weight of the measured micro-batches
        (float32 terms like ``A``).
      measured_count: ``n``, the measured micro-batches of nonzero weight
        (float32 terms like ``A``).
      grad_sq_norm: moving average of the windows' ``|G|^2`` estimates
        (not yet bias-corrected).
      noise_trace: moving average of the windows' ``tr(S)`` estimates (not
        yet bias-corrected).
      decay_power: ``decay ** n`` after n estimates; the bias correction
        divides the averages by ``1 - decay_power``.
    """

    sq_norm_sum: jax.Array
    micro_batches: jax.Array
    measured_weight: jax.Array
    measured_count: jax.Array
    grad_sq_norm: jax.Array
    noise_trace: jax.Array
    decay_power: jax.Array


class NoiseScaleEstimate(NamedTuple):
    """An estimate of the gradient noise scale (NaN where there is none).

    Attributes:
      grad_sq_norm: ``|G|^2``, the true gradient's squared norm (unbiased,
        so it can come out negative when the noise dominates).
      noise_trace: ``tr(S)``, the trace of the per-example gradient
        covariance (per unit of weight).
      noise_scale: ``B_simple = tr(S) / |G|^2`` in units of weight
        (examples when the weights count examples, micro-batches without
        weights); +inf when the ``|G|^2`` estimate is <= 0.
    """

    grad_sq_norm: jax.Array
    noise_trace: jax.Array
    noise_scale: jax.Array


def init(layout: _partials.TermsLayout | None = None) -> NoiseScaleState:
    """The state before any micro-batch: an empty window, no estimate.

    With a ``layout`` of per-device terms (``unreduced_axes``) the window's
    ``A``, ``k``, ``V`` and ``n`` are kept as terms; the averages are
    replicated.
    """
    window_zero = _partials.NoTerms().zeros if layout is None else layout.zeros

    # Distinct arrays, not one shared zero: a donated state must not hold
    # the same buffer twice.
    def zero():
        return jnp.zeros([], jnp.float32)

    return NoiseScaleState(
        sq_norm_sum=window_zero(zero()),
        micro_batches=window_zero(zero()),
        measured_weight=window_zero(zero()),
        measured_count=window_zero(zero()),
        grad_sq_norm=zero(),
        noise_trace=zero(),
        decay_power=jnp.ones([], jnp.float32),
    )


def sq_norm(tree: Any) -> jax.Array:
    """``sum |x|^2`` over every leaf, in float32 (the squared modulus if complex)."""
    return sum(
        (jnp.sum(_tree.squared_modulus(x)) for x in jax.tree.leaves(tree)),
        jnp.zeros([], jnp.float32),
    )


ESTIMATORS = ("sampled", "all")

# The name the accumulator keeps the noise scale under
# (``MultiStepsState.statistics``), with ``track_noise_scale=True`` or an
# `adaptive_every_k` window.
STATISTIC = "noise_scale"

# The measured slot is a fixed hash of the window's index: no PRNG state to
# keep, so a restored checkpoint draws the same slots, and a few scalar
# integer operations. (`jax.random.randint` on a folded key compiled to
# threefry loops that cost about 40 us per micro-step on XLA:CPU.)
_SLOT_SEED = 0x6E6F6973


def sampled_slot(gradient_step: jax.Array, window_size: jax.Array) -> jax.Array:
    """The slot measured in window ``gradient_step`` (``"sampled"``), int32.

    Uniform in ``[0, window_size)`` up to ``window_size / 2**32``: the
    window's index (the updates emitted before it), seeded and mixed by
    ``lowbias32`` (C. Wellons' integer hash, a bijection of uint32), modulo
    the window's size. A pure function of the two: the same on every device
    and after a checkpoint's restore.
    """
    x = jnp.asarray(gradient_step).astype(jnp.uint32) ^ jnp.uint32(_SLOT_SEED)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x % jnp.asarray(window_size).astype(jnp.uint32)).astype(jnp.int32)


def _if_measured(measured: Any, norm_term: Any, *operands: Any) -> jax.Array:
    """``norm_term(*operands)`` if ``measured`` else 0, a float32 scalar.

    Only a measured micro-step reads the gradients for the norm. `run_if`
    (a 0/1-trip while loop) rather than ``lax.cond``: neither copies a
    buffer here (the result is a scalar), and the loop measured a few
    percent faster on XLA:CPU at 16M parameters (noisy, but in each of
    three interleaved runs). Eagerly, with nothing traced, a Python ``if``.
    """
    if measured is True:
        return norm_term(*operands)
    return run_if(
        measured, lambda zero: norm_term(*operands), jnp.zeros([], jnp.float32)
    )


def add(state: NoiseScaleState, grads: Any, weight: jax.Array) -> NoiseScaleState:
    """Adds micro-batch ``grads`` of ``weight`` to the window, measured.

    The squared norm reads the gradients the window's add reads, in the same
    jitted step and with no data dependency between the two, so a compiler
    that fuses a reduction with its elementwise siblings reads them once.
    XLA:CPU does not (its multi-output fusion only merges loops of one
    output shape): there the norm is a second read of the gradients. A
    zero weight adds nothing, not even a NaN of its (skipped) gradients: a
    select, not a multiply.
    """
    has_weight = weight != 0
    term = jnp.where(has_weight, weight * sq_norm(grads), 0.0)
    count = has_weight.astype(jnp.float32)
    return _add_terms(state, (term, count, jnp.where(has_weight, weight, 0.0), count))


def _add_terms(state: NoiseScaleState, terms: tuple) -> NoiseScaleState:
    """The state with one micro-batch's ``(A, k, V, n)`` terms added."""
    sq_norm_term, count, measured_weight, measured_count = terms
    return state._replace(
        sq_norm_sum=state.sq_norm_sum + sq_norm_term,
        micro_batches=state.micro_batches + count,
        measured_weight=state.measured_weight + measured_weight,
        measured_count=state.measured_count + measured_count,
    )


def window_estimate(
    terms: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    weight: jax.Array,
    mean_sq_norm: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(|G|^2, tr(S), defined)`` from one window's terms, ``W`` and ``C``.

    ``terms`` are the window's ``(A, k, V, n)``. ``defined`` is False for a
    window of fewer than two micro-batches of nonzero weight (one batch
    size measured) or with none measured; the estimates are then NaN,
    never a division by zero. With two or more, ``n - V / W > 0``: the
    measured micro-batches hold less than ``n`` windows' weight.
    """
    sq_norm_sum, count, measured_weight, measured_count = terms
    defined = (count >= 2) & (measured_count >= 1)
    safe_weight = jnp.where(defined, weight, 1.0)
    spread = jnp.where(defined, measured_count - measured_weight / safe_weight, 1.0)
    trace = (sq_norm_sum - measured_weight * mean_sq_norm) / spread
    grad_sq_norm = mean_sq_norm - trace / safe_weight
    nan = jnp.full([], jnp.nan, jnp.float32)
    return (
        jnp.where(defined, grad_sq_norm, nan),
        jnp.where(defined, trace, nan),
        defined,
    )


def close_window(
    state: NoiseScaleState,
    window_sum: Any,
    weight: jax.Array,
    decay: float,
    sum_sq_excess: Any = 0.0,
    axis_name: Any = None,
) -> NoiseScaleState:
    """Folds the closing window's estimate into the moving averages.

    Args:
      state: the state holding the window's (reduced) ``A``, ``k``, ``V``
        and ``n``.
      window_sum: the window's weighted gradient sum ``W G_win`` (a pytree).
      weight: the window's total weight ``W``.
      decay: the moving average's decay in [0, 1) (0: the last window only).
      sum_sq_excess: ``E|window_sum|^2 - |exact sum|^2`` given the
        gradients, from a lossy reduction (`WindowPosition.sum_sq_excess`;
        0 for a float window): it would add ``sum_sq_excess / W^2`` to
        ``C``, so it is subtracted.
      axis_name: a mapped axis (pmap / shard_map) whose devices each closed
        a window of their own: the estimate is the mean of the devices'
        (defined) estimates, the same on every device, so the moving
        averages stay identical everywhere. None: this device's alone.

    Returns:
      The state with the averages updated (the window terms as they were:
      the engine empties a closed window's terms).
    """
    # The norm of the sum, divided after: no divided copy of the window.
    safe_weight = jnp.where(weight != 0, weight, 1.0)
    mean_sq_norm = (sq_norm(window_sum) - sum_sq_excess) / safe_weight**2
    grad_sq_norm, trace, defined = window_estimate(
        window_terms(state), weight, mean_sq_norm
    )
    if axis_name is not None:
        grad_sq_norm, trace, defined = _device_mean(
            grad_sq_norm, trace, defined, axis_name
        )

    def average(old, new):
        return jnp.where(defined, decay * old + (1 - decay) * new, old)

    return state._replace(
        grad_sq_norm=average(state.grad_sq_norm, grad_sq_norm),
        noise_trace=average(state.noise_trace, trace),
        decay_power=jnp.where(defined, decay * state.decay_power, state.decay_power),
    )


def _device_mean(
    grad_sq_norm: jax.Array, trace: jax.Array, defined: jax.Array, axis_name: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mean over ``axis_name`` of the devices' defined window estimates.

    Each device's estimate is unbiased, so is their mean; a device whose
    window gave none (fewer than two micro-batches of weight) is left out.
    One all-reduce of three scalars, once per window.
    """
    _checks.bound_axis_size(axis_name, "adaptive_every_k(axis_name=...)")
    zero = jnp.zeros([], jnp.float32)
    g2_sum, trace_sum, count = jax.lax.psum(
        (
            jnp.where(defined, grad_sq_norm, zero),
            jnp.where(defined, trace, zero),
            defined.astype(jnp.float32),
        ),
        axis_name,
    )
    safe_count = jnp.maximum(count, 1.0)
    return g2_sum / safe_count, trace_sum / safe_count, count > 0


def window_terms(state: NoiseScaleState) -> tuple:
    """The window's ``(A, k, V, n)``, the terms the engine reduces and empties."""
    return (
        state.sq_norm_sum,
        state.micro_batches,
        state.measured_weight,
        state.measured_count,
    )


def noise_scale_statistic(
    decay: float, estimator: str = "sampled", axis_name: Any = None
) -> WindowStatistic:
    """The gradient noise scale as a `WindowStatistic` of the accumulator.

    Its state is a `NoiseScaleState`: ``A``, ``k``, ``V`` and ``n`` are the
    window terms (each device adds its own micro-batch,
    `TermsLayout.micro_batch`), the bias-corrected moving averages of
    ``|G|^2`` and ``tr(S)`` the rest. ``k`` counts every micro-batch of
    nonzero weight; the measured ones are every micro-batch (``"all"``) or
    the one that fills the window's slot ``j = sampled_slot(...)``
    (``"sampled"``), its norm computed under a conditional so that the
    other micro-steps do not read the gradients for it. With ``axis_name``
    each window's estimate is averaged over that mapped axis at the close.
    """
    sampled = estimator == "sampled"

    def observe(state, grads, weight, position, layout):
        if sampled:
            drawn = sampled_slot(position.window_index, position.window_size)
            measured = jnp.logical_and(position.fills_slot, position.slot == drawn)
        else:
            measured = jnp.asarray(True)

        def micro_batch_terms(mean_grads, weight, measured):
            # A select, not a multiply: a zero weight adds nothing, not even
            # the NaN of its (skipped) gradients.
            has_weight = weight != 0

            def norm_term(grads, weight):
                return jnp.where(has_weight, weight * sq_norm(grads), 0.0)

            always = True if not sampled else measured
            term = _if_measured(always, norm_term, mean_grads, weight)
            counted = has_weight & measured
            return (
                term,
                has_weight.astype(jnp.float32),
                jnp.where(counted, weight, 0.0),
                counted.astype(jnp.float32),
            )

        terms = layout.micro_batch(micro_batch_terms)(grads, weight, measured)
        return _add_terms(state, terms)

    def close(state, window_sum, weight, position):
        return close_window(
            state, window_sum, weight, decay, position.sum_sq_excess, axis_name
        )

    return WindowStatistic(
        init=lambda params, layout: init(layout),
        observe=observe,
        window_terms=window_terms,
        with_window_terms=lambda state, terms: state._replace(
            sq_norm_sum=terms[0],
            micro_batches=terms[1],
            measured_weight=terms[2],
            measured_count=terms[3],
        ),
        close=close,
        report=lambda state: estimate(state)._asdict(),
    )


def configured(
    noise_scale_decay: Any, noise_scale_estimator: Any
) -> Callable[[Any], WindowStatistic]:
    """``noise_scale_statistic`` for an accumulator's noise-scale options,
    validated now (a ValueError naming the keyword): a function of the
    mapped axis (or None) over which the devices share one estimate."""
    decay = _checks.decay_rate("noise_scale_decay", noise_scale_decay)
    estimator = _checks.one_of(
        "noise_scale_estimator", noise_scale_estimator, ESTIMATORS
    )
    return functools.partial(noise_scale_statistic, decay, estimator)


def estimate(state: NoiseScaleState) -> NoiseScaleEstimate:
    """The bias-corrected averages and their ratio; NaN before any estimate."""
    nan = jnp.full([], jnp.nan, jnp.float32)
    correction = 1 - state.decay_power
    has_estimate = correction > 0
    safe_correction = jnp.where(has_estimate, correction, 1.0)
    grad_sq_norm = jnp.where(has_estimate, state.grad_sq_norm / safe_correction, nan)
    trace = jnp.where(has_estimate, state.noise_trace / safe_correction, nan)
    return NoiseScaleEstimate(grad_sq_norm, trace, noise_scale(grad_sq_norm, trace))


def noise_scale(grad_sq_norm: jax.Array, trace: jax.Array) -> jax.Array:
    """``tr(S) / |G|^2``; +inf where ``|G|^2 <= 0``, NaN where either is NaN."""
    positive = grad_sq_norm > 0
    ratio = trace / jnp.where(positive, grad_sq_norm, 1.0)
    ratio = jnp.where(positive, ratio, jnp.inf)
    return jnp.where(jnp.isnan(grad_sq_norm) | jnp.isnan(trace), jnp.nan, ratio)


def batch_estimate(
    sq_norm_sum: jax.Array, count: jax.Array, weight: jax.Array, mean_grads: Any
) -> NoiseScaleEstimate:
    """One step's (unsmoothed) estimate from ``A``, ``k``, ``W`` and the mean,
    every micro-batch measured (``V = W``, ``n = k``)."""
    grad_sq_norm, trace, _ = window_estimate(
        (sq_norm_sum, count, weight, count), weight, sq_norm(mean_grads)
    )
    return NoiseScaleEstimate(grad_sq_norm, trace, noise_scale(grad_sq_norm, trace))
