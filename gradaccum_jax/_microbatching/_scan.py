"""The scan over micro-batches: weighted sums of values and gradients, then means."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from gradaccum_jax import _noise_scale, _weights
from gradaccum_jax._tree import accumulation_dtype, zeros_like

if TYPE_CHECKING:
    from gradaccum_jax._microbatching._layout import ShardedParams


def as_summand(leaf: Any, accumulator_dtype: jnp.dtype) -> jax.Array:
    """``leaf`` (an array or, as jax treats an aux output, a Python scalar)
    in the dtype it is summed in."""
    leaf = jnp.asarray(leaf)
    return leaf.astype(accumulation_dtype(leaf, accumulator_dtype))


def carry_zeros(tree: Any, accumulator_dtype: jnp.dtype) -> Any:
    """Zeros like ``tree``'s leaves (``jax.ShapeDtypeStruct``s), in the
    dtype each is summed in.

    A scan carry must have the type the body returns, sharding included:
    an explicitly sharded gradient (FSDP ``f32[8@data,4]``, tensor-parallel
    ``f32[8,4@model]``) needs zeros with the same partitions, and inside
    ``shard_map`` a device's own gradient varies over the batch axis where
    plain zeros are invariant. `zeros_like` keeps both.
    """
    return jax.tree.map(
        lambda struct: zeros_like(
            struct, accumulation_dtype(struct, accumulator_dtype)
        ),
        tree,
    )


class MicrobatchCall:
    """``value_and_grad(params, microbatch, *args, **kwargs)`` for micro-batch i.

    If the loss takes a PRNG key, micro-batch i gets ``fold_in(key, i)``:
    independent dropout masks per micro-batch, for raw and typed keys alike.
    With a data axis (``shard``) the key is first folded with the device
    index, so that devices draw different masks for their examples.
    """

    def __init__(self, value_and_grad_fn, params, args, kwargs, key_slot, shard):
        self._fn, self._params, self._shard = value_and_grad_fn, params, shard
        self._args, self._kwargs = list(args), dict(kwargs)
        self._key_index, self._key_name = key_slot.locate(args, kwargs)
        self._key = None
        if self._key_name is not None:
            self._key = kwargs[self._key_name]
        elif self._key_index is not None:
            self._key = args[self._key_index]
        if self._key is not None and shard is not None:
            device = jax.lax.axis_index(shard.axis)
            self._key = jax.random.fold_in(self._key, device)

    def __call__(self, microbatch: Any, index: jax.Array) -> Any:
        args, kwargs = list(self._args), dict(self._kwargs)
        if self._key is not None:
            microbatch_key = jax.random.fold_in(self._key, index)
            if self._key_index is not None:
                args[self._key_index] = microbatch_key
            else:
                kwargs[self._key_name] = microbatch_key
        params = self._params if self._shard is None else self._shard.full(self._params)
        return self._fn(params, microbatch, *args, **kwargs)


def microbatch_weight(weight: Any) -> jax.Array:
    """A ``weight_fn`` result as a float32 scalar, or a clear error."""
    if jnp.shape(weight) != ():
        raise ValueError(
            "`weight_fn` must return a scalar weight per micro-batch, "
            f"got shape {jnp.shape(weight)}. Reduce it, e.g. "
            "`lambda mb: mb['mask'].sum()`."
        )
    return _weights.scalar_weight(weight, "microbatched_value_and_grad: weight_fn")


def weighted_sums(
    call: MicrobatchCall,
    weight_of: Callable[[Any], jax.Array],
    microbatches: Any,
    accumulator_dtype: jnp.dtype,
    shard: ShardedParams | None = None,
    noise_terms: bool = False,
) -> tuple[Any, ...]:
    """Scans the micro-batches, summing ``w_i * value_i`` and ``w_i * grads_i``.

    With ``shard``, each weighted gradient contribution goes through
    ``shard.reduce_contribution`` (a reduce-scatter for parameters gathered
    per micro-batch) before it is added. Returns the value sums, gradient
    sums, the total weight, and the shapes and dtypes of one micro-batch's
    value and gradients; with ``noise_terms``, also the `NoiseScaleState`
    whose ``A`` and ``k`` hold the micro-batches' weighted squared gradient
    norms and their count (summed in the same scan step as the gradients).
    """
    reduce_contribution = (lambda g: g) if shard is None else shard.reduce_contribution
    num_microbatches = jax.tree.leaves(microbatches)[0].shape[0]
    first_microbatch = jax.tree.map(lambda leaf: leaf[0], microbatches)
    # Shapes and dtypes of one micro-batch's outputs, to build the
    # accumulators without running anything.
    value_shape, grads_shape = jax.eval_shape(
        call, first_microbatch, jnp.zeros((), jnp.uint32)
    )
    weight_shape = jax.eval_shape(weight_of, first_microbatch)
    acc_shape = jax.eval_shape(
        lambda mb: reduce_contribution(
            jax.tree.map(
                lambda g: as_summand(g, accumulator_dtype),
                call(mb, jnp.zeros((), jnp.uint32))[1],
            )
        ),
        first_microbatch,
    )

    def accumulate(carry: Any, scanned: Any) -> Any:
        acc_value, acc_grads, total_weight, *noise = carry
        microbatch, index = scanned
        value, grads = call(microbatch, index)
        weight = weight_of(microbatch).astype(accumulator_dtype)

        def weighted(new: jax.Array) -> jax.Array:
            # A micro-batch without valid examples often has a NaN loss
            # (0 / 0); weight 0 must drop it, and 0 * NaN = NaN.
            new = as_summand(new, accumulator_dtype)
            return jnp.where(weight != 0, weight * new, jnp.zeros_like(new))

        acc_value = jax.tree.map(jnp.add, acc_value, jax.tree.map(weighted, value))
        contribution = jax.tree.map(weighted, grads)
        acc_grads = jax.tree.map(jnp.add, acc_grads, reduce_contribution(contribution))
        noise = [_noise_scale.add(n, grads, weight.astype(jnp.float32)) for n in noise]
        return (acc_value, acc_grads, total_weight + weight, *noise), None

    init = (
        carry_zeros(value_shape, accumulator_dtype),
        carry_zeros(acc_shape, accumulator_dtype),
        carry_zeros(weight_shape, accumulator_dtype),
        *([_noise_scale.init()] if noise_terms else []),
    )
    if num_microbatches == 1:
        # A one-step scan still keeps a copy of the carry and the loop
        # buffers alive (about 1.1x the plain temp memory on CPU); the
        # direct call lets XLA fold the zero accumulators away.
        carry, _ = accumulate(init, (first_microbatch, jnp.uint32(0)))
    else:
        indices = jnp.arange(num_microbatches, dtype=jnp.uint32)
        carry, _ = jax.lax.scan(accumulate, init, (microbatches, indices))
    return (*carry[:3], value_shape, grads_shape, *carry[3:])


def weighted_means(
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
