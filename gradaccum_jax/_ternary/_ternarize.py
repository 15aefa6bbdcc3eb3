"""`ternarize`: each update leaf replaced by its ternary reconstruction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks
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
    unzip,
)
from gradaccum_jax._ternary._quantize import (
    clip_to_sigma,
    ternary_dequantize,
    ternary_quantize,
)
from gradaccum_jax._ternary._random import seed_key, split_per_leaf


def ternarize(
    seed: int,
    *,
    stochastic: bool = True,
    clip_sigma: float | None = 2.5,
    error_feedback: bool = True,
    min_size: int = DEFAULT_MIN_SIZE,
) -> optax.GradientTransformation:
    """Replaces each update leaf by its ternary reconstruction.

    Each leaf with at least ``min_size`` elements becomes
    ``ternary_dequantize(*ternary_quantize(x, key, clip_sigma=clip_sigma))``
    (TernGrad's stochastic rounding, Wen et al., NeurIPS 2017, or TWN's
    threshold with ``stochastic=False``), in the update's dtype; smaller
    leaves pass through unchanged.

    With ``error_feedback`` (Karimireddy et al., ICML 2019), ``x`` is the
    update plus the previous residual, and the new residual, kept in
    float32 in the state, is the compressor's bias ``x - E[C(x)]``: the
    whole error ``x - C(x)`` for TWN, the clipping error ``x - clip(x)`` for
    TernGrad, whose rounding noise is unbiased and is not fed back (feeding
    it back costs accuracy, see the module docstring). After T steps
    ``sum(E[sent]) + residual = sum(updates)`` (exactly, without the
    expectation, for TWN): nothing is lost, only delayed. A step with a
    non-finite update sends NaN (see `ternary_quantize`) and leaves the
    residual unchanged, so one bad step does not poison the following ones.

    The PRNG key lives in the state and is split on every update: the
    transformation is pure, and a run is reproducible from ``seed``.

    Args:
      seed: an integer in [0, 2**32 - 1] seeding the stochastic rounding.
      stochastic: TernGrad's unbiased stochastic rounding if True, TWN's
        deterministic threshold if False.
      clip_sigma: TernGrad's clipping, in standard deviations (stochastic
        only); None disables it. Must be > 0.
      error_feedback: keep the compressor's bias and add it to the next
        update (costs one float32 buffer per compressed leaf; none for
        TernGrad with ``clip_sigma=None``, which is unbiased).
      min_size: leaves with fewer elements pass through uncompressed; 0
        compresses everything. Default 256: see ``DEFAULT_MIN_SIZE``.

    Returns:
      An ``optax.GradientTransformation`` with a `TernaryState`.
    """
    seed, clip_sigma, min_size = common_config(seed, clip_sigma, min_size)
    stochastic = _checks.boolean("stochastic", stochastic)
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    keep_residual = keeps_residual(error_feedback, stochastic, clip_sigma)

    def init_fn(params):
        return TernaryState(
            seed_key(seed), residual_init(params, min_size, keep_residual)
        )

    def update_fn(updates, state, params=None):
        del params
        check_updates(updates, state.residual, "ternarize")
        key, leaf_keys = split_per_leaf(state.key, updates)

        def compress(update, residual, leaf_key):
            if not is_compressed(update, min_size):
                return update, residual
            x = update.astype(jnp.float32)
            if keep_residual:
                x = x + residual
            if stochastic:
                expected = clip_to_sigma(x, clip_sigma)  # = E[sent]
                codes, scale = ternary_quantize(expected, leaf_key, clip_sigma=None)
                sent = ternary_dequantize(codes, scale)
            else:
                codes, scale = ternary_quantize(x)
                sent = expected = ternary_dequantize(codes, scale)
            if keep_residual:
                residual = jnp.where(jnp.isfinite(scale), x - expected, residual)
            return sent.astype(update.dtype), residual

        pairs = jax.tree.map(compress, updates, state.residual, leaf_keys)
        sent, residual = unzip(updates, pairs)
        return sent, TernaryState(key, residual)

    return optax.GradientTransformation(init_fn, update_fn)
