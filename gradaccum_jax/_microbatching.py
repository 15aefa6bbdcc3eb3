"""Micro-batching inside one jitted step.

``microbatched_value_and_grad`` is a drop-in replacement for
``jax.value_and_grad`` that splits the batch into micro-batches and sums
their gradients with ``jax.lax.scan``: only one micro-batch's activations
are alive at a time, so peak activation memory falls with the number of
micro-batches while the result stays the big-batch loss and gradient. This
is the in-step accumulation of levanter, MaxText and t5x, with the
valid-token weighting that fixes the gradient-accumulation loss bug
(a mean of per-micro-batch means is not the big-batch mean when the
micro-batches hold different numbers of valid examples).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks, _weights
from gradaccum_jax._tree import vary_over, varying_axes

_KEY_ARG = "key"


def _key_position(loss_fn: Callable[..., Any]) -> int | None:
    """Where ``loss_fn`` takes a ``key`` argument: its position, -1, or None.

    Returns the positional index of a positional-or-keyword ``key``
    parameter, -1 for a keyword-only one, and None when ``loss_fn`` takes no
    ``key`` (or its signature cannot be inspected, e.g. some builtins).
    """
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, parameter in enumerate(parameters):
        if parameter.name != _KEY_ARG:
            continue
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return index
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            return -1
    return None


def _batch_size(batch: Any, num_microbatches: int) -> int:
    """Returns the leading axis size shared by every leaf of ``batch``.

    Raises a ValueError naming the offending leaf when a leaf has no leading
    axis or disagrees with the others, and naming ``num_microbatches`` and
    the batch size when one does not divide the other.
    """
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(
            "microbatched_value_and_grad: the batch (argument 1) has no array "
            "leaves, so there is nothing to split into micro-batches."
        )
    first_path, first_leaf = leaves[0]
    for path, leaf in leaves:
        if jnp.ndim(leaf) == 0:
            raise ValueError(
                f"microbatched_value_and_grad: batch leaf "
                f"{jax.tree_util.keystr(path)} is a scalar; every batch leaf "
                "needs a leading batch axis. Pass per-step constants as extra "
                "arguments after the batch instead."
            )
        if jnp.shape(leaf)[0] != jnp.shape(first_leaf)[0]:
            raise ValueError(
                f"microbatched_value_and_grad: batch leaves disagree on the "
                f"batch size: leaf {jax.tree_util.keystr(path)} has leading "
                f"axis {jnp.shape(leaf)[0]}, but leaf "
                f"{jax.tree_util.keystr(first_path)} has "
                f"{jnp.shape(first_leaf)[0]}. Every leaf of the batch must "
                "share its leading (batch) axis."
            )
    batch_size = jnp.shape(first_leaf)[0]
    if batch_size % num_microbatches:
        raise ValueError(
            f"`num_microbatches`={num_microbatches} does not divide the batch "
            f"size {batch_size}; choose a `num_microbatches` that divides it "
            "(or pad the batch and mask the padding with `weight_fn`)."
        )
    return batch_size


def _split(batch: Any, num_microbatches: int) -> Any:
    """Splits every leaf (B, ...) into (num_microbatches, B // num_microbatches, ...).

    Strided, as MaxText does: micro-batch i holds examples i, i + m,
    i + 2m, ... A batch sharded over devices along its batch axis keeps
    every micro-batch spread over the same devices, so no example moves
    between devices (a contiguous split would put micro-batch i on one
    device only).
    """

    def split_leaf(leaf: jax.Array) -> jax.Array:
        per_microbatch = leaf.shape[0] // num_microbatches
        leaf = leaf.reshape(per_microbatch, num_microbatches, *leaf.shape[1:])
        return jnp.swapaxes(leaf, 0, 1)

    return jax.tree.map(split_leaf, batch)


def _zeros(tree: Any, dtype: jnp.dtype) -> Any:
    """Zeros shaped like ``tree``'s leaves, varying where its leaves vary.

    Inside ``shard_map`` (with ``check_vma``) a scan carry must have the
    type the body returns: zeros are device-invariant, but a gradient of a
    device's own micro-batch varies over the batch axis, so the zeros are
    cast to varying (a no-op on the values, no communication).
    """

    def zeros(struct: jax.ShapeDtypeStruct) -> jax.Array:
        return vary_over(jnp.zeros(struct.shape, dtype), varying_axes(struct))

    return jax.tree.map(zeros, tree)


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    weight_fn: Callable[[Any], jax.Array] | None = None,
    accumulator_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` over a batch split into micro-batches.

    The returned function has the signature and outputs of
    ``jax.value_and_grad(loss_fn, has_aux=has_aux)`` (gradients with respect
    to argument 0). Its argument 1, the batch, is a pytree whose leaves share
    a leading batch axis of size B; it is split into ``num_microbatches``
    strided micro-batches (micro-batch i holds examples i, i + m, ...) and
    ``jax.lax.scan`` runs the forward and backward pass on one micro-batch
    at a time, so activation memory is that of a batch of B / m.

    With weights w_i (``weight_fn(microbatch_i)``, 1 without ``weight_fn``),
    the result is::

        loss  = sum_i w_i loss_i  / sum_i w_i
        grads = sum_i w_i grads_i / sum_i w_i
        aux   = sum_i w_i aux_i   / sum_i w_i     (leaf-wise, with has_aux)

    accumulated in ``accumulator_dtype``. Without ``weight_fn`` this is the
    mean of the micro-batch means, which is the big-batch mean since the
    micro-batches are equal in size. When ``loss_fn`` is a mean over valid
    examples (e.g. non-padding tokens) and ``weight_fn`` counts them, it is
    exactly the big-batch loss and gradient even when the micro-batches hold
    different numbers of valid examples. A micro-batch of weight 0 adds
    nothing (not even a NaN from an empty mean), and a zero total weight
    gives zeros.

    If ``loss_fn`` has a parameter named ``key`` (positional or keyword) and
    the caller passes a key, micro-batch i sees ``jax.random.fold_in(key,
    i)``, so dropout masks differ between micro-batches. Other arguments
    after the batch are passed unchanged to every micro-batch. Aux outputs
    are averaged, so they should be per-batch statistics (accuracy, a mean
    norm); per-example aux outputs are not concatenated.

    Inside ``jax.pmap`` the function adds no collective: follow it with one
    cross-device mean of the gradients (``jax.lax.pmean`` or
    ``gradaccum_jax.average_across_devices``, weighted by the device's
    ``weight_fn`` total) for one reduction per step. Inside ``shard_map``,
    mark replicated parameters varying first
    (``jax.lax.pcast(params, axis, to="varying")``); otherwise ``jax.grad``
    itself sums the gradient over the axis in every micro-batch. Under plain
    ``jax.jit`` with a batch sharded along its batch axis, the strided split
    moves no data, but XLA (GSPMD) all-reduces the replicated parameters'
    gradient once per micro-batch; use ``shard_map`` where that matters.

    Example::

        def loss_fn(params, batch):
            logits = batch["x"] @ params["w"]
            mask = batch["mask"]
            losses = optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["y"])
            return jnp.sum(losses * mask) / jnp.maximum(mask.sum(), 1)

        grad_fn = microbatched_value_and_grad(
            loss_fn, 8, weight_fn=lambda mb: mb["mask"].sum())
        loss, grads = jax.jit(grad_fn)(params, batch)

    Args:
      loss_fn: ``loss_fn(params, batch, *args, **kwargs)`` returning a scalar
        loss, or ``(loss, aux)`` with ``has_aux=True``.
      num_microbatches: number of micro-batches m, an integer >= 1 that
        divides the batch size.
      has_aux: as in ``jax.value_and_grad``. Aux leaves are averaged over the
        micro-batches (weighted with ``weight_fn``); floating leaves keep
        their dtype, other leaves come back in ``accumulator_dtype``.
      weight_fn: optional ``weight_fn(microbatch) -> scalar``, the weight of
        a micro-batch, e.g. its number of valid tokens.
      accumulator_dtype: floating dtype of the running sums (float32 by
        default, so bfloat16 gradients are summed without losing bits).

    Returns:
      A function with the signature of ``loss_fn`` returning
      ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux=True``;
      ``loss`` in the dtype ``loss_fn`` returns and ``grads`` in the dtype of
      the parameters.

    Raises:
      ValueError: at construction if ``num_microbatches`` is not an integer
        >= 1, ``accumulator_dtype`` is not floating, or ``loss_fn`` /
        ``weight_fn`` is not callable; at trace time if ``num_microbatches``
        does not divide the batch size, a batch leaf has no batch axis or
        disagrees with the others on its size, or ``weight_fn`` does not
        return a scalar.
    """
    if not callable(loss_fn):
        raise ValueError(f"`loss_fn` must be callable, got {loss_fn!r}.")
    num_microbatches = _checks.positive_int("num_microbatches", num_microbatches)
    has_aux = _checks.boolean("has_aux", has_aux)
    accumulator_dtype = _checks.float_dtype("accumulator_dtype", accumulator_dtype)
    if weight_fn is not None and not callable(weight_fn):
        raise ValueError(
            f"`weight_fn` must be None or a callable weight_fn(microbatch) -> "
            f"scalar, got {weight_fn!r}."
        )
    key_position = _key_position(loss_fn)
    value_and_grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    @functools.wraps(loss_fn)
    def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        _batch_size(batch, num_microbatches)
        call = _MicrobatchCall(value_and_grad_fn, params, args, kwargs, key_position)

        def weight_of(microbatch: Any) -> jax.Array:
            if weight_fn is None:
                return jnp.ones((), jnp.float32)
            return _microbatch_weight(weight_fn(microbatch))

        sums = _weighted_sums(
            call, weight_of, _split(batch, num_microbatches), accumulator_dtype
        )
        return _weighted_means(*sums)

    return microbatched


class _MicrobatchCall:
    """``value_and_grad(params, microbatch, *args, **kwargs)`` for micro-batch i.

    If the loss takes a PRNG key, micro-batch i gets ``fold_in(key, i)``:
    independent dropout masks per micro-batch, for raw and typed keys alike.
    """

    def __init__(self, value_and_grad_fn, params, args, kwargs, key_position):
        self._fn, self._params = value_and_grad_fn, params
        self._args, self._kwargs = list(args), dict(kwargs)
        # key_position counts params and batch; args start after them.
        self._key_index = None if key_position is None else key_position - 2
        if self._key_index is not None and 0 <= self._key_index < len(args):
            self._key = args[self._key_index]
        elif key_position is not None:
            self._key_index, self._key = None, kwargs.get(_KEY_ARG)
        else:
            self._key = None

    def __call__(self, microbatch: Any, index: jax.Array) -> Any:
        args, kwargs = list(self._args), dict(self._kwargs)
        if self._key is not None:
            microbatch_key = jax.random.fold_in(self._key, index)
            if self._key_index is not None:
                args[self._key_index] = microbatch_key
            else:
                kwargs[_KEY_ARG] = microbatch_key
        return self._fn(self._params, microbatch, *args, **kwargs)


def _microbatch_weight(weight: Any) -> jax.Array:
    """A ``weight_fn`` result as a float32 scalar, or a clear error."""
    if jnp.shape(weight) != ():
        raise ValueError(
            "`weight_fn` must return a scalar weight per micro-batch, "
            f"got shape {jnp.shape(weight)}. Reduce it, e.g. "
            "`lambda mb: mb['mask'].sum()`."
        )
    return _weights.scalar_weight(weight, "microbatched_value_and_grad: weight_fn")


def _weighted_sums(
    call: _MicrobatchCall,
    weight_of: Callable[[Any], jax.Array],
    microbatches: Any,
    accumulator_dtype: jnp.dtype,
) -> tuple[Any, Any, jax.Array, Any, Any]:
    """Scans the micro-batches, summing ``w_i * value_i`` and ``w_i * grads_i``.

    Returns the value sums, gradient sums, the total weight, and the shapes
    and dtypes of one micro-batch's value and gradients.
    """
    num_microbatches = jax.tree.leaves(microbatches)[0].shape[0]
    first_microbatch = jax.tree.map(lambda leaf: leaf[0], microbatches)
    # Shapes and dtypes of one micro-batch's outputs, to build the
    # accumulators without running anything.
    value_shape, grads_shape = jax.eval_shape(
        call, first_microbatch, jnp.zeros((), jnp.uint32)
    )
    weight_shape = jax.eval_shape(weight_of, first_microbatch)

    def accumulate(carry: Any, scanned: Any) -> Any:
        acc_value, acc_grads, total_weight = carry
        microbatch, index = scanned
        value, grads = call(microbatch, index)
        weight = weight_of(microbatch).astype(accumulator_dtype)

        def add(acc: jax.Array, new: jax.Array) -> jax.Array:
            # A micro-batch without valid examples often has a NaN loss
            # (0 / 0); weight 0 must drop it, and 0 * NaN = NaN.
            contribution = jnp.where(weight != 0, weight * new.astype(acc.dtype), 0)
            return acc + contribution

        acc_value = jax.tree.map(add, acc_value, value)
        acc_grads = jax.tree.map(add, acc_grads, grads)
        return (acc_value, acc_grads, total_weight + weight), None

    init = (
        _zeros(value_shape, accumulator_dtype),
        _zeros(grads_shape, accumulator_dtype),
        _zeros(weight_shape, accumulator_dtype),
    )
    if num_microbatches == 1:
        # A one-step scan still keeps a copy of the carry and the loop
        # buffers alive (about 1.1x the plain temp memory on CPU); the
        # direct call lets XLA fold the zero accumulators away.
        carry, _ = accumulate(init, (first_microbatch, jnp.uint32(0)))
    else:
        indices = jnp.arange(num_microbatches, dtype=jnp.uint32)
        carry, _ = jax.lax.scan(accumulate, init, (microbatches, indices))
    return (*carry, value_shape, grads_shape)


def _weighted_means(
    acc_value: Any,
    acc_grads: Any,
    total_weight: jax.Array,
    value_shape: Any,
    grads_shape: Any,
) -> tuple[Any, Any]:
    """Divides the sums by the total weight, back in the outputs' dtypes."""
    inverse, _ = _weights.share(jnp.ones_like(total_weight), total_weight)

    def mean(acc: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
        out_dtype = like.dtype if jnp.issubdtype(like.dtype, jnp.inexact) else acc.dtype
        return (acc * inverse.astype(acc.dtype)).astype(out_dtype)

    return (
        jax.tree.map(mean, acc_value, value_shape),
        jax.tree.map(mean, acc_grads, grads_shape),
    )
