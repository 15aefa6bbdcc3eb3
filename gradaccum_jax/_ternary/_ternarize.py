"""`ternarize`: each update leaf replaced by its ternary reconstruction."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks
from gradaccum_jax._codecs._ternary_kernels import (
    biased,
    checked_arguments,
    clip,
    poison_if_nonfinite,
    scale_and_bound,
    stochastic_codes,
    ternary_dequantize,
    ternary_quantize,
)
from gradaccum_jax._compression import _error_feedback, _random
from gradaccum_jax._compression._leaves import (
    DEFAULT_MIN_SIZE,
    check_updates,
    is_compressed,
    real_leaves,
    slots,
    with_slots,
)

_CODER = "ternary compression"


class TernaryState(NamedTuple):
    """The state of `ternarize`.

    Attributes:
      key: ``uint32[2] = (seed, step)``, the counter of the random bits,
        advanced on every update (checkpointable).
      residual: float32 compression bias per compressed leaf (the whole error
        for TWN, the clipping error for TernGrad), added to the next step's
        input (error feedback); a ``NoResidual`` (the leaf's shape, no array)
        for leaves that keep no residual (uncompressed leaves,
        ``error_feedback=False``, or TernGrad without clipping, which is
        unbiased).
    """

    key: jax.Array
    residual: optax.Updates

    def with_own_stream(self, index: int) -> TernaryState:
        """This state drawing from a random stream of its own for ``index``
        (its seed word hashed with it; its step word kept)."""
        return self._replace(key=_random.derive(self.key, index))


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
    leaves pass through unchanged. Each leaf has one scale, a scanned stack
    of layers (rank 3 or more) too, as `ternary_quantize` gives it; the
    ternary codec of the device mean (`ternary_average_across_devices`)
    gives each layer of such a leaf a scale of its own, since its devices
    share one. Leaves must be real floating point:
    complex ones, of any size, are rejected (a ternary code has no
    imaginary part); sharded leaves give their unsharded result, sharded
    alike.

    With ``error_feedback`` (Karimireddy et al., ICML 2019), ``x`` is the
    update plus the previous residual, and the new residual, kept in
    float32 in the state, is the compressor's bias ``x - E[C(x)]``: the
    whole error ``x - C(x)`` for TWN, the clipping error ``x - clip(x)`` for
    TernGrad, whose rounding noise is unbiased and is not fed back (fed
    back, it enlarges the next step's scale and so its noise). After T steps
    ``sum(E[sent]) + residual = sum(updates)`` (exactly, without the
    expectation, for TWN): nothing is lost, only delayed. A step with a
    non-finite update sends NaN (see `ternary_quantize`) and leaves the
    residual unchanged, so one bad step does not poison the following ones.

    The random bits are a hash of (seed, step, leaf, element) (see
    ``_compression._random``); the state keeps the seed and a step counter, so
    the transformation is pure and a run is reproducible from ``seed``.

    Example:

    >>> import jax.numpy as jnp
    >>> from gradaccum_jax import ternarize
    >>> tx = ternarize(seed=0, stochastic=False, min_size=1)
    >>> update = {"w": jnp.array([1.0, -0.25, -1.0, 0.0])}
    >>> state = tx.init(update)
    >>> sent, state = tx.update(update, state)
    >>> sent["w"]
    Array([ 1.,  0., -1.,  0.], dtype=float32)
    >>> state.residual["w"]  # fed into the next step: nothing is lost
    Array([ 0.  , -0.25,  0.  ,  0.  ], dtype=float32)

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
    seed, clip_sigma, min_size = checked_arguments(seed, clip_sigma, min_size)
    stochastic = _checks.boolean("stochastic", stochastic)
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    keep_residual = _error_feedback.keeps_residual(
        error_feedback, biased(stochastic, clip_sigma)
    )
    config = _TernarizeConfig(stochastic, clip_sigma, min_size, keep_residual)

    def coded(leaf):
        return is_compressed(leaf, min_size)

    def init_fn(params):
        real_leaves(params, "ternarize: params", _CODER)
        residual = _error_feedback.residual_init(params, coded, keep_residual)
        return TernaryState(_random.seed_state(seed), residual)

    def update_fn(updates, state, params=None):
        del params
        check_updates(updates, state.residual, "ternarize", _CODER)
        if keep_residual:
            coder = f"{_CODER} (min_size={min_size})"
            _error_feedback.check_grown(
                updates, state.residual, coded, "ternarize", coder
            )
        return _ternarized(config, updates, state)

    return optax.GradientTransformation(init_fn, update_fn)


class _TernarizeConfig(NamedTuple):
    """The checked arguments of one `ternarize`."""

    stochastic: bool
    clip_sigma: float | None
    min_size: int
    keep_residual: bool


def _ternarized(
    config: _TernarizeConfig, updates: Any, state: TernaryState
) -> tuple[Any, TernaryState]:
    """One step: every leaf's ternary reconstruction, and the new state."""
    leaves, treedef = jax.tree.flatten(updates)
    residuals = slots(state.residual)
    pairs = [
        _compressed_leaf(config, state.key, i, leaf, residual)
        for i, (leaf, residual) in enumerate(zip(leaves, residuals, strict=True))
    ]
    sent = jax.tree.unflatten(treedef, [pair[0] for pair in pairs])
    residual = with_slots(state.residual, [pair[1] for pair in pairs])
    return sent, TernaryState(_random.advance(state.key), residual)


def _compressed_leaf(
    config: _TernarizeConfig,
    key: jax.Array,
    index: int,
    update: jax.Array,
    residual: Any,
) -> tuple[jax.Array, Any]:
    """``(sent, new residual)`` for leaf ``index``: its reconstruction in its
    dtype (the leaf itself below ``min_size``) and the compressor's bias."""
    if not is_compressed(update, config.min_size):
        return update, residual
    x = update.astype(jnp.float32)
    if config.keep_residual:
        x = x + residual
    if config.stochastic:
        scale, bound, finite = scale_and_bound(x, config.clip_sigma, tight=True)
        codes = stochastic_codes(x, scale, bound, _random.stream(key, index))
        expected = clip(x, bound)  # = E[sent]
        scale = poison_if_nonfinite(finite, scale)
        sent = ternary_dequantize(codes, scale)
    else:
        codes, scale = ternary_quantize(x)
        sent = expected = ternary_dequantize(codes, scale)
    if config.keep_residual:
        residual = _error_feedback.fed_back(x, expected, jnp.isfinite(scale), residual)
    return sent.astype(update.dtype), residual
