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

The accumulator keeps ``A`` and ``k`` (added in the micro-step's pass over
the gradients; the statistic is a `WindowStatistic` of the engine) and, at
each emission, folds the window's estimate into an exponential moving
average of ``|G|^2`` and of ``tr(S)`` separately, with bias correction;
``B_simple`` is the ratio of the two averages, as the paper advises (a
ratio of noisy estimates is biased, its average too).

Under data parallelism with ``unreduced_axes`` each device's gradient of a
micro-batch is a small batch of its own: every device keeps its own terms
of ``A`` and ``k``, summed with the window at the emission.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks, _partials, _tree
from gradaccum_jax._statistic import WindowStatistic


class NoiseScaleState(NamedTuple):
    """What the accumulator keeps for the noise scale (`MultiStepsState.noise`).

    Attributes:
      sq_norm_sum: ``A = sum_i w_i |g_i|^2`` over the current window, float32
        (per-device terms with ``unreduced_axes``, like the window).
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
    state: NoiseScaleState, window_sum: Any, weight: jax.Array, decay: float
) -> NoiseScaleState:
    """Folds the closing window's estimate into the moving averages.

    Args:
      state: the state holding the window's (reduced) ``A`` and ``k``.
      window_sum: the window's weighted gradient sum ``W G_win`` (a pytree).
      weight: the window's total weight ``W``.
      decay: the moving average's decay in [0, 1) (0: the last window only).

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

    def average(old, new):
        return jnp.where(defined, decay * old + (1 - decay) * new, old)

    return state._replace(
        grad_sq_norm=average(state.grad_sq_norm, grad_sq_norm),
        noise_trace=average(state.noise_trace, trace),
        decay_power=jnp.where(defined, decay * state.decay_power, state.decay_power),
    )


def noise_scale_statistic(decay: float) -> WindowStatistic:
    """The gradient noise scale as a `WindowStatistic` of the accumulator.

    Its state is a `NoiseScaleState`: ``A`` and ``k`` are the window terms
    (each device adds its own micro-batch, `TermsLayout.micro_batch`), the
    bias-corrected moving averages of ``|G|^2`` and ``tr(S)`` the rest.
    """

    def observe(state, grads, weight, position, layout):
        del position  # every micro-batch is measured

        def micro_batch_terms(mean_grads, weight):
            # A select, not a multiply: a zero weight adds nothing, not even
            # the NaN of its (skipped) gradients.
            has_weight = weight != 0
            term = jnp.where(has_weight, weight * sq_norm(mean_grads), 0.0)
            return term, has_weight.astype(jnp.float32)

        sq_norm_term, count = layout.micro_batch(micro_batch_terms)(grads, weight)
        return state._replace(
            sq_norm_sum=state.sq_norm_sum + sq_norm_term,
            micro_batches=state.micro_batches + count,
        )

    def close(state, window_sum, weight, position):
        del position
        return close_window(state, window_sum, weight, decay)

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


class AdaptiveWindow:
    """A window size chosen from the estimated critical batch size.

    Built by `adaptive_every_k`; pass it as ``every_k_schedule`` (or
    ``every_k``). The engine keeps the current window size in its state and,
    at each emission, asks `next_size` for the next one, so the size changes
    only at window boundaries, is a pure function of the state (a restored
    checkpoint goes on identically) and costs a few scalar operations.
    """

    def __init__(self, micro_batch_size: float, k_min: int, k_max: int):
        if isinstance(micro_batch_size, bool) or not isinstance(
            micro_batch_size, numbers.Real
        ):
            raise ValueError(
                "`micro_batch_size` must be a positive finite number (the "
                f"weight of one micro-batch), got {micro_batch_size!r}."
            )
        self.micro_batch_size: float = _checks.positive_finite(
            "micro_batch_size", micro_batch_size
        )
        self.k_min: int = _checks.window_size("k_min", k_min)
        self.k_max: int = _checks.window_size("k_max", k_max)
        if self.k_max < self.k_min:
            raise ValueError(
                f"`k_max` must be an integer >= k_min ({self.k_min}), got {k_max}."
            )

    def initial_size(self) -> jax.Array:
        """The first window's size: ``k_min`` (no estimate yet)."""
        return jnp.asarray(self.k_min, jnp.int32)

    def next_size(self, size: jax.Array, noise: NoiseScaleEstimate) -> jax.Array:
        """``round(B_simple / micro_batch_size)`` in [k_min, k_max]; ``size`` if NaN."""
        wanted = noise.noise_scale / self.micro_batch_size
        bounded = jnp.clip(jnp.round(wanted), self.k_min, self.k_max)
        return jnp.where(jnp.isnan(wanted), size, bounded.astype(jnp.int32))

    def __repr__(self) -> str:
        return (
            f"adaptive_every_k(micro_batch_size={self.micro_batch_size}, "
            f"k_min={self.k_min}, k_max={self.k_max})"
        )


def adaptive_every_k(micro_batch_size: float, k_min: int, k_max: int) -> AdaptiveWindow:
    """A window size that follows the critical batch size (McCandlish et al. 2018).

    At each emission the next window holds
    ``clip(round(B_simple / micro_batch_size), k_min, k_max)`` micro-batches,
    ``B_simple`` being the accumulator's smoothed noise scale (so the
    window's batch is about the critical batch size). Until the first
    estimate (and while it is undefined) the window keeps its size, starting
    at ``k_min``; ``k_min >= 2`` is needed for any estimate at all (a window
    of one micro-batch measures nothing). Pass it as ``every_k_schedule``
    to `MultiSteps` (``every_k`` to `accumulate`, `ternary_accumulate`):
    it turns ``track_noise_scale`` on.

    Units: ``B_simple`` is in units of the micro-batch weights. With
    ``update(..., weight=n_examples)``, ``micro_batch_size`` is the
    (typical) number of examples in a micro-batch; without weights
    ``B_simple`` counts micro-batches, and ``micro_batch_size`` must be 1.

    Under data parallelism ``micro_batch_size`` is global: the weight of one
    ``update`` call summed over all devices (8 devices of 32 examples each:
    256), since the window's batch is that of all devices together.
    Without weights, where each call weighs 1 whatever the number of
    devices, it is 1 again.

    Args:
      micro_batch_size: the weight of one micro-batch, a positive number.
      k_min: the smallest (and first) window, an integer >= 1.
      k_max: the largest window, an integer >= ``k_min``.

    Returns:
      An `AdaptiveWindow`.
    """
    return AdaptiveWindow(micro_batch_size, k_min, k_max)


def batch_estimate(
    sq_norm_sum: jax.Array, count: jax.Array, weight: jax.Array, mean_grads: Any
) -> NoiseScaleEstimate:
    """One step's (unsmoothed) estimate from ``A``, ``k``, ``W`` and the mean."""
    grad_sq_norm, trace, _ = window_estimate(
        sq_norm_sum, count, weight, sq_norm(mean_grads)
    )
    return NoiseScaleEstimate(grad_sq_norm, trace, noise_scale(grad_sq_norm, trace))
