"""Gradient clipping: by global norm (with a loggable state) and element-wise.

Numerically these are optax's ``clip_by_global_norm`` and ``clip``; optax's
own tests run against them. Two differences:

- ``clip_by_global_norm`` keeps the pre-clip global norm and whether it
  clipped in its state, so a train step can log them without computing the
  norm a second time.
- The global norm is accumulated in (at least) float32. In bfloat16 every
  leaf's sum of squares and the running total over leaves are rounded to 8
  mantissa bits (300 leaves of 100 ones give a norm of 181 instead of
  173.2, so the clip factor is off by 4.5%); in float16 the squares
  overflow to inf as soon as an element exceeds 256.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks


def _at_least_float32(leaf: jax.Array) -> jax.Array:
    # promote_types keeps float64 and complex dtypes as they are and lifts
    # bfloat16/float16 (and integers) to float32.
    return leaf.astype(jnp.promote_types(jnp.result_type(leaf), jnp.float32))


def global_norm(tree: Any) -> jax.Array:
    """Returns the L2 norm over all leaves of ``tree``, accumulated in float32.

    Leaves in bfloat16 or float16 are squared and summed in float32 (under
    ``jax.jit`` the cast fuses into the reduction, so no float32 copy of the
    tree is materialised). float64 and complex leaves keep their precision.

    Example:

    >>> import jax.numpy as jnp
    >>> from gradaccum_jax import global_norm
    >>> global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0], jnp.bfloat16)})
    Array(5., dtype=float32)

    Args:
      tree: A pytree of arrays, e.g. gradients or updates.

    Returns:
      A scalar: float32 for float32, bfloat16 and float16 trees; float64 if a
      leaf is float64. An empty tree has norm 0.
    """
    return optax.tree.norm(jax.tree.map(_at_least_float32, tree))


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`, written by every update.

    Attributes:
      global_norm: float32 scalar, the global norm of the updates of the last
        step before clipping (0 before the first update).
      clipped: bool scalar, whether the last step scaled the updates down,
        i.e. ``not global_norm < max_norm`` (also True for a NaN norm).
    """

    global_norm: jax.Array
    clipped: jax.Array


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Clips updates so that their global L2 norm is at most ``max_norm``.

    If the global norm ``n`` of the updates is ``>= max_norm``, every leaf is
    scaled by ``max_norm / n``; otherwise the updates pass unchanged. Results
    equal ``optax.clip_by_global_norm`` for float32 updates. The norm is
    computed in float32 also for bfloat16/float16 updates (see
    :func:`global_norm`), and updates are returned in their own dtype.

    The state records the pre-clip norm and whether the step clipped, so a
    train step can log them:

      >>> import jax.numpy as jnp
      >>> import optax
      >>> from gradaccum_jax import clip_by_global_norm
      >>> opt = optax.chain(clip_by_global_norm(1.0), optax.sgd(1.0))
      >>> opt_state = opt.init({"w": jnp.zeros(2)})
      >>> updates, opt_state = opt.update({"w": jnp.array([3.0, 4.0])}, opt_state)
      >>> opt_state[0].global_norm, opt_state[0].clipped  # pre-clip norm
      (Array(5., dtype=float32), Array(True, dtype=bool))
      >>> updates["w"]
      Array([-0.6..., -0.8...], dtype=float32)

    Args:
      max_norm: The largest global norm an update may have; a positive finite
        number.

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`ClipByGlobalNormState`.

    Raises:
      ValueError: At construction, if ``max_norm`` is not a positive finite
        number.

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2013.
    """
    max_norm = _checks.positive_finite("max_norm", max_norm)

    def init_fn(params: Any) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState(
            global_norm=jnp.zeros([], jnp.float32), clipped=jnp.zeros([], bool)
        )

    def update_fn(
        updates: Any, state: ClipByGlobalNormState, params: Any = None
    ) -> tuple[Any, ClipByGlobalNormState]:
        # The new state depends only on the updates, so `state` is not read:
        # optax's tests (and optax users) pass `None` as the state.
        del state, params
        norm = global_norm(updates)
        # Same predicate and formula as optax (a select, not a multiply by
        # min(1, max_norm / norm)), so the results are bit-identical for
        # float32 and meta-gradients through the update behave the same.
        keep = norm < max_norm

        def clip_leaf(leaf: jax.Array) -> jax.Array:
            wide = _at_least_float32(leaf)
            scaled = (wide / norm.astype(wide.dtype)) * max_norm
            return jax.lax.select(keep, leaf, scaled.astype(leaf.dtype))

        new_state = ClipByGlobalNormState(
            global_norm=norm.astype(jnp.float32), clipped=jnp.logical_not(keep)
        )
        return jax.tree.map(clip_leaf, updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def clip(max_delta: float) -> optax.GradientTransformation:
    """Clips every element of the updates to ``[-max_delta, max_delta]``.

    The same as ``optax.clip``, with the argument checked at construction.

    Example:

    >>> import jax.numpy as jnp
    >>> from gradaccum_jax import clip
    >>> tx = clip(1.0)
    >>> updates, _ = tx.update(jnp.array([-3.0, 0.5, 2.0]), tx.init(None))
    >>> updates
    Array([-1. ,  0.5,  1. ], dtype=float32)

    Args:
      max_delta: The largest absolute value an element may have; a positive
        finite number.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: At construction, if ``max_delta`` is not a positive finite
        number.
    """
    max_delta = _checks.positive_finite("max_delta", max_delta)

    def update_fn(
        updates: Any, state: optax.EmptyState, params: Any = None
    ) -> tuple[Any, optax.EmptyState]:
        del params
        return optax.tree.clip(updates, -max_delta, max_delta), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
