"""Error feedback (Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019) keeps the compressor's error in the
state and adds it to the next input, so whatever one step loses is sent by a
later one. It feeds back the *bias* of the compressor, ``x - E[C(x)]``:

- for TWN, which is deterministic, that is the whole error ``x - C(x)``;
- for TernGrad it is the clipping error ``x - clip(x)``: the stochastic
  rounding is unbiased, so its error is zero-mean noise, independent across
  steps, that averages out without help. Feeding the rounding noise back
  as well (the full ``x - C(x)``) re-injects it, and because the residual
  enters the next step's scale, a larger residual makes a larger scale and
  more noise (in an early experiment on load_digits, data-parallel on 8
  devices, it cost test accuracy against the clipping-error residual).
  TernGrad's rounding error is not contractive (E||C(x) - x||^2 is about
  ||x||^2 or more), which the convergence theory of error feedback
  requires.

Either way, ``E[sum of sent] + residual = sum of inputs``; for TWN the
identity holds without the expectation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import _tree
from gradaccum_jax._ternary import _blocks, _random
from gradaccum_jax._ternary._leaves import NoResidual, is_compressed


class TernaryState(NamedTuple):
    """State of `ternarize` and `ternary_average_across_devices`.

    Attributes:
      key: ``uint32[2] = (seed, step)``, the counter of the random bits (see
        ``_ternary._random``; checkpointable), advanced on every update.
      residual: float32 compression bias per compressed leaf (the whole error
        for TWN, the clipping error for TernGrad), added to the next step's
        input (error feedback); a `NoResidual` (the leaf's shape, no array)
        for leaves that keep no residual (uncompressed leaves,
        ``error_feedback=False``, or TernGrad without clipping, which is
        unbiased).
      auto_splits: for `ternary_average_across_devices`, how ``init`` saw
        the params split over Auto mesh axes, per leaf (a static node of
        the tree, no array; see `gradaccum_jax.extend.CodecState`).
    """

    key: jax.Array
    residual: optax.Updates
    auto_splits: _blocks.AutoSplits = _blocks.AutoSplits()

    def with_own_stream(self, index: int) -> TernaryState:
        """This state drawing from a random stream of its own for ``index``
        (its seed word hashed with it; its step word kept)."""
        return self._replace(key=_random.derive(self.key, index))


def keeps_residual(
    error_feedback: bool, stochastic: bool, clip_sigma: float | None
) -> bool:
    """Whether the compressor has a bias to feed back (see the module doc)."""
    return error_feedback and (not stochastic or clip_sigma is not None)


def residual_init(params: Any, min_size: int, keep_residual: bool) -> Any:
    """Float32 zeros for leaves that keep a residual, `NoResidual` elsewhere."""

    def leaf_init(param):
        if keep_residual and is_compressed(param, min_size):
            return _tree.zeros_like(param, jnp.float32)
        return NoResidual(tuple(np.shape(param)))

    return jax.tree.map(leaf_init, params)
