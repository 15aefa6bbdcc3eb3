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
of nonzero weight, ``G_win = sum w_i g_i / W``)::

    E[A] = W |G|^2 + k tr(S),     A = sum_i w_i |g_i|^2
    E[C] = |G|^2 + tr(S) / W,     C = |G_win|^2

    tr(S) = (A - W C) / (k - 1),  |G|^2 = C - tr(S) / W

With equal weights b these are the paper's formulas with
``B_small = b``, ``B_big = k b``. Without weights (every ``w_i = 1``) the
unit of ``B_simple`` is micro-batches, not examples. A window of one
micro-batch measures one batch size only: it gives no estimate.

Two estimators of ``A`` (``noise_scale_estimator``), for a window of ``m``
slots (micro-batches; a zero-weight one in a slot contributes 0)::

    "all":      A = sum_i w_i |g_i|^2              (every micro-batch's norm)
    "sampled":  A = m w_j |g_j|^2, j ~ U{0..m-1}    (one micro-batch's norm)

    E_j[m w_j |g_j|^2] = sum_i w_i |g_i|^2

so the sampled ``A`` is unbiased for ``A`` given the gradients, and the
estimates of ``tr(S)`` and ``|G|^2``, linear in ``A``, stay unbiased. It
reads the gradients for a norm on one micro-step per window instead of
every one (XLA:CPU does not fuse the norm into the accumulation pass: a
second read of the gradients each time), and pays in variance: one
micro-batch stands for m. The slot is a fixed hash of the window's index
(`sampled_slot`): no PRNG state, the same draw on every device and after a
checkpoint. A sampled window that closes with fewer than ``m`` filled
slots (`flush`) gives no estimate: its ``A`` is not an m-slot sample.

The accumulator keeps ``A`` and ``k`` (the statistic's ``observe``, once
per micro-step; `noise_scale_statistic` is a `WindowStatistic` of the
engine) and, at each emission (`close_window`), folds the window's estimate into
an exponential moving average of ``|G|^2`` and of ``tr(S)`` separately,
with bias correction; ``B_simple`` is the ratio of the two averages, as
the paper advises (a ratio of noisy estimates is biased, its average too).

Under data parallelism with ``unreduced_axes`` each device's gradient of a
micro-batch is a small batch of its own: every device keeps its own terms
of ``A`` and ``k`` (sampled: the drawn micro-batch's terms on every
device), summed with the window at the emission.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax import _partials, _tree
from gradaccum_jax._control import run_if
from gradaccum_jax._statistic import WindowStatistic


class NoiseScaleState(NamedTuple):
    """What the accumulator keeps for the noise scale (`MultiStepsState.noise`).

    Attributes:
      sq_norm_sum: ``A = sum_i w_i |g_i|^2`` over the current window
        (``"sampled"``: ``m w_j |g_j|^2`` once slot j is filled, 0 before),
        float32 (per-device terms with ``unreduced_axes``, like the window).
      micro_batches: ``k``, micro-batches of nonzero weight in the current window,
        float32 (a count summed over devices like ``A``).
      grad_sq_norm: moving average of the windows' ``|G|^2`` estimates
        (not yet bias-corrected).
      noise_trace: moving average of the windows' ``tr(S)`` estimates (not
        yet bias-corrected).
      decay_power: ``decay ** n`` after n estimates; the bias correction
        divides the averages by ``1 - decay_power``.
    """

    sq_norm_sum: jax.Array
    micro_batches: jax.Array
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
    ``A`` and ``k`` are kept as terms; the averages are replicated.
    """
    window_zero = _partials.NoTerms().zeros if layout is None else layout.zeros

    # Distinct arrays, not one shared zero: a donated state must not hold
    # the same buffer twice.
    def zero():
        return jnp.zeros([], jnp.float32)

    return NoiseScaleState(
        sq_norm_sum=window_zero(zero()),
        micro_batches=window_zero(zero()),
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
    """Adds micro-batch ``grads`` of ``weight`` to ``A`` and ``k``.

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
    return state._replace(
        sq_norm_sum=state.sq_norm_sum + term,
        micro_batches=state.micro_batches + has_weight.astype(jnp.float32),
    )


def window_estimate(
    sq_norm_sum: jax.Array, count: jax.Array, weight: jax.Array, mean_sq_norm: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(|G|^2, tr(S), defined)`` from one window's ``A``, ``k``, ``W``, ``C``.

    ``defined`` is False for a window of fewer than two micro-batches of
    nonzero weight (one batch size measured: ``k - 1 = 0``); the estimates
    are then NaN, never a division by zero.
    """
    defined = count >= 2
    safe_count = jnp.where(defined, count, 2.0)
    safe_weight = jnp.where(defined, weight, 1.0)
    trace = (sq_norm_sum - safe_weight * mean_sq_norm) / (safe_count - 1)
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
    complete: Any = True,
) -> NoiseScaleState:
    """Folds the closing window's estimate into the moving averages.

    Args:
      state: the state holding the window's (reduced) ``A`` and ``k``.
      window_sum: the window's weighted gradient sum ``W G_win`` (a pytree).
      weight: the window's total weight ``W``.
      decay: the moving average's decay in [0, 1) (0: the last window only).
      complete: whether ``A`` stands for the window: a sampled ``A`` is an
        unbiased estimate only of a window whose ``m`` slots were all filled,
        so a window closed early (`flush`) or past its size gives no
        estimate (the averages stay as they are).

    Returns:
      The state with the averages updated (``A`` and ``k`` as they were:
      the engine empties a closed window's terms).
    """
    # The norm of the sum, divided after: no divided copy of the window.
    safe_weight = jnp.where(weight != 0, weight, 1.0)
    grad_sq_norm, trace, defined = window_estimate(
        state.sq_norm_sum,
        state.micro_batches,
        weight,
        sq_norm(window_sum) / safe_weight**2,
    )
    defined = jnp.logical_and(defined, complete)

    def average(old, new):
        return jnp.where(defined, decay * old + (1 - decay) * new, old)

    return state._replace(
        grad_sq_norm=average(state.grad_sq_norm, grad_sq_norm),
        noise_trace=average(state.noise_trace, trace),
        decay_power=jnp.where(defined, decay * state.decay_power, state.decay_power),
    )


def noise_scale_statistic(decay: float, estimator: str = "sampled") -> WindowStatistic:
    """The gradient noise scale as a `WindowStatistic` of the accumulator.

    Its state is a `NoiseScaleState`: ``A`` and ``k`` are the window terms
    (each device adds its own micro-batch, `TermsLayout.micro_batch`), the
    bias-corrected moving averages of ``|G|^2`` and ``tr(S)`` the rest.
    ``k`` counts every micro-batch of nonzero weight; ``A`` adds ``w |g|^2``
    of every micro-batch (``"all"``), or ``m w_j |g_j|^2`` of the one that
    fills the window's slot ``j = sampled_slot(...)`` (``"sampled"``), the
    norm computed under a conditional so that the other micro-steps do not
    read the gradients for it.
    """
    sampled = estimator == "sampled"

    def observe(state, grads, weight, position, layout):
        if sampled:
            drawn = sampled_slot(position.window_index, position.window_size)
            measured = jnp.logical_and(position.fills_slot, position.slot == drawn)
            scale = jnp.asarray(position.window_size, jnp.float32)
        else:
            measured, scale = jnp.asarray(True), jnp.ones([], jnp.float32)

        def micro_batch_terms(mean_grads, weight, measured, scale):
            # A select, not a multiply: a zero weight adds nothing, not even
            # the NaN of its (skipped) gradients.
            has_weight = weight != 0

            def norm_term(grads, weight, scale):
                return jnp.where(has_weight, scale * weight * sq_norm(grads), 0.0)

            always = True if not sampled else measured
            term = _if_measured(always, norm_term, mean_grads, weight, scale)
            return term, has_weight.astype(jnp.float32)

        sq_norm_term, count = layout.micro_batch(micro_batch_terms)(
            grads, weight, measured, scale
        )
        return state._replace(
            sq_norm_sum=state.sq_norm_sum + sq_norm_term,
            micro_batches=state.micro_batches + count,
        )

    def close(state, window_sum, weight, position):
        complete = position.slot == position.window_size if sampled else True
        return close_window(state, window_sum, weight, decay, complete)

    return WindowStatistic(
        init=lambda params, layout: init(layout),
        observe=observe,
        window_terms=lambda state: (state.sq_norm_sum, state.micro_batches),
        with_window_terms=lambda state, terms: state._replace(
            sq_norm_sum=terms[0], micro_batches=terms[1]
        ),
        close=close,
    )


def estimate(state: NoiseScaleState | Any) -> NoiseScaleEstimate:
    """The bias-corrected averages and their ratio; NaN before any estimate.

    ``state`` may be ``()`` (noise scale not tracked): all NaN.
    """
    nan = jnp.full([], jnp.nan, jnp.float32)
    if not isinstance(state, NoiseScaleState):
        return NoiseScaleEstimate(nan, nan, nan)
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
    """One step's (unsmoothed) estimate from ``A``, ``k``, ``W`` and the mean."""
    grad_sq_norm, trace, _ = window_estimate(
        sq_norm_sum, count, weight, sq_norm(mean_grads)
    )
    return NoiseScaleEstimate(grad_sq_norm, trace, noise_scale(grad_sq_norm, trace))
