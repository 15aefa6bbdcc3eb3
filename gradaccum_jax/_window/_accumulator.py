"""How one window's weighted gradient sum is stored: the `WindowAccumulator`.

The accumulation engine (`MultiSteps`) only ever calls these four pure
functions on the window; what they keep is theirs. `float_accumulator` keeps
one floating array per parameter; the ternary package plugs in int8 code
sums the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

from gradaccum_jax import _checks, _partials, _placement, _tree, _weights


class WindowAccumulator(NamedTuple):
    """How one window's weighted gradient sum is stored.

    Attributes:
      init: ``init(params) -> acc``, the empty window for these params.
      add: ``add(acc, grads, weight) -> acc``, adds ``weight * grads``;
        ``weight`` is a float32 scalar. A zero weight must leave ``acc``
        unchanged even when ``grads`` holds NaN or Inf: that is how skipped
        micro-batches are dropped.
      total: ``total(acc) -> tree``, the window's weighted sum
        ``sum_i w_i g_i`` as floating arrays shaped like the params.
      reset: ``reset(acc) -> acc``, the empty window again (an accumulator
        may carry things across windows, such as a PRNG key).
      for_device: optional ``for_device(acc, device) -> acc``, the empty
        window of device ``device`` (an int32 index) when each device keeps
        its own window (`per_device_accumulator`), e.g. with a random
        stream of its own; None: every device starts from ``init``'s.

    All four are pure functions of their arguments. The engine resets
    lazily: the first ``add`` of a window is given ``reset(acc)``, never a
    window that was already emitted.
    """

    init: Callable[[Any], Any]
    add: Callable[[Any, Any, jax.Array], Any]
    total: Callable[[Any], Any]
    reset: Callable[[Any], Any]
    for_device: Callable[[Any, jax.Array], Any] | None = None


def float_accumulator(
    dtype: Any = jnp.float32, unreduced_axes: Collection[str] = ()
) -> WindowAccumulator:
    """The window sum kept as one floating array per parameter.

    With ``unreduced_axes`` the sum is kept as one term per device over
    those mesh axes: unreduced (type ``f32[...]{U:data}``) on an Explicit
    mesh, stacked on a leading axis of size ``n_devices`` on an Auto mesh
    (one axis). Each device adds its own gradients and nothing crosses
    devices until the engine reduces the window, once, when it emits.
    Gradients must then come in the same form
    (`gradaccum_jax.local_value_and_grad`). A replicated weight multiplies
    them as usual; a per-device weight (unreduced, or shape
    ``(n_devices,)`` when stacked) means each device's gradient term is
    already weighted (``w_d * g_d``), since a product of two sums over
    devices is not the sum of the products.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> window = ga.extend.float_accumulator(jnp.bfloat16)
    >>> opt = ga.MultiSteps(optax.sgd(1.0), 2, window_accumulator=window)
    >>> acc = opt.init({"w": jnp.zeros(3)}).acc_grads  # below float32: a running mean
    >>> type(acc).__name__, acc.mean["w"].dtype
    ('RunningMean', dtype(bfloat16))

    Args:
      dtype: floating dtype of the sum (``accumulator_dtype``). A dtype
        narrower than float32 keeps a running mean instead (see
        `RunningMean`).
      unreduced_axes: mesh axes over which gradients arrive as per-device
        terms; ``init`` then needs the mesh (``jax.set_mesh``). Needs a
        float32 (or wider) ``dtype``.

    Returns:
      A `WindowAccumulator` whose state is a tree shaped like the params
      (a `RunningMean` for a dtype narrower than float32).
    """
    dtype = _checks.float_dtype("dtype", dtype)
    axes = _checks.axis_names("unreduced_axes", unreduced_axes)
    if dtype.itemsize < 4:
        if axes:
            # A running mean subtracts, and unreduced arrays have no `-`:
            # a partial sum minus a partial sum is not defined per device.
            raise ValueError(
                "`unreduced_axes` needs a float32 (or wider) accumulator "
                f"dtype, got {dtype.name}: a narrower window is kept as a "
                "running mean, which cannot be split into per-device terms."
            )
        return _running_mean_accumulator(dtype)

    def init(params):
        zeros = _zeros_in(params, dtype)
        if axes:
            _placement.check_not_sharded_over(params, axes, "Param")
        return jax.tree.map(_partials.terms_layout(axes).zeros, zeros)

    def add(acc, grads, weight):
        layout = _partials.terms_layout(axes)
        weighted = layout.is_weighted(weight)
        _check_window_arrival(acc, grads, layout, weighted)
        if weighted:
            return _add_weighted_terms(layout, acc, grads, weight)
        weight = weight.astype(dtype)

        def add_leaf(path, a, g):
            g = g.astype(a.dtype)
            g_axes = _tree.unreduced_axes(g)
            # The multiply rule of an unreduced operand wants the other one
            # marked reduced over the same axes (same value on every device).
            w = reshard(weight, P(reduced=set(g_axes))) if g_axes else weight
            # A select on the weight, not only a multiply by it: a zero-weight
            # micro-batch (skipped, or all padding with a 0/0 loss) may hold
            # NaNs, and 0 * NaN is NaN.
            return jnp.where(weight != 0, a + w * g, a)

        return jax.tree_util.tree_map_with_path(add_leaf, acc, grads)

    def total(acc):
        return acc

    def reset(acc):
        # A fresh zero, not `0 * acc`: 0 * NaN is NaN, and a NaN micro-batch
        # must not leak into the next window.
        return jax.tree.map(_tree.zeros_like, acc)

    return WindowAccumulator(init, add, total, reset)


def _add_weighted_terms(
    layout: _partials.TermsLayout, acc: Any, grads: Any, weight: Any
) -> Any:
    """``acc`` plus per-device terms already weighted (``w_d g_d``), each
    added only where its device's ``w_d`` (in ``weight``) is not 0."""
    terms = jax.tree.map(lambda a, g: g.astype(a.dtype), acc, grads)
    return layout.add_terms(acc, terms, weight)


class RunningMean(NamedTuple):
    """A low-precision window: its weighted mean and its float32 total weight.

    Attributes:
      mean: ``sum_i w_i g_i / sum_i w_i`` per parameter, in the accumulator
        dtype (zeros for an empty window).
      weight: ``sum_i w_i``, a float32 scalar.
    """

    mean: Any
    weight: jax.Array


def _running_mean_accumulator(dtype: jnp.dtype) -> WindowAccumulator:
    """A window kept as a running weighted mean in ``dtype``.

    A sum in float16 overflows at 65504 (80 micro-batches of 1000), and one
    in bfloat16 stops growing once it is 256 times a term (8 mantissa bits):
    the mean of 512 ones comes out as 0.5. A mean stays within the range of
    the gradients and is updated as ``m + (w / W) (g - m)`` in float32, with
    ``W`` the float32 total, so a constant gradient is kept exactly and each
    micro-step rounds once, as optax's running mean does (measured in
    ``benchmarks/bench_low_precision.py``).
    """

    def init(params):
        return RunningMean(_zeros_in(params, dtype), jnp.zeros([], jnp.float32))

    def add(acc, grads, weight):
        _checks.same_structure(
            grads,
            acc.mean,
            "gradients",
            "the accumulator (built from the params at init)",
        )
        total = acc.weight + weight
        # w / W in float32: a weight (e.g. 70000 tokens) may not fit dtype.
        share, _ = _weights.share(weight, total)

        def step(m, g):
            wide = jnp.promote_types(m.dtype, jnp.float32)  # complex stays so
            m32 = m.astype(wide)
            new = m32 + share * (g.astype(wide) - m32)
            # As in the sum: a select, so a zero weight drops NaN gradients.
            return jnp.where(weight != 0, new.astype(m.dtype), m)

        return RunningMean(jax.tree.map(step, acc.mean, grads), total)

    def total(acc):
        # The sum in float32: in dtype it would overflow (float16).
        return jax.tree.map(
            lambda m: m.astype(jnp.promote_types(m.dtype, jnp.float32)) * acc.weight,
            acc.mean,
        )

    def reset(acc):
        return RunningMean(
            jax.tree.map(jnp.zeros_like, acc.mean), jnp.zeros_like(acc.weight)
        )

    return WindowAccumulator(init, add, total, reset)


def _zeros_in(params: Any, dtype: jnp.dtype) -> Any:
    """An empty window: zeros like ``params`` (their sharding too) in ``dtype``.

    Complex params get a complex window of ``dtype``'s precision.
    """
    return jax.tree.map(
        lambda p: _tree.zeros_like(p, _tree.accumulation_dtype(p, dtype)), params
    )


def _check_window_arrival(
    acc: Any, grads: Any, layout: _partials.TermsLayout, weighted: bool
) -> None:
    """Raises unless ``grads`` fit the float window ``acc`` in its layout.

    The terms' form is checked before the shapes: stacked terms and a whole
    gradient differ in shape, and only the form's check says why.
    """
    if jax.tree.structure(grads) == jax.tree.structure(acc):
        jax.tree_util.tree_map_with_path(
            lambda path, a, g: check_arrival(path, layout, a, g, weighted), acc, grads
        )
    _checks.same_structure(
        grads, acc, "gradients", "the accumulator (built from the params at init)"
    )


def check_arrival(
    path: Any, layout: _partials.TermsLayout, acc: Any, grad: Any, weighted: bool
) -> None:
    """Raises unless a gradient leaf comes as terms in the window's layout.

    ``acc`` is the window's leaf, or None for a per-device window (whose
    leaves are no gradient's shape: only the leading device axis is checked).
    """
    if layout.stacked:
        if acc is not None:
            one_term = jax.ShapeDtypeStruct(jnp.shape(acc)[1:], jnp.result_type(acc))
            if layout.arrives_whole(grad, one_term):
                raise _checks.whole_gradient_error(
                    jax.tree_util.keystr(path), layout.axes
                )
        expected = (layout.device_count(),) if acc is None else jnp.shape(acc)
        if jnp.shape(grad)[: len(expected)] != expected or (
            acc is not None and jnp.shape(grad) != expected
        ):
            raise ValueError(
                f"Gradient leaf {jax.tree_util.keystr(path)} has shape "
                f"{jnp.shape(grad)}; on an Auto mesh the window keeps one term "
                "per device stacked on a leading axis of size "
                f"{layout.device_count()}: "
                "pass the stacked per-device gradients of local_value_and_grad, "
                "or build the accumulator without unreduced_axes to take "
                "jax.grad's whole gradients."
            )
        return
    grad_axes = _tree.unreduced_axes(grad)
    if layout.arrives_whole(grad, None):
        raise _checks.whole_gradient_error(jax.tree_util.keystr(path), layout.axes)
    if grad_axes != layout.axes:
        raise ValueError(
            f"Gradient leaf {jax.tree_util.keystr(path)} is unreduced over mesh "
            f"axes {sorted(grad_axes)}, the accumulation window over "
            f"{sorted(layout.axes)}: pass unreduced_axes={tuple(sorted(grad_axes))} "
            "to the accumulator (MultiSteps, accumulate) and init it again."
        )
    if weighted and not grad_axes:
        raise ValueError(
            "An unreduced `weight` means each device's gradients are already "
            f"weighted, but gradient leaf {jax.tree_util.keystr(path)} is not "
            "unreduced: pass a replicated weight."
        )
