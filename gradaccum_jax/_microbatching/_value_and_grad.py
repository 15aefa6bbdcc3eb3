"""`microbatched_value_and_grad`: the public entry point, built from the steps
of the sibling modules (keys, batch splitting, the scan, the data-axis layout)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax import _checks, _noise_scale
from gradaccum_jax._microbatching._batch import checked_batch_size, strided_split
from gradaccum_jax._microbatching._keys import KeySlot, key_slot
from gradaccum_jax._microbatching._layout import DataLayout
from gradaccum_jax._microbatching._scan import (
    MicrobatchCall,
    microbatch_weight,
    weighted_means,
    weighted_sums,
)
from gradaccum_jax._microbatching._sharded import over_data_axis

# The public docstring, byte for byte as it was inside the function, which
# it would make longer than 80 lines; set as its ``__doc__`` below it.
_API_DOC = """``jax.value_and_grad`` over a batch split into micro-batches.

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

    PRNG keys: with ``key_argnum`` (the key's position among ``loss_fn``'s
    arguments, params being 0 and the batch 1, or its keyword name) and a
    key passed there, micro-batch i sees ``jax.random.fold_in(key, i)``, so
    dropout masks differ between micro-batches. Where ``loss_fn``'s
    signature shows the parameter, the key is found by position and by
    keyword alike; where it hides it (``*args, **kwargs``: a decorator
    without ``functools.wraps``), a call that may pass the key the other
    way raises a ValueError rather than give every micro-batch the same key.
    Without ``key_argnum`` a parameter literally named ``key`` in
    ``loss_fn``'s signature is still used, with a DeprecationWarning: a
    decorator without ``functools.wraps`` hides the signature and every
    micro-batch would silently get the same key. Other arguments after the
    batch are passed unchanged to every micro-batch. Aux outputs are
    averaged, so they should be per-batch statistics (accuracy, a mean
    norm); per-example aux outputs are not concatenated. A Python number in
    aux (``batch.shape[0]``) is averaged as a 0-d array, as
    ``jax.value_and_grad`` would take it.

    Sharded parameters under ``jax.jit``, with or without ``data_axis``: on
    an Explicit mesh the accumulators and the gradients have the
    parameters' sharding (FSDP ``P("data", None)``, tensor-parallel
    ``P(None, "model")``); on an Auto mesh XLA places them.

    Data parallelism under ``jax.jit`` (``data_axis``): with a mesh set by
    ``jax.set_mesh`` (Explicit or Auto axes) and the batch sharded along its
    batch axis over the mesh axis ``data_axis``, each device runs the scan
    over its own examples (``jax.shard_map`` over ``data_axis`` only; other
    mesh axes, e.g. tensor parallelism, stay as they are) and the gradient is
    reduced once per step, after the scan, in one fused all-reduce with the
    loss and the total weight. Without ``data_axis``, XLA all-reduces the
    replicated parameters' gradient in every micro-batch. Here a
    "micro-batch" is one device's share of one micro-batch: the weights are
    per device (a device whose share has no valid example adds nothing), so
    ``loss_fn`` must be a per-example mean (and ``weight_fn`` a count) for
    the result to be the big-batch one; losses that couple examples across
    the batch (batch norm statistics, in-batch negatives) see the device's
    examples only. The key, if any, is also folded with the device index.
    B must be divisible by ``num_microbatches`` times the axis size.

    FSDP / ZeRO-3 (parameters sharded over ``data_axis``, Explicit mesh):
    with ``gather_params_once=True`` (default) every such parameter is
    all-gathered once per step, before the scan, and its gradient is reduced
    once after it and returned with the parameter's sharding: the fewest
    collectives, but every device holds the full parameters and a full-size
    gradient accumulator for the whole scan. With
    ``gather_params_once=False`` each micro-batch all-gathers the parameter
    and reduce-scatters its weighted gradient into a sharded accumulator:
    2 collectives per micro-batch and parameter, but only the shard is held
    between micro-batches (XLA may still hoist the loop-invariant gather out
    of the loop). On an Auto mesh the parameters' sharding is not visible
    while tracing, so they are always gathered once.

    ``unreduced_grads=True`` (Explicit mesh only) skips the gradient
    reduction: the gradients come back typed unreduced over ``data_axis``
    (each device holds its weighted share
    ``sum_i w_di grads_di / sum_di w_di``, the sum over devices is the
    gradient), so an accumulator that keeps unreduced gradients can add
    several steps and reduce once per window; only the loss and the total
    weight (scalars) are all-reduced. A gradient keeps its parameter's
    partitions over the other mesh axes (``P(None, "model",
    unreduced={"data"})`` for a tensor-parallel weight) and is whole along
    ``data_axis``. Leaves reduce-scattered per micro-batch
    (``gather_params_once=False``) come back reduced.

    ``return_noise_scale=True`` adds a third output, a
    `NoiseScaleEstimate` of this step: ``|G|^2``, ``tr(S)`` and
    ``B_simple = tr(S) / |G|^2`` from the squared norms of the micro-batch
    gradients and of their weighted mean (McCandlish et al. 2018, appendix
    A; the formulas are those of `MultiSteps`' ``track_noise_scale``, in
    units of ``weight_fn``, micro-batches without it). One step's estimate
    is noisy: average ``grad_sq_norm`` and ``noise_trace`` over steps
    before taking their ratio. NaN with fewer than two micro-batches of
    nonzero weight. Not with ``data_axis``.

    Inside ``jax.pmap`` the function adds no collective: follow it with one
    cross-device mean of the gradients (``jax.lax.pmean`` or
    ``gradaccum_jax.average_across_devices``, weighted by the device's
    ``weight_fn`` total) for one reduction per step. Inside ``shard_map``,
    mark replicated parameters varying first
    (``jax.lax.pcast(params, axis, to="varying")``); otherwise ``jax.grad``
    itself sums the gradient over the axis in every micro-batch.

    Example: padded micro-batches of unequal valid counts, weighted by
    ``weight_fn``, give exactly the big-batch masked mean (add
    ``key_argnum=`` for a dropout key, ``data_axis=`` on a sharded batch):

      >>> import jax
      >>> import jax.numpy as jnp
      >>> from gradaccum_jax import microbatched_value_and_grad
      >>> def loss_fn(params, batch):
      ...     losses = (batch["x"] @ params["w"] - batch["y"]) ** 2
      ...     mask = batch["mask"]
      ...     return jnp.sum(losses * mask) / jnp.maximum(mask.sum(), 1)
      >>> x = jnp.arange(24.0).reshape(8, 3) / 10
      >>> batch = {"x": x, "y": jnp.ones(8), "mask": (jnp.arange(8) < 6) * 1.0}
      >>> grad_fn = microbatched_value_and_grad(
      ...     loss_fn, 4, weight_fn=lambda micro_batch: micro_batch["mask"].sum()
      ... )
      >>> params = {"w": jnp.ones(3)}
      >>> loss, grads = jax.jit(grad_fn)(params, batch)
      >>> full_loss, full_grads = jax.value_and_grad(loss_fn)(params, batch)
      >>> bool(jnp.allclose(loss, full_loss))
      True
      >>> bool(jnp.allclose(grads["w"], full_grads["w"]))
      True

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
        Complex leaves are summed in the complex dtype of at least that
        precision (complex64 for float32 and below).
      key_argnum: None, the position (an integer >= 2) of the PRNG key among
        ``loss_fn``'s arguments, or its keyword name.
      data_axis: None, or the name of the mesh axis the batch is sharded
        over, to accumulate device-local gradients and reduce them once.
      gather_params_once: with ``data_axis``, whether parameters sharded over
        it are gathered once per step (True) or in every micro-batch.
      unreduced_grads: with ``data_axis`` on an Explicit mesh, return the
        gradients unreduced over it instead of all-reducing them.
      return_noise_scale: also return this step's `NoiseScaleEstimate`.

    Returns:
      A function with the signature of ``loss_fn`` returning
      ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux=True``;
      ``loss`` in the dtype ``loss_fn`` returns and ``grads`` in the dtype of
      the parameters; with ``return_noise_scale=True``, a third output, the
      `NoiseScaleEstimate`.

    Raises:
      ValueError: at construction if ``num_microbatches`` is not an integer
        >= 1, ``accumulator_dtype`` is not floating, ``loss_fn`` /
        ``weight_fn`` is not callable, ``key_argnum`` is neither None, an
        integer >= 2 nor an identifier, ``data_axis`` is not a non-empty
        string, a flag is not a bool, or ``unreduced_grads`` is set without
        ``data_axis``; at trace time if ``num_microbatches`` (times the
        ``data_axis`` size) does not divide the batch size, a batch leaf has
        no batch axis or disagrees with the others on its size,
        ``weight_fn`` does not return a scalar, ``data_axis`` is not an axis
        of the current mesh, ``unreduced_grads`` is used on an Auto axis, or
        the key may be among arguments ``loss_fn``'s signature hides (see
        PRNG keys above).
    """


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    weight_fn: Callable[[Any], jax.Array] | None = None,
    accumulator_dtype: Any = jnp.float32,
    key_argnum: int | str | None = None,
    data_axis: str | None = None,
    gather_params_once: bool = True,
    unreduced_grads: bool = False,
    return_noise_scale: bool = False,
) -> Callable[..., Any]:
    # The docstring is `_API_DOC` above.
    options = _checked_options(
        loss_fn,
        num_microbatches,
        has_aux,
        weight_fn,
        accumulator_dtype,
        key_argnum,
        data_axis,
        gather_params_once,
        unreduced_grads,
        return_noise_scale,
    )
    value_and_grad_fn = jax.value_and_grad(loss_fn, has_aux=options.has_aux)
    step = _MicrobatchedStep(value_and_grad_fn, options)

    @functools.wraps(loss_fn)
    def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        return step(params, batch, args, kwargs)

    return microbatched


microbatched_value_and_grad.__doc__ = _API_DOC


class _Options(NamedTuple):
    """The checked arguments of one `microbatched_value_and_grad`."""

    num_microbatches: int
    has_aux: bool
    weight_fn: Callable[[Any], Any] | None
    accumulator_dtype: jnp.dtype
    key: KeySlot
    data_axis: str | None
    gather_params_once: bool
    unreduced_grads: bool
    return_noise_scale: bool


def _checked_options(
    loss_fn,
    num_microbatches,
    has_aux,
    weight_fn,
    accumulator_dtype,
    key_argnum,
    data_axis,
    gather_params_once,
    unreduced_grads,
    return_noise_scale,
) -> _Options:
    """The arguments checked in the order they are documented, each failing
    with a ValueError that names it."""
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
    key: KeySlot = key_slot(loss_fn, key_argnum)
    if data_axis is not None and not (isinstance(data_axis, str) and data_axis):
        raise ValueError(
            "`data_axis` must be None or a non-empty string naming the mesh "
            f"axis the batch is sharded over, got {data_axis!r}."
        )
    gather_params_once = _checks.boolean("gather_params_once", gather_params_once)
    unreduced_grads = _checks.boolean("unreduced_grads", unreduced_grads)
    if unreduced_grads and data_axis is None:
        raise ValueError(
            "`unreduced_grads`=True needs `data_axis`: gradients are unreduced "
            "over the mesh axis the batch is sharded over."
        )
    return_noise_scale = _checks.boolean("return_noise_scale", return_noise_scale)
    if return_noise_scale and data_axis is not None:
        raise ValueError(
            "`return_noise_scale`=True is not supported with `data_axis` (the "
            "micro-batch norms would be per-device terms): pass data_axis=None."
        )
    return _Options(
        num_microbatches,
        has_aux,
        weight_fn,
        accumulator_dtype,
        key,
        data_axis,
        gather_params_once,
        unreduced_grads,
        return_noise_scale,
    )


class _MicrobatchedStep:
    """One call of the function `microbatched_value_and_grad` returns: the
    scan over the micro-batches, then the weighted means (with the noise
    scale), or the scan laid out over the data axis."""

    def __init__(self, value_and_grad_fn: Callable[..., Any], options: _Options):
        self._value_and_grad_fn = value_and_grad_fn
        self._options = options

    def __call__(self, params: Any, batch: Any, args: tuple, kwargs: dict) -> Any:
        options = self._options
        if options.data_axis is None and options.return_noise_scale:
            checked_batch_size(batch, options.num_microbatches)
            return self._with_noise_scale(params, batch, args, kwargs)
        if options.data_axis is None:
            checked_batch_size(batch, options.num_microbatches)
            return weighted_means(*self._local_sums(params, batch, args, kwargs))
        layout = DataLayout.of(
            options.data_axis,
            params,
            options.gather_params_once,
            options.unreduced_grads,
        )
        checked_batch_size(batch, options.num_microbatches, layout.size)
        return over_data_axis(self._local_sums, layout, params, batch, args, kwargs)

    def _weight_of(self, microbatch: Any) -> jax.Array:
        if self._options.weight_fn is None:
            return jnp.ones((), jnp.float32)
        return microbatch_weight(self._options.weight_fn(microbatch))

    def _call(self, params, args, kwargs, shard) -> MicrobatchCall:
        return MicrobatchCall(
            self._value_and_grad_fn, params, args, kwargs, self._options.key, shard
        )

    def _local_sums(self, params, batch, args, kwargs, shard=None):
        """The scan on this device's batch: weighted sums and the total weight."""
        microbatches = strided_split(batch, self._options.num_microbatches)
        return weighted_sums(
            self._call(params, args, kwargs, shard),
            self._weight_of,
            microbatches,
            self._options.accumulator_dtype,
            shard,
        )

    def _with_noise_scale(self, params, batch, args, kwargs):
        """``(value, grads, estimate)``: the means and this step's noise scale."""
        microbatches = strided_split(batch, self._options.num_microbatches)
        *sums, noise = weighted_sums(
            self._call(params, args, kwargs, None),
            self._weight_of,
            microbatches,
            self._options.accumulator_dtype,
            noise_terms=True,
        )
        value, grads = weighted_means(*sums)
        estimate = _noise_scale.batch_estimate(
            noise.sq_norm_sum,
            noise.micro_batches,
            sums[2].astype(jnp.float32),
            grads,
        )
        return value, grads, estimate
