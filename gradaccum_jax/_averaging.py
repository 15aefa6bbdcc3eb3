"""Averaging updates across the devices of a mapped axis (data parallelism).

Each device computes gradients on its own shard of the batch; the update
every device applies must be the gradient of the whole batch. When the
shards hold different numbers of examples (ragged last batch, padding,
variable token counts) a plain mean over devices is biased towards the
devices that saw fewer examples; passing ``weight=`` (the number of
examples or tokens behind this device's update) gives the big-batch mean.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax import _checks, _weights


def average_across_devices(axis_name: Any) -> optax.GradientTransformationExtraArgs:
    """Averages the updates over the devices of the mapped axis ``axis_name``.

    Without a weight every device gets ``pmean(updates)``. With
    ``update(..., weight=w)``, ``w`` a scalar >= 0 per device (e.g. the number
    of examples or valid tokens it saw), every device gets the weighted mean
    ``psum(w * updates) / psum(w)``: if each device's update is the mean
    gradient over its own examples, that is the mean gradient over all
    examples on all devices. A device with ``w == 0`` contributes nothing (not
    even a NaN), and a total weight of 0 gives zeros. Updates keep their dtype
    and are reduced in it. Use it inside ``jax.pmap`` or ``jax.shard_map``
    over ``axis_name``, inside `MultiSteps` to reduce once per window; the
    data-parallel guide ("What average_across_devices computes" and "Under
    shard_map") has the rules for dtypes, weights, ``shard_map`` specs and
    plain ``jax.jit``.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from gradaccum_jax import average_across_devices
    >>> tx = average_across_devices("data")
    >>> def mean(update, weight):
    ...     return tx.update(update, tx.init(None), weight=weight)[0]
    >>> updates, weights = jnp.array([1.0, 4.0]), jnp.array([3.0, 1.0])
    >>> jax.vmap(mean, axis_name="data")(updates, weights)  # (3*1 + 1*4) / 4
    Array([1.75, 1.75], dtype=float32)

    Args:
      axis_name: The name of the mapped axis to average over (as given to
        ``pmap`` or to the ``Mesh``), or a tuple of names.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with an empty state whose
      ``update(updates, state, params=None, *, weight=None, **extra_args)``
      returns the averaged updates; other extra arguments are ignored.

    Raises:
      ValueError: At construction, if ``axis_name`` is not a non-empty string
        or tuple of strings; at trace time, if ``weight`` is not a scalar.
      NameError: At trace time, if ``axis_name`` is not bound, i.e. the
        update does not run inside ``pmap`` / ``shard_map`` over that axis.
    """
    axis_name = _checks.axis_name("axis_name", axis_name)

    def update_fn(
        updates: Any,
        state: optax.EmptyState,
        params: Any = None,
        *,
        weight: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.EmptyState]:
        del params, extra_args
        # Fails with a message that says how to bind the axis, instead of
        # JAX's bare "unbound axis name" from inside psum.
        _checks.bound_axis_size(axis_name, "average_across_devices")
        if weight is None:
            return _device_sum(updates, axis_name, mean=True), state
        weight = _weights.scalar_weight(weight, "average_across_devices")
        share, _ = _weights.share(weight, jax.lax.psum(weight, axis_name))

        def weighted_leaf(leaf: jax.Array) -> jax.Array:
            # Scale in float32 and round once: a bfloat16 share such as
            # 37/300 would itself be off by up to 0.2%.
            wide = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
            return _weights.weighted(share, wide).astype(leaf.dtype)

        return _device_sum(jax.tree.map(weighted_leaf, updates), axis_name), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _device_sum(tree: Any, axis_name: Any, *, mean: bool = False) -> Any:
    """``psum`` (or ``pmean``) of every leaf over ``axis_name``, in its dtype.

    On the CPU backend a bfloat16 or float16 leaf is summed in float32 and
    rounded back: XLA:CPU widens such an all-reduce to float32 itself (its
    AllReducePromotion pass), so the bytes are the same, and that pass
    aborts the process ("Invalid binary instruction opcode copy") on the
    all-reduce of a ``shard_map`` manual over some axes of a 2-D mesh.
    Elsewhere the collective moves the leaf's own bytes.
    """
    reduce = jax.lax.pmean if mean else jax.lax.psum
    widen = jax.default_backend() == "cpu"

    def leaf_sum(leaf: jax.Array) -> jax.Array:
        dtype = jnp.result_type(leaf)
        if widen and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return reduce(leaf.astype(jnp.float32), axis_name).astype(dtype)
        return reduce(leaf, axis_name)

    return jax.tree.map(leaf_sum, tree)
