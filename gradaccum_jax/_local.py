"""Per-device gradients under `jax.jit`, left unreduced until a window emits.

Under ``jax.jit`` with a batch sharded over a data axis, ``jax.grad`` of a
mean loss all-reduces the gradients on every call: with accumulation that
is one gradient-sized all-reduce per micro-step, k per window, where one
per window suffices (the window's sum is linear). `local_value_and_grad`
takes each device's gradient (`_per_device.over_axis`: mapped over the data
axis only, so a tensor-parallel split is kept) and returns it *unreduced*
(type ``f32[...]{U:data}``: each device holds one term of the sum, nothing
has crossed devices), its loss and weight one row per device; an
accumulator built with the same ``unreduced_axes`` keeps the window's
terms across calls (as rows of an ordinary array) and reduces it once,
when it emits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks, _partials, _per_device, _placement, _weights


def local_value_and_grad(
    loss_fn: Callable[..., Any],
    axis_name: str = "data",
    *,
    has_weight: bool = False,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Value and gradient of ``loss_fn``, one term per device of ``axis_name``.

    ``loss_fn(params, *batch)`` is evaluated on each device's shard of the
    batch (every ``batch`` argument is split along its leading dimension
    over ``axis_name``, here if it is not already, as a batch restored
    from the host; a 0-d leaf such as a PRNG key goes to every device
    whole, so fold ``jax.lax.axis_index(axis_name)`` into a key inside
    ``loss_fn`` for a stream per device; ``params`` are replicated). Each
    device returns one term of a sum over the devices:

    * without weights: its loss and gradient divided by the number of
      devices, so that their sum is the mean over devices;
    * ``has_weight=True``: ``loss_fn`` returns ``(loss, weight)``, the
      device's mean loss and its weight (its number of valid examples or
      tokens); the terms are ``w * loss``, ``w`` and ``w * g``. Pass ``w``
      on as ``update(..., weight=w)``: the window's gradient is then
      ``sum(w g) / sum(w)`` over all devices and micro-batches, the
      big-batch gradient even when devices hold different numbers of valid
      examples.

    ``loss_fn`` runs once per device in a ``jax.vmap`` mapped over
    ``axis_name`` only where another mesh axis is Explicit, so a
    tensor-parallel param keeps its split over it (a ``shard_map`` manual
    over ``axis_name`` would gather it on jax 0.10.2); where every other
    axis is Auto (or there is none), in that ``shard_map``, which gathers
    nothing there, keeps the backward dots plain and the compiler
    partitions the other axes inside. Inside it ``jax.lax.axis_index(axis_name)`` works,
    and so does a ``psum`` or ``pmean`` over ``axis_name`` of an array
    whose leading dimension is a multiple of the axis size; on an Explicit
    mesh jax 0.10.2 fails to lower one of a 0-d value (an AssertionError):
    sum ``jnp.broadcast_to(x, (n,))`` and take its element 0.

    The loss and the weight (and ``aux``) come back as one row per device:
    arrays of shape ``(n_devices,)`` split over ``axis_name``, on either
    kind of mesh, which a jitted step returns as they are (sum them where
    they are logged: ``loss.sum() / weight.sum()``; no collective runs in
    the step). The gradients' form follows the mesh (``jax.set_mesh``): on
    an Explicit axis unreduced arrays shaped like the params (type
    ``f32[...]{U:data}``), to hand to the accumulator in the same step; on
    an Auto axis, which has no unreduced types, stacked on a new leading
    axis of size ``n_devices``. An accumulator built with
    ``unreduced_axes=axis_name`` takes either form (and the weight rows)
    and sums them once per window.

    Usage (k micro-batches per update, one all-reduce per window)::

      mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
      jax.set_mesh(mesh)
      opt = gradaccum_jax.MultiSteps(optax.adam(1e-3), 8, unreduced_axes="data")
      state = opt.init(params)
      grad_fn = gradaccum_jax.local_value_and_grad(loss_fn, "data")

      @jax.jit
      def step(params, state, x, y):
          loss, grads = grad_fn(params, x, y)  # no collective
          updates, state = opt.update(grads, state, params)
          return optax.apply_updates(params, updates), state, loss

    ``loss`` holds one term per device: ``loss.sum()`` where it is logged.
    The same code runs on an Auto mesh (``axis_types=(AxisType.Auto,)``,
    or a plain ``jax.sharding.Mesh``) once it is set with ``jax.set_mesh``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType
    >>> import gradaccum_jax as ga
    >>> def loss_fn(w, x):
    ...     return jnp.mean(w * x)
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    >>> grad_fn = jax.jit(ga.local_value_and_grad(loss_fn))
    >>> with jax.set_mesh(mesh):
    ...     loss, grads = grad_fn(1.0, jnp.arange(8.0))
    >>> loss.shape, grads.shape  # one term per device (stacked on an Auto mesh)
    ((8,), (8,))
    >>> float(loss.sum()), float(grads.sum())  # their sum is the mean over devices
    (3.5, 3.5)

    With ``has_aux=True``, ``loss_fn`` returns ``(value, aux)``, ``value``
    being what it returns without (``loss``, or ``(loss, weight)``), and
    the result is ``((value, aux), grads)``, as ``jax.value_and_grad``'s:
    ``aux`` (an accuracy, a count of correct tokens) is per device, not a
    term of a sum, so each leaf comes back stacked on a new leading axis of
    size ``n_devices`` split over ``axis_name`` (row ``d`` device ``d``'s,
    as `worker_value_and_grad` returns it), an ordinary array on either
    kind of mesh: ``aux.sum(0)`` or ``aux.mean(0)`` where it is logged.

    A batch argument that is None (an absent field, such as
    ``batch.get("inputs_position")``), or a None inside one, reaches
    ``loss_fn`` as None on every device.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> loss`` (a scalar, the mean over
        the device's examples), or ``-> (loss, weight)`` with
        ``has_weight``; either as the first of a pair ``(value, aux)``
        with ``has_aux``.
      axis_name: the mesh axis the batch is split over.
      has_weight: whether ``loss_fn`` also returns the device's weight.
      has_aux: whether ``loss_fn`` also returns auxiliary data.

    Returns:
      ``fn(params, *batch) -> (loss, grads)``, or ``((loss, weight), grads)``
      with ``has_weight``, all per-device terms over ``axis_name`` (the
      loss and weight one row per device); with ``has_aux``,
      ``((value, aux), grads)``, ``aux`` one row per device.
    """
    loss_fn, axis_name, has_weight = _checked_arguments(loss_fn, axis_name, has_weight)
    has_aux = _checks.boolean("has_aux", has_aux)
    device_term = functools.partial(
        _device_term, loss_fn, axis_name, has_weight, has_aux
    )

    def value_and_grad(params, *batch):
        value, grads, aux = _per_device_terms(device_term, axis_name, params, batch)
        return ((value, aux), grads) if has_aux else (value, grads)

    return value_and_grad


def _checked_arguments(
    loss_fn: Any, axis_name: Any, has_weight: Any
) -> tuple[Callable[..., Any], str, bool]:
    """`local_value_and_grad`'s arguments, or a ValueError naming the bad one."""
    loss_fn = _checks.optional_callable(
        "loss_fn", loss_fn, "loss_fn(params, *batch) -> loss"
    )
    if loss_fn is None:
        raise ValueError("`loss_fn` must be a callable, got None.")
    axis_name = _checks.axis_name("axis_name", axis_name)
    if not isinstance(axis_name, str):
        raise ValueError(
            "`axis_name` must be a non-empty string naming one mesh axis, got "
            f"{axis_name!r}."
        )
    return loss_fn, axis_name, _checks.boolean("has_weight", has_weight)


def _device_term(
    loss_fn: Callable[..., Any],
    axis_name: str,
    has_weight: bool,
    has_aux: bool,
    params,
    *batch,
) -> tuple[Any, Any, Any]:
    """One device's ``(loss, grads, aux)`` terms (``((w loss, w), w grads,
    aux)`` with ``has_weight``, else loss and grads divided by the number of
    devices; ``aux`` is the device's own, ``()`` without ``has_aux``)."""

    def objective(params, *batch):
        out = loss_fn(params, *batch)
        value, aux = out if has_aux else (out, ())
        loss, weight = value if has_weight else (value, None)
        return loss, (weight, aux)

    (loss, (weight, aux)), grads = jax.value_and_grad(objective, has_aux=True)(
        params, *batch
    )
    if has_weight:
        weight = jnp.asarray(weight, jnp.float32)
        # A device holding only padding has weight 0 and a 0 / 0 mean loss,
        # NaN gradients included: its terms must be zeros, not 0 * NaN.
        scaled = jax.tree.map(
            lambda g: _weights.weighted(weight.astype(g.dtype), g), grads
        )
        return (_weights.weighted(weight, loss), weight), scaled, aux
    share = 1.0 / jax.lax.axis_size(axis_name)
    return loss * share, jax.tree.map(lambda g: g * share, grads), aux


def _per_device_terms(
    device_term: Callable[..., Any], axis_name: str, params: Any, batch: tuple
) -> Any:
    """Every device's ``device_term`` on its rows of ``batch``: its value
    and grads unreduced over an Explicit ``axis_name``, stacked on a leading
    axis over an Auto one; its aux stacked on either."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"local_value_and_grad: mesh axis {axis_name!r} is not in the "
            f"current mesh {mesh.axis_names}: call it under "
            "jax.set_mesh(mesh)."
        )
    _placement.check_not_sharded_over(
        params, frozenset({axis_name}), "local_value_and_grad: param"
    )
    # A batch restored from the host arrives unsplit: split it here (0-d
    # arguments, a dropout key, go to every device whole).
    batch, batch_axes = _per_device.stacked_arguments(
        batch, axis_name, "local_value_and_grad"
    )
    # Mapped over the data axis only: the other axes (a 2-D mesh's
    # ``model``) stay in the types, so tensor-parallel params keep their
    # split and the loss's own collectives are the plain step's. The terms
    # come out stacked on a leading device axis (a constant one, a weight
    # from a static shape, broadcast to every device).
    value, grads, aux = _per_device.over_axis(
        device_term, axis_name, (None, *batch_axes)
    )(params, *batch)
    # The gradients in the form the accumulator keeps its terms (unreduced
    # on an Explicit axis, stacked otherwise): decided by the one layout
    # rule. The loss, weight and aux stay one row per device: ordinary
    # arrays a jitted step returns as they are (an accumulator's `update`
    # takes the weight rows as its terms).
    layout = _partials.device_terms_layout(frozenset({axis_name}))
    return value, layout.from_stacked(grads), aux
