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

# The public docstring, byte for byte as it was inside the function, which
# it would make longer than 80 lines; set as its ``__doc__`` below it.
_API_DOC = """Averages the updates over the devices of the mapped axis ``axis_name``.

    Without a weight every device gets ``pmean(updates)``. With
    ``update(..., weight=w)``, where ``w`` is a scalar per device (e.g. the
    number of examples or valid tokens it saw), every device gets the
    weighted mean ``psum(w * updates) / psum(w)``: if each device's update is
    the mean gradient over its own examples, that is the mean gradient over
    all examples on all devices. Devices with ``w == 0`` contribute nothing
    (not even a NaN from an empty shard's 0/0 loss), and a total weight of 0
    gives zero updates, not NaN. Weights must be >= 0.

    Updates keep their dtype and are reduced in it, so the collective moves
    the bytes of the updates (plus one float32 scalar for the total weight);
    on a CPU, which sums bfloat16 and float16 in float32 anyway, in float32.
    The weighted path scales each update by ``w / psum(w)`` in float32
    before the reduction, so a float16 sum cannot overflow from large
    weights. Other extra arguments are ignored, so it composes
    with any ``optax.chain``.

    Inside ``MultiSteps`` or ``accumulate`` the reduction runs once per
    window, at the emitting step, with ``weight=`` the window's total
    weight, so a device counts by the examples it saw in the whole window.
    Under ``shard_map`` with ``check_vma=True`` the emitted updates are
    then typed device-invariant, and the params can leave the map
    replicated, when the emitting decision is invariant too: give the
    state's counters and inner state ``P()`` and only the window sum
    ``P(axis_name)``::

      state_specs = MultiStepsState(
          mini_step=P(), gradient_step=P(), inner_opt_state=P(),
          acc_grads=P(axis_name), skip_state=P(), acc_weight=P(),
          micro_steps=P(), emitted=P())
      step = jax.shard_map(
          train_step, mesh=mesh,
          in_specs=(P(), state_specs, P(axis_name)),  # params, state, batch
          out_specs=(P(), state_specs))

    Here each device's ``acc_grads`` block is its own window sum (the
    global array stacks them along the first axis). These specs are for
    windows without per-device weights or skip function: a ``weight=``
    that differs between devices makes ``acc_weight`` differ, a skip
    function makes the counters differ, and such leaves cannot be ``P()``:
    keep the state inside the map (a scan over the steps) or give it a
    leading device axis under ``P(axis_name)``.

    Use it inside ``jax.pmap(..., axis_name=axis_name)`` or inside
    ``jax.shard_map`` over a mesh axis named ``axis_name`` with the batch
    (and hence the gradients) split over that axis and the parameters
    replicated. Under ``shard_map`` (with its default ``check_vma=True``)
    replicated ``P()`` parameters are device-invariant, and ``jax.grad``
    with respect to them already returns the gradient summed over the axis;
    averaging that sum again would give ``axis_size`` times the mean.
    Mark them varying before taking the gradient,
    ``params = jax.lax.pcast(params, axis_name, to="varying")``, so that
    each device keeps its own gradient for this transformation to average.

    Under plain ``jax.jit`` with a batch sharded by
    ``NamedSharding`` the program is written for the whole global batch:
    the gradient of the mean loss is already the mean over all devices (XLA
    inserts the all-reduce), so no averaging transformation is needed. For
    a weighted mean there, compute the loss as the sum of per-example
    losses divided by the global number of valid examples (or wrap the
    gradient computation in ``jax.shard_map`` and use this transformation).

    Args:
      axis_name: The name of the mapped axis to average over (as given to
        ``pmap`` or to the ``Mesh``), or a tuple of names.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with an empty state whose
      ``update(updates, state, params=None, *, weight=None, **extra_args)``
      returns the averaged updates.

    Raises:
      ValueError: At construction, if ``axis_name`` is not a non-empty string
        or tuple of strings; at trace time, if ``weight`` is not a scalar.
      NameError: At trace time, if ``axis_name`` is not bound, i.e. the
        update does not run inside ``pmap`` / ``shard_map`` over that axis.
    """


def average_across_devices(axis_name: Any) -> optax.GradientTransformationExtraArgs:
    # The docstring is `_API_DOC` above.
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
            return jnp.where(share != 0, wide * share, 0).astype(leaf.dtype)

        return _device_sum(jax.tree.map(weighted_leaf, updates), axis_name), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


average_across_devices.__doc__ = _API_DOC


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
