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

The accumulator keeps ``A`` and ``k`` (`observe`, once per micro-step)
and, at each emission (`close_window`), folds the window's estimate into
an exponential moving average of ``|G|^2`` and of ``tr(S)`` separately,
with bias correction; ``B_simple`` is the ratio of the two averages, as
the paper advises (a ratio of noisy estimates is biased, its average too).

Under data parallelism with ``unreduced_axes`` each device's gradient of a
micro-batch is a small batch of its own: every device keeps its own terms
of ``A`` and ``k`` (`add_terms`; sampled: the drawn micro-batch's terms on
every device), summed with the window at the emission.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _partials, _tree
from gradaccum_jax._control import run_if


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


def init(unreduced_axes: frozenset[str] = frozenset()) -> NoiseScaleState:
    """The state before any micro-batch: an empty window, no estimate.

    With ``unreduced_axes`` the window's ``A`` and ``k`` are kept as
    per-device terms (see `add_terms`); the averages are replicated.
    """

    # Distinct arrays, not one shared zero: a donated state must not hold
    # the same buffer twice.
    def zero():
        return jnp.zeros([], jnp.float32)

    def window_zero():
        if not unreduced_axes:
            return zero()
        return _partials.zeros(zero(), unreduced_axes)

    return NoiseScaleState(
        sq_norm_sum=window_zero(),
        micro_batches=window_zero(),
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


def observe(
    state: NoiseScaleState,
    grads: Any,
    weight: jax.Array,
    *,
    slot: jax.Array,
    fills_slot: jax.Array,
    window_size: jax.Array,
    gradient_step: jax.Array,
    axes: frozenset[str] = frozenset(),
    estimator: str = "sampled",
) -> NoiseScaleState:
    """One micro-step's part of the window's ``A`` and ``k``.

    The one call the accumulator makes per micro-step. ``k`` counts every
    micro-batch of nonzero weight. ``A``:

    * ``"all"``: adds ``w |g|^2`` of every micro-batch (`add`, `add_terms`);
    * ``"sampled"``: adds ``m w_j |g_j|^2`` for the micro-batch that fills
      the window's slot ``j`` (`sampled_slot`, uniform over the ``m``
      slots) and nothing for the others, an unbiased estimate of the sum
      (``E_j[m w_j |g_j|^2] = sum_i w_i |g_i|^2``). The norm is computed
      under a conditional: the other micro-steps do not read the gradients
      for it.

    Args:
      state: the noise scale's state.
      grads: the micro-batch's gradients (per-device terms with ``axes``).
      weight: its weight (or per-device weights, see `add_terms`).
      slot: the window's micro-batches before this one (``mini_step``).
      fills_slot: whether this micro-batch takes a slot of the window (a
        micro-batch skipped without ``count_skipped`` takes none).
      window_size: ``m``, the window's size.
      gradient_step: updates emitted before this window (the draw's index).
      axes: ``unreduced_axes``: gradients and weights are per-device terms.
      estimator: ``"sampled"`` or ``"all"``.

    Returns:
      The state with this micro-batch's terms of ``A`` and ``k`` added.
    """
    if estimator == "all":
        measured, scale = True, jnp.ones([], jnp.float32)
    else:
        drawn = sampled_slot(gradient_step, window_size)
        measured = jnp.logical_and(fills_slot, slot == drawn)
        scale = jnp.asarray(window_size, jnp.float32)
    if axes:
        return add_terms(state, grads, weight, axes, measured=measured, scale=scale)
    return add(state, grads, weight, measured=measured, scale=scale)


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


def add(
    state: NoiseScaleState,
    grads: Any,
    weight: jax.Array,
    *,
    measured: Any = True,
    scale: Any = 1.0,
) -> NoiseScaleState:
    """Adds micro-batch ``grads`` of ``weight`` to ``A`` (if ``measured``) and ``k``.

    ``A`` gains ``scale * weight * |grads|^2`` (``scale`` is ``m`` for the
    sampled micro-batch, see `observe`). Measured on every micro-step, the
    squared norm reads the gradients the window's add reads, in the same
    jitted step and with no data dependency between the two, so a compiler
    that fuses a reduction with its elementwise siblings reads them once.
    XLA:CPU does not (its multi-output fusion only merges loops of one
    output shape): there the norm is a second read of the gradients. A
    zero weight adds nothing, not even a NaN of its (skipped) gradients: a
    select, not a multiply.
    """
    has_weight = weight != 0

    def norm_term(grads, weight, scale):
        return jnp.where(weight != 0, scale * weight * sq_norm(grads), 0.0)

    term = _if_measured(measured, norm_term, grads, weight, scale)
    return state._replace(
        sq_norm_sum=state.sq_norm_sum + term,
        micro_batches=state.micro_batches + has_weight.astype(jnp.float32),
    )


def add_terms(
    state: NoiseScaleState,
    grads: Any,
    weight: jax.Array,
    axes: frozenset[str],
    *,
    measured: Any = True,
    scale: Any = 1.0,
) -> NoiseScaleState:
    """Adds each device's micro-batch to its own terms of ``A`` and ``k``.

    Under data parallelism with ``unreduced_axes`` each device's gradient is
    a small batch of its own (of the device's examples), so ``A`` sums
    ``w_d |g_d|^2`` over devices and micro-batches and ``k`` counts the
    (device, micro-batch) pairs of nonzero weight. Each device adds its own
    terms, computed from its own gradient term: nothing crosses devices
    until the window's reduction at the emission. ``grads`` are per-device
    terms (`gradaccum_jax.local_value_and_grad`); ``weight`` is either

    * per-device terms ``w_d``: the gradient terms are then ``w_d g_d``
      (``has_weight=True``), so ``w_d |g_d|^2 = |w_d g_d|^2 / w_d``;
    * one replicated ``w``, spread evenly over the ``n`` devices: the
      terms are ``g_d / n`` (the unweighted `local_value_and_grad`), so
      ``w_d = w / n`` and ``w_d |g_d|^2 = w n |g_d / n|^2``.

    A device of zero weight adds nothing (a select: its term may be NaN).
    ``measured`` and ``scale`` are as in `add`, the same on every device
    (the sampled micro-batch's terms, ``m`` times, on every device).
    """
    weighted = _partials.is_terms(weight, jnp.zeros([]), axes)
    mesh_shape = jax.sharding.get_abstract_mesh().shape
    devices = float(np.prod([mesh_shape[name] for name in axes]))
    always = measured is True

    def norm_term(grads, device_weight, scale):
        has_weight = device_weight != 0
        sq = sq_norm(grads)
        if weighted:
            term = sq / jnp.where(has_weight, device_weight, 1.0)
        else:
            term = device_weight * devices * sq
        return jnp.where(has_weight, scale * term, 0.0)

    def local(terms, replicated):
        replicated_weight, measured_here, scale = replicated
        grads, device_weight = terms if weighted else (terms, replicated_weight)
        term = _if_measured(
            True if always else measured_here, norm_term, grads, device_weight, scale
        )
        return term, (device_weight != 0).astype(jnp.float32)

    flags = (jnp.asarray(measured), jnp.asarray(scale, jnp.float32))
    terms, replicated = (
        ((grads, weight), ((), *flags)) if weighted else (grads, (weight, *flags))
    )
    sq_norm_terms, counts = _partials.map_terms(local, axes)(terms, replicated)
    return state._replace(
        sq_norm_sum=state.sq_norm_sum + sq_norm_terms,
        micro_batches=state.micro_batches + counts,
    )


def window_terms(state: NoiseScaleState | Any) -> tuple[jax.Array, ...]:
    """The window's ``(A, k)`` (to reduce with the window); ``()`` untracked."""
    if not isinstance(state, NoiseScaleState):
        return ()
    return state.sq_norm_sum, state.micro_batches


def empty_window(state: NoiseScaleState | Any) -> NoiseScaleState | Any:
    """``state`` with ``A`` and ``k`` emptied (a dropped window); ``()`` kept.

    Per-device terms stay per-device terms (zero on every device).
    """
    if not isinstance(state, NoiseScaleState):
        return state
    return state._replace(
        sq_norm_sum=_tree.zeros_like(state.sq_norm_sum),
        micro_batches=_tree.zeros_like(state.micro_batches),
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
    weight: jax.Array,
    window_sum: Any,
    decay: float,
    *,
    filled_slots: jax.Array,
    window_size: jax.Array,
    estimator: str = "sampled",
) -> tuple[NoiseScaleState, jax.Array]:
    """Folds the closing window's estimate into the averages; empties ``A``, ``k``.

    Args:
      state: the state holding the window's (reduced) ``A`` and ``k``.
      weight: the window's total weight ``W``.
      window_sum: the window's weighted gradient sum ``W G_win`` (a pytree).
      decay: the moving average's decay in [0, 1) (0: the last window only).
      filled_slots: the window's filled slots (``mini_step``) as it closes.
      window_size: ``m``, the window's size.
      estimator: ``"sampled"`` or ``"all"``. A sampled ``A`` is an unbiased
        estimate only of a window whose ``m`` slots were all filled: a
        window closed early (`flush`) or past its size gives no estimate
        (the averages are left as they are). ``"all"`` measures any window
        of two or more micro-batches of nonzero weight.

    Returns:
      The new state, and ``weight`` again, now computed from the window's
      norm: dividing the window by it orders the update after the norm's
      read of the window's buffers, so XLA overwrites them in place with
      the update. Without that data dependency the two are unordered and
      XLA copies the window (a parameter-sized temporary, measured on
      XLA:CPU; an optimization barrier does not survive its passes).
    """
    # The norm of the sum, divided after: no divided copy of the window.
    window_sq_norm = sq_norm(window_sum)
    # A sum of squares is never < 0 (NaN compares false): the factor is 1.
    ordered_weight = weight * jnp.where(window_sq_norm < 0, 0.5, 1.0)
    safe_weight = jnp.where(weight != 0, weight, 1.0)
    grad_sq_norm, trace, defined = window_estimate(
        state.sq_norm_sum, state.micro_batches, weight, window_sq_norm / safe_weight**2
    )
    if estimator != "all":
        defined = jnp.logical_and(defined, filled_slots == window_size)

    def average(old, new):
        return jnp.where(defined, decay * old + (1 - decay) * new, old)

    zero = jnp.zeros_like(state.sq_norm_sum)
    new_state = NoiseScaleState(
        sq_norm_sum=zero,
        micro_batches=jnp.zeros_like(state.micro_batches),
        grad_sq_norm=average(state.grad_sq_norm, grad_sq_norm),
        noise_trace=average(state.noise_trace, trace),
        decay_power=jnp.where(defined, decay * state.decay_power, state.decay_power),
    )
    return new_state, ordered_weight


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
