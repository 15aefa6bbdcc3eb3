"""The scan over micro-batches: weighted sums of values and gradients, then means."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
        lambda struct: _on_mesh(
            zeros_like(struct, accumulation_dtype(struct, accumulator_dtype))
        ),
        tree,
    )


def _on_mesh(zeros: jax.Array) -> jax.Array:
    """``zeros`` typed on the current mesh, replicated, if it has no mesh.

    A 0-d ``jnp.zeros`` is typed on no mesh at all; as the carry of a scan
    under `_per_device.over_axis` (a vmap over an Explicit mesh axis) jax
    0.10.2 then fails to add the mapped axis to its type.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not jax.typeof(zeros).sharding.mesh.empty:
        return zeros
    return jax.lax.broadcast(zeros, (), out_sharding=NamedSharding(mesh, P()))


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


class WeightedSums(NamedTuple):
    """What the scan over one device's micro-batches leaves.

    Attributes:
      value: ``sum_i w_i value_i``, in float32 (or wider) whatever the
        accumulator dtype: a loss times 8 micro-batches of 8192 tokens
        overflows float16.
      grads: ``sum_i w_i grads_i`` in the accumulator dtype, or, for a
        dtype narrower than float32 (``grads_are_means``), this device's
        term of the running weighted mean (see `weighted_sums`).
      weight: ``sum_i w_i``, float32 (a float16 total overflows at 65504, a
        bfloat16 one stops growing at 256 micro-batches of weight 1).
      value_shape, grads_shape: one micro-batch's outputs, as shapes.
      grads_are_means: whether ``grads`` is already divided by the weight.
      noise: the `NoiseScaleState` of the micro-batches, when asked for.
    """

    value: Any
    grads: Any
    weight: jax.Array
    value_shape: Any
    grads_shape: Any
    grads_are_means: bool
    noise: Any = None


def weighted_sums(
    call: MicrobatchCall,
    weight_of: Callable[[Any], jax.Array],
    microbatches: Any,
    accumulator_dtype: jnp.dtype,
    shard: ShardedParams | None = None,
    noise_terms: bool = False,
) -> WeightedSums:
    """Scans the micro-batches, summing ``w_i * value_i`` and ``w_i * grads_i``.

    With ``shard``, each weighted gradient contribution goes through
    ``shard.reduce_contribution`` (a reduce-scatter for parameters gathered
    per micro-batch) before it is added; with ``noise_terms`` the scan also
    sums the micro-batches' weighted squared gradient norms.

    A gradient sum in an accumulator dtype narrower than float32 would
    overflow (float16: 8 micro-batches of 8192 tokens) or stop growing
    (bfloat16, 8 mantissa bits): the gradients are then kept as a running
    weighted mean, as `MultiSteps` keeps a low-precision window,
    ``t += (w_i g_i - W_i t) / (W_1 + ... + W_i)`` computed in float32 and
    rounded once per micro-batch, where ``W_i`` is micro-batch i's weight
    over all devices of the data axis (all weights are read before the
    scan, one psum of ``num_microbatches`` floats) and ``w_i`` this
    device's. The devices' ``t`` sum to the mean (one device: ``t`` is the
    mean, exact for a constant gradient).
    """
    num_microbatches = jax.tree.leaves(microbatches)[0].shape[0]
    first_microbatch = jax.tree.map(lambda leaf: leaf[0], microbatches)
    running = accumulator_dtype.itemsize < 4
    value_dtype = jnp.promote_types(accumulator_dtype, jnp.float32)
    value_shape, grads_shape = jax.eval_shape(
        call, first_microbatch, jnp.zeros((), jnp.uint32)
    )
    add_grads, grads_init = _gradient_rule(
        call, first_microbatch, accumulator_dtype, shard, running
    )

    def accumulate(carry: Any, scanned: Any) -> Any:
        acc_value, acc_grads, total_weight, *noise = carry
        microbatch, index, weights = scanned
        value, grads = call(microbatch, index)
        weight = weight_of(microbatch) if weights is None else weights[0]
        # A micro-batch without valid examples often has a NaN loss
        # (0 / 0): its weight 0 must drop it, and 0 * NaN = NaN.
        weighted_value = jax.tree.map(
            lambda v: _weights.weighted(weight, as_summand(v, value_dtype)), value
        )
        acc_value = jax.tree.map(jnp.add, acc_value, weighted_value)
        acc_grads = add_grads(acc_grads, grads, weight, weights)
        noise = [_noise_scale.add(n, grads, weight) for n in noise]
        return (acc_value, acc_grads, total_weight + weight, *noise), None

    init = (
        carry_zeros(value_shape, value_dtype),
        grads_init,
        # Zeros that vary over a data axis as a device's weight does.
        carry_zeros(jax.eval_shape(weight_of, first_microbatch), jnp.float32),
        *([_noise_scale.init()] if noise_terms else []),
    )
    indices = jnp.arange(num_microbatches, dtype=jnp.uint32)
    weights = None
    if running:
        weights = _window_weights(weight_of, microbatches, shard)
    if num_microbatches == 1:
        # A one-step scan still keeps a copy of the carry and the loop
        # buffers alive (about 1.1x the plain temp memory on CPU); the
        # direct call lets XLA fold the zero accumulators away.
        first = jax.tree.map(lambda leaf: leaf[0], (microbatches, indices, weights))
        carry, _ = accumulate(init, first)
    else:
        carry, _ = jax.lax.scan(accumulate, init, (microbatches, indices, weights))
    value, grads, weight, *noise = carry
    noise_state = noise[0] if noise else None
    return WeightedSums(
        value, grads, weight, value_shape, grads_shape, running, noise_state
    )


def _window_weights(
    weight_of: Callable[[Any], jax.Array],
    microbatches: Any,
    shard: ShardedParams | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per micro-batch: this device's weight ``w_i``, the weight over the
    data axis ``W_i`` and its cumulative sum, float32 vectors to scan."""
    local = jax.vmap(weight_of)(microbatches)
    over_devices = local if shard is None else jax.lax.psum(local, shard.axis)
    return local, over_devices, jnp.cumsum(over_devices)


def _gradient_rule(call, first_microbatch, accumulator_dtype, shard, running):
    """``(add, init)``: how a micro-batch's gradients enter the carry, and
    the carry's zeros (shaped as the contributions after ``shard``)."""
    reduce_contribution = (lambda g: g) if shard is None else shard.reduce_contribution
    acc_shape = jax.eval_shape(
        lambda mb: reduce_contribution(
            jax.tree.map(
                lambda g: as_summand(g, accumulator_dtype),
                call(mb, jnp.zeros((), jnp.uint32))[1],
            )
        ),
        first_microbatch,
    )

    def add_sum(acc_grads, grads, weight, weights):
        del weights
        weight = weight.astype(accumulator_dtype)
        contribution = jax.tree.map(
            lambda g: _weights.weighted(weight, as_summand(g, accumulator_dtype)),
            grads,
        )
        return jax.tree.map(jnp.add, acc_grads, reduce_contribution(contribution))

    def add_to_mean(acc_grads, grads, weight, weights):
        _, step_weight, cumulative = weights
        share, _ = _weights.share(weight, cumulative)
        decay, _ = _weights.share(step_weight, cumulative)
        contribution = jax.tree.map(
            lambda g: _weights.weighted(share, _widened(g)), grads
        )
        if shard is not None:
            # Sent in the accumulator dtype (a mean: no overflow).
            contribution = reduce_contribution(
                jax.tree.map(
                    lambda c, g: c.astype(as_summand(g, accumulator_dtype).dtype),
                    contribution,
                    grads,
                )
            )

        def step(t, c):
            # t + (c - decay t): exact when c = decay t (a constant gradient).
            wide = _widened(t)
            return (wide + (_widened(c) - decay * wide)).astype(t.dtype)

        return jax.tree.map(step, acc_grads, contribution)

    add = add_to_mean if running else add_sum
    return add, carry_zeros(acc_shape, accumulator_dtype)


def _widened(leaf: jax.Array) -> jax.Array:
    """``leaf`` in float32 (complex64 for a complex leaf) or wider."""
    return leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))


def weighted_means(sums: WeightedSums) -> tuple[Any, Any]:
    """Divides the sums by the total weight, back in the outputs' dtypes."""
    inverse, _ = _weights.share(jnp.ones_like(sums.weight), sums.weight)

    def mean(acc: jax.Array, like: jax.ShapeDtypeStruct, divide: bool) -> jax.Array:
        out_dtype = like.dtype if jnp.issubdtype(like.dtype, jnp.inexact) else acc.dtype
        if divide:
            acc = acc * inverse.astype(acc.dtype)
        return acc.astype(out_dtype)

    return (
        jax.tree.map(lambda a, s: mean(a, s, True), sums.value, sums.value_shape),
        jax.tree.map(
            lambda a, s: mean(a, s, not sums.grads_are_means),
            sums.grads,
            sums.grads_shape,
        ),
    )
