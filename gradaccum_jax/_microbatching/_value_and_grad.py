"""`microbatched_value_and_grad`: the public entry point, built from the steps
of the sibling modules (keys, batch splitting, the scan, the data-axis layout)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks, _noise_scale, _tree
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


def microbatched_value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    weight_fn: Callable[[Any], jax.Array] | None = None,
    accumulator_dtype: Any = jnp.float32,
    key_argnum: int | str | None = None,
    batch_argnums: int | tuple[int, ...] = 1,
    data_axis: str | None = None,
    gather_params_once: bool = True,
    unreduced_grads: bool = False,
    return_noise_scale: bool = False,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` over a batch split into micro-batches.

    The returned function has the signature and outputs of
    ``jax.value_and_grad(loss_fn, has_aux=has_aux)``. It splits the batch
    (argument 1, or the arguments ``batch_argnums`` names, such as the
    inputs and the labels of ``loss_fn(params, x, y)``) into
    ``num_microbatches`` strided micro-batches, runs the
    forward and backward pass on one at a time in a ``jax.lax.scan`` (the
    activation memory of one micro-batch) and returns the means of the loss,
    gradients and aux weighted by ``weight_fn``: the big-batch ones when
    ``loss_fn`` is a mean over valid examples and ``weight_fn`` counts them.
    See the micro-batching guide for the rules: what it computes; PRNG keys,
    extra arguments and aux; sharded parameters and data parallelism; errors.

    Example: padded micro-batches weighted by their valid counts:

      >>> import jax, jax.numpy as jnp
      >>> def loss_fn(params, batch):  # a mean over the valid examples
      ...     losses = (batch["x"] @ params["w"] - batch["y"]) ** 2
      ...     return jnp.sum(losses * batch["mask"]) / batch["mask"].sum()
      >>> x = jnp.arange(24.0).reshape(8, 3) / 10
      >>> batch = {"x": x, "y": jnp.ones(8), "mask": (jnp.arange(8) < 6) * 1.0}
      >>> grad_fn = microbatched_value_and_grad(
      ...     loss_fn, 4, weight_fn=lambda micro_batch: micro_batch["mask"].sum()
      ... )
      >>> params = {"w": jnp.ones(3)}
      >>> loss, grads = jax.jit(grad_fn)(params, batch)
      >>> big_loss, big_grads = jax.value_and_grad(loss_fn)(params, batch)
      >>> bool(jnp.allclose(loss, big_loss) & jnp.allclose(grads["w"], big_grads["w"]))
      True

    Args:
      loss_fn: ``loss_fn(params, batch, *args, **kwargs)`` returning a scalar
        loss, or ``(loss, aux)`` with ``has_aux=True``.
      num_microbatches: the number of micro-batches, >= 1; divides the batch.
      has_aux: as in ``jax.value_and_grad``; aux leaves are weighted means.
      weight_fn: None, or ``weight_fn(microbatch) -> scalar``, the weight of
        a micro-batch (e.g. its number of valid tokens); 1 without it.
      accumulator_dtype: floating dtype of the gradient sums (a running
        mean when narrower than float32); the loss, aux and weights are
        summed in float32.
      key_argnum: None, or the position (>= 2) or keyword name of the PRNG
        key argument; micro-batch i gets ``jax.random.fold_in(key, i)``.
      batch_argnums: the position (>= 1), or a tuple of them, of the
        arguments split into micro-batches, each a pytree with a leading
        batch axis (default 1); the arguments after them that it does not
        name go whole to every micro-batch.
      data_axis: None, or the mesh axis the batch is sharded over: each
        device scans its own examples and the gradient is reduced once.
      gather_params_once: with ``data_axis``, gather parameters sharded over
        it once per step (True) or in every micro-batch (False; where some
        parameter is also split over another mesh axis, once per step).
      unreduced_grads: with ``data_axis`` on an Explicit mesh, return the
        gradients unreduced over it.
      return_noise_scale: also return this step's `NoiseScaleEstimate`
        (McCandlish et al. 2018).

    Returns:
      A function with ``loss_fn``'s signature returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux=True``, and the estimate as a
      third output with ``return_noise_scale=True``.
    """
    # Nothing but the arguments is bound yet: ``locals()`` is them, by name.
    options = _checked_options(**locals())
    batch_positions = options.batch_argnums
    if batch_positions == (1,):
        value_and_grad_fn = jax.value_and_grad(loss_fn, has_aux=options.has_aux)
        step = _MicrobatchedStep(value_and_grad_fn, options)

        @functools.wraps(loss_fn)
        def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            return step(params, batch, args, kwargs)

        return microbatched

    # Several batch arguments: the scan sees them as one tuple, argument 1.
    def on_batch_tuple(params: Any, batch: tuple, *rest: Any, **kwargs: Any) -> Any:
        return loss_fn(params, *_merged(batch, rest, batch_positions), **kwargs)

    value_and_grad_fn = jax.value_and_grad(on_batch_tuple, has_aux=options.has_aux)
    step = _MicrobatchedStep(value_and_grad_fn, options)

    @functools.wraps(loss_fn)
    def microbatched_arguments(params: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) < max(batch_positions):
            raise ValueError(
                f"microbatched_value_and_grad: `batch_argnums`={batch_positions} "
                f"names argument {max(batch_positions)}, but the call passes "
                f"{len(args) + 1} positional argument(s)."
            )
        batch = tuple(args[i - 1] for i in batch_positions)
        rest = tuple(a for i, a in enumerate(args, 1) if i not in batch_positions)
        return step(params, batch, rest, kwargs)

    return microbatched_arguments


def _merged(batch: tuple, rest: tuple, positions: tuple[int, ...]) -> list[Any]:
    """The arguments after params in their order: ``batch``'s at
    ``positions``, ``rest`` in the others."""
    merged, batch_args, rest_args = [], iter(batch), iter(rest)
    for i in range(1, len(batch) + len(rest) + 1):
        merged.append(next(batch_args) if i in positions else next(rest_args))
    return merged


class _Options(NamedTuple):
    """The checked arguments of one `microbatched_value_and_grad`."""

    num_microbatches: int
    has_aux: bool
    weight_fn: Callable[[Any], Any] | None
    accumulator_dtype: jnp.dtype
    key: KeySlot
    batch_argnums: tuple[int, ...]
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
    batch_argnums,
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
    batch_argnums = _batch_argnums(batch_argnums)
    key: KeySlot = key_slot(loss_fn, key_argnum)
    if key.position in batch_argnums:
        raise ValueError(
            f"`key_argnum`={key_argnum} is one of `batch_argnums` "
            f"{batch_argnums}: the PRNG key is not split into micro-batches."
        )
    if key.position is not None and batch_argnums != (1,):
        # The scan calls the loss with the batch arguments as one tuple
        # (argument 1), then the others: the key's position among those.
        before = sum(1 for i in range(1, key.position) if i not in batch_argnums)
        key = key._replace(position=2 + before)
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
        batch_argnums,
        data_axis,
        gather_params_once,
        unreduced_grads,
        return_noise_scale,
    )


def _check_unsplit_extras(args: tuple, kwargs: dict, options: _Options) -> None:
    """Refuses an argument passed whole to every micro-batch whose leading
    axis is split over ``data_axis`` like a batch's (the labels of
    ``loss_fn(params, x, y)``): each device would get all of it, and the
    loss would meet a batch of another size than its micro-batch."""
    # The positions, counting params as 0, of the arguments not split.
    count = len(args) + len(options.batch_argnums)
    positions = [i for i in range(1, count + 1) if i not in options.batch_argnums]
    data_axis = options.data_axis
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    for path, leaf in leaves:
        parts = _tree.partitions(leaf)
        if parts and data_axis in _tree.mesh_axes_in(parts[:1]):
            inside = jax.tree_util.keystr(path[2:])
            if path[0].idx == 0:
                what = f"argument {positions[path[1].idx]}{inside}"
            else:
                what = f"keyword argument {path[1].key!r}{inside}"
            raise ValueError(
                f"microbatched_value_and_grad: {what} "
                f"has its leading axis split over `data_axis` {data_axis!r}, "
                "like a batch, but it is passed whole to every micro-batch. "
                "Name it in `batch_argnums` (e.g. batch_argnums=(1, 2) for "
                "loss_fn(params, x, y)) to split it with the batch."
            )


def _batch_argnums(value: Any) -> tuple[int, ...]:
    """Validates ``batch_argnums``: a position >= 1 or a tuple of distinct
    ones, returned sorted."""
    positions = value if isinstance(value, tuple) else (value,)
    if not positions or not all(
        isinstance(p, (int, np.integer)) and not isinstance(p, bool) and p >= 1
        for p in positions
    ):
        raise ValueError(
            "`batch_argnums` must be a position >= 1 (the params are 0) or a "
            f"non-empty tuple of them, got {value!r}."
        )
    if len(set(positions)) != len(positions):
        raise ValueError(f"`batch_argnums` names a position twice: {value!r}.")
    return tuple(sorted(int(p) for p in positions))


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
            return weighted_means(self._local_sums(params, batch, args, kwargs))
        layout = DataLayout.of(
            options.data_axis,
            params,
            options.gather_params_once,
            options.unreduced_grads,
        )
        checked_batch_size(batch, options.num_microbatches, layout.size)
        _check_unsplit_extras(args, kwargs, options)
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
        sums = weighted_sums(
            self._call(params, args, kwargs, None),
            self._weight_of,
            microbatches,
            self._options.accumulator_dtype,
            noise_terms=True,
        )
        value, grads = weighted_means(sums)
        estimate = _noise_scale.batch_estimate(
            sums.noise.sq_norm_sum, sums.noise.micro_batches, sums.weight, grads
        )
        return value, grads, estimate
