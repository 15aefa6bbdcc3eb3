"""A window of per-device terms summed with ternary codes on the wire."""

from __future__ import annotations

import jax

from gradaccum_jax import _reduction
from gradaccum_jax._codecs import _auto_blocks, _mean
from gradaccum_jax._codecs._protocol import CodecState
from gradaccum_jax._codecs._ternary import ternary_codec
from gradaccum_jax._codecs._window import reduce_terms
from gradaccum_jax._ternary import _random
from gradaccum_jax._ternary._leaves import (
    DEFAULT_MIN_SIZE,
    common_config,
    real_leaves,
)


def ternary_window_reduction(
    seed: int,
    *,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
) -> _reduction.WindowReduction:
    """Sums a window's per-device terms over devices as ternary codes.

    For `MultiSteps` with ``unreduced_axes`` (``window_reduction=``): at the
    emitting call each device holds its term ``S_d`` of the window's sum
    (``sum of w * g`` over its micro-batches). Instead of a float32
    all-reduce of the ``S_d``, each device ternarizes its share ``S_d / n``
    with TernGrad's unbiased stochastic rounding (Wen et al., NeurIPS 2017)
    against one scale per leaf shared by a pmax, the codes are summed by one
    packed integer all-reduce, and the result times ``n`` is the window's
    sum, bitwise identical on every device: `ternary_average_across_devices`
    run in a ``jax.shard_map`` over ``unreduced_axes`` on the per-device
    terms, with its wire format (1/7 of the float32 bytes with 8 devices):
    `gradaccum_jax.compressed_window_reduction` with TernGrad's rounding
    and no error feedback, its state a `gradaccum_jax.extend.CodecState`
    holding the random counter alone (no residual).

    A term split over another mesh axis (a tensor-parallel param's) is
    coded where it lies, each device its own block: on Explicit axes as its
    type says; on an Auto mesh as ``init`` saw the params split, when
    ``MultiSteps.init`` is given placed arrays (not under ``jax.jit``,
    whose types do not say it on Auto axes), else whole.

    With ``clip_sigma=None`` the emitted sum is an unbiased estimate of the
    exact window sum; TernGrad's clipping trades a small bias for less
    rounding noise, and no error-feedback residual is kept, so the clipping
    error is lost. The ternary guide, section "Ternary window reduction", has
    why, and how the random bits make a restored run emit the same updates.

    It also says by how much the codes change the squared norm of the sum
    (the ``sq_excess`` of `gradaccum_jax.extend.WindowReduction.reduce`: their
    rounding variance, less what clipping removed, one more scalar psum per
    window), so that the gradient noise scale tracked on the window stays
    unbiased.

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
    seed, clip_sigma, min_size = common_config(seed, clip_sigma, min_size)
    # The window weight (one element) must stay exact: it decides whether
    # the window steps and divides the sum.
    codec = ternary_codec(clip_sigma, "stochastic", max(min_size, 2), "ternary codes")

    def init_fn(params, layout):
        del layout  # the same state on every device
        real_leaves(params, "ternary_window_reduction: params")
        # No residual and a codec without state: the counter, and how the
        # params lie over Auto mesh axes where they are placed.
        return CodecState(
            _random.seed_state(seed),
            [],
            (),
            _auto_blocks.seen_splits(jax.tree.leaves(params)),
        )

    def reduce_fn(terms, layout, state):
        axes = tuple(sorted(layout.axes))
        config = _mean.Reduce(
            codec,
            axes[0] if len(axes) == 1 else axes,
            error_feedback=False,
            mean=False,
            report_sq_excess=True,
            caller="ternary_window_reduction",
        )
        return reduce_terms(config, terms, layout, state)

    return _reduction.WindowReduction(init_fn, reduce_fn)
