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
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _checks, _weights
from gradaccum_jax._tree import vary_over, varying_axes

_KEY_ARG = "key"


def _key_position(loss_fn: Callable[..., Any], name: str = _KEY_ARG) -> int | None:
    """Where ``loss_fn`` takes the argument ``name``: its position, -1, or None.

    Returns the positional index of a positional-or-keyword parameter called
    ``name``, -1 for a keyword-only one, and None when ``loss_fn`` has no such
    parameter (or its signature cannot be inspected, e.g. some builtins).
    """
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, parameter in enumerate(parameters):
        if parameter.name != name:
            continue
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return index
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            return -1
    return None


def _parameter_name(loss_fn: Callable[..., Any], position: int) -> str | None:
    """The name of ``loss_fn``'s positional-or-keyword parameter at
    ``position``, so a key passed by keyword is found too; None if hidden."""
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if position < len(parameters):
        parameter = parameters[position]
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return parameter.name
    return None


class _KeySlot(NamedTuple):
    """Where the PRNG key sits in a call: a position in ``loss_fn``'s
    arguments (counting params and batch, as jax's argnums do) and/or a
    keyword name. Both None: the loss takes no key."""

    position: int | None
    name: str | None


def _key_slot(loss_fn: Callable[..., Any], key_argnum: int | str | None) -> _KeySlot:
    """Validates ``key_argnum`` and resolves it into a `_KeySlot`.

    With ``key_argnum=None`` a parameter called ``key`` found by
    ``inspect.signature`` is still used, with a DeprecationWarning: a
    decorator without ``functools.wraps`` hides it and silently gives every
    micro-batch the same key.
    """
    if key_argnum is None:
        position = _key_position(loss_fn)
        if position is None:
            return _KeySlot(None, None)
        warnings.warn(
            "microbatched_value_and_grad: found the PRNG key through the "
            "parameter name `key` of `loss_fn`'s signature; pass "
            "`key_argnum=` (its position, counting params as 0 and the batch "
            "as 1, or the keyword name) instead. A decorator without "
            "functools.wraps hides the name and every micro-batch would get "
            "the same key.",
            DeprecationWarning,
            stacklevel=3,
        )
        return _KeySlot(position if position >= 0 else None, _KEY_ARG)
    if isinstance(key_argnum, str) and key_argnum.isidentifier():
        position = _key_position(loss_fn, key_argnum)
        return _KeySlot(position if position and position >= 2 else None, key_argnum)
    if (
        isinstance(key_argnum, (int, np.integer))
        and not isinstance(key_argnum, bool)
        and key_argnum >= 2
    ):
        return _KeySlot(int(key_argnum), _parameter_name(loss_fn, int(key_argnum)))
    raise ValueError(
        "`key_argnum` must be None, an integer >= 2 (the position of the "
        "PRNG key among loss_fn's arguments; 0 is params and 1 the batch) or "
        f"a keyword name (an identifier string), got {key_argnum!r}."
    )


def _batch_size(batch: Any, num_microbatches: int, num_devices: int = 1) -> int:
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
    if batch_size % (num_microbatches * num_devices):
        per_device = (
            ""
            if num_devices == 1
            else f" times the `data_axis` size {num_devices} (each device "
            "splits its own examples)"
        )
        raise ValueError(
            f"`num_microbatches`={num_microbatches}{per_device} does not divide "
            f"the batch size {batch_size}; choose a `num_microbatches` that "
            "divides it (or pad the batch and mask the padding with "
            "`weight_fn`)."
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
    key_argnum: int | str | None = None,
    data_axis: str | None = None,
    gather_params_once: bool = True,
    unreduced_grads: bool = False,
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

    PRNG keys: with ``key_argnum`` (the key's position among ``loss_fn``'s
    arguments, params being 0 and the batch 1, or its keyword name) and a
    key passed there, micro-batch i sees ``jax.random.fold_in(key, i)``, so
    dropout masks differ between micro-batches. Without ``key_argnum`` a
    parameter literally named ``key`` in ``loss_fn``'s signature is still
    used, with a DeprecationWarning: a decorator without ``functools.wraps``
    hides the signature and every micro-batch would silently get the same
    key. Other arguments after the batch are passed unchanged to every
    micro-batch. Aux outputs are averaged, so they should be per-batch
    statistics (accuracy, a mean norm); per-example aux outputs are not
    concatenated.

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
    (``P(..., unreduced={data_axis})``: each device holds its weighted share
    ``sum_i w_di grads_di / sum_di w_di``, the sum over devices is the
    gradient), so an accumulator that keeps unreduced gradients can add
    several steps and reduce once per window; only the loss and the total
    weight (scalars) are all-reduced. Leaves reduce-scattered per
    micro-batch (``gather_params_once=False``) come back reduced.

    Inside ``jax.pmap`` the function adds no collective: follow it with one
    cross-device mean of the gradients (``jax.lax.pmean`` or
    ``gradaccum_jax.average_across_devices``, weighted by the device's
    ``weight_fn`` total) for one reduction per step. Inside ``shard_map``,
    mark replicated parameters varying first
    (``jax.lax.pcast(params, axis, to="varying")``); otherwise ``jax.grad``
    itself sums the gradient over the axis in every micro-batch.

    Example::

        def loss_fn(params, batch, key):
            logits = apply(params, batch["x"], dropout_key=key)
            mask = batch["mask"]
            losses = optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["y"])
            return jnp.sum(losses * mask) / jnp.maximum(mask.sum(), 1)

        grad_fn = microbatched_value_and_grad(
            loss_fn, 8, weight_fn=lambda mb: mb["mask"].sum(),
            key_argnum=2, data_axis="data")
        loss, grads = jax.jit(grad_fn)(params, batch, key)

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
      key_argnum: None, the position (an integer >= 2) of the PRNG key among
        ``loss_fn``'s arguments, or its keyword name.
      data_axis: None, or the name of the mesh axis the batch is sharded
        over, to accumulate device-local gradients and reduce them once.
      gather_params_once: with ``data_axis``, whether parameters sharded over
        it are gathered once per step (True) or in every micro-batch.
      unreduced_grads: with ``data_axis`` on an Explicit mesh, return the
        gradients unreduced over it instead of all-reducing them.

    Returns:
      A function with the signature of ``loss_fn`` returning
      ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux=True``;
      ``loss`` in the dtype ``loss_fn`` returns and ``grads`` in the dtype of
      the parameters.

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
        of the current mesh, or ``unreduced_grads`` is used on an Auto axis.
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
    key_slot = _key_slot(loss_fn, key_argnum)
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
    value_and_grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def weight_of(microbatch: Any) -> jax.Array:
        if weight_fn is None:
            return jnp.ones((), jnp.float32)
        return _microbatch_weight(weight_fn(microbatch))

    def local_sums(params, batch, args, kwargs, shard=None):
        call = _MicrobatchCall(value_and_grad_fn, params, args, kwargs, key_slot, shard)
        return _weighted_sums(
            call, weight_of, _split(batch, num_microbatches), accumulator_dtype, shard
        )

    @functools.wraps(loss_fn)
    def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if data_axis is None:
            _batch_size(batch, num_microbatches)
            return _weighted_means(*local_sums(params, batch, args, kwargs))
        layout = _DataLayout.of(data_axis, params, gather_params_once, unreduced_grads)
        _batch_size(batch, num_microbatches, layout.size)
        return _over_data_axis(local_sums, layout, params, batch, args, kwargs)

    return microbatched


class _DataLayout(NamedTuple):
    """How a step is laid out over the data axis.

    ``gather_dims`` holds, per parameter leaf, the dimension sharded over
    the axis when that leaf is gathered in every micro-batch (None: the
    leaf enters the scan whole, gathered once if it was sharded).
    """

    axis: str
    size: int
    explicit: bool
    gather_dims: Any
    unreduced: bool

    @classmethod
    def of(cls, axis, params, gather_params_once, unreduced) -> _DataLayout:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or axis not in mesh.axis_names:
            raise ValueError(
                f"`data_axis`={axis!r} is not an axis of the current mesh "
                f"(axes {tuple(mesh.axis_names)}); set a mesh with that axis "
                "with `jax.set_mesh(mesh)` around the call (or the jit)."
            )
        kind = mesh.axis_types[mesh.axis_names.index(axis)]
        explicit = kind == jax.sharding.AxisType.Explicit
        if unreduced and not explicit:
            raise ValueError(
                f"`unreduced_grads`=True needs `data_axis`={axis!r} to be an "
                f"Explicit mesh axis, but it is {kind}: unreduced arrays are a "
                "type of Explicit sharding."
            )

        def gather_dim(leaf: Any) -> int | None:
            # Auto axes do not show in the type while tracing: a leaf then
            # looks replicated and shard_map gathers it once.
            if gather_params_once or not explicit:
                return None
            spec = jax.typeof(leaf).sharding.spec
            dims = [i for i, entry in enumerate(spec) if entry == axis]
            return dims[0] if dims else None

        gather_dims = jax.tree.map(gather_dim, params)
        return cls(axis, mesh.shape[axis], explicit, gather_dims, unreduced)

    def param_spec(self, dim: int | None) -> P:
        return P() if dim is None else P(*[None] * dim, self.axis)


class _ShardedParams:
    """Parameters as one device sees them inside the scan, and how its
    weighted gradient contribution is reduced in each micro-batch.

    Leaves gathered once are marked varying so that ``jax.grad`` keeps each
    device's gradient (an invariant primal would make it psum the gradient
    in every micro-batch). Leaves gathered per micro-batch are all-gathered
    when the loss runs and their weighted contribution reduce-scattered back
    to the shard, so the accumulator holds only the shard.
    """

    def __init__(self, layout: _DataLayout):
        self._layout = layout

    @property
    def axis(self) -> str:
        return self._layout.axis

    def full(self, params: Any) -> Any:
        axis = self._layout.axis

        def gather(leaf: jax.Array, dim: int | None) -> jax.Array:
            if dim is not None:
                leaf = jax.lax.all_gather(leaf, axis, axis=dim, tiled=True)
            return vary_over(leaf, frozenset({axis}))

        return jax.tree.map(gather, params, self._layout.gather_dims)

    def reduce_contribution(self, grads: Any) -> Any:
        axis = self._layout.axis

        def scatter(leaf: jax.Array, dim: int | None) -> jax.Array:
            if dim is None:
                return leaf
            return jax.lax.psum_scatter(leaf, axis, scatter_dimension=dim, tiled=True)

        return jax.tree.map(scatter, grads, self._layout.gather_dims)


def _over_data_axis(local_sums, layout, params, batch, args, kwargs):
    """Runs the micro-batch scan per device over ``layout.axis`` and reduces
    the sums once after it (one fused all-reduce)."""
    dynamic, rebuild = _dynamic_leaves((args, kwargs))
    axis = layout.axis
    is_leaf = lambda x: x is None  # noqa: E731 (gather_dims holds Nones)

    def device_step(params, batch, dynamic):
        args, kwargs = rebuild(dynamic)
        shard = _ShardedParams(layout)
        acc_value, acc_grads, total, value_shape, grads_shape = local_sums(
            params, batch, args, kwargs, shard
        )
        whole = jax.tree.map(
            lambda g, dim: g if dim is None else None,
            acc_grads,
            layout.gather_dims,
            is_leaf=is_leaf,
        )
        if layout.unreduced:
            acc_value, total = jax.lax.psum((acc_value, total), axis)
        else:
            acc_value, whole, total = jax.lax.psum((acc_value, whole, total), axis)
        acc_grads = jax.tree.map(
            lambda reduced, g, dim: g if dim is not None else reduced,
            whole,
            acc_grads,
            layout.gather_dims,
            is_leaf=is_leaf,
        )
        value, grads = _weighted_means(
            acc_value, acc_grads, total, value_shape, grads_shape
        )
        if layout.unreduced:
            grads = jax.tree.map(
                lambda g, dim: (
                    g if dim is not None else jax.lax.pcast(g, axis, to="unreduced")
                ),
                grads,
                layout.gather_dims,
                is_leaf=is_leaf,
            )
        return value, grads

    def grad_spec(dim: int | None) -> P:
        if dim is None and layout.unreduced:
            return P(unreduced={axis})
        return layout.param_spec(dim)

    if layout.explicit:
        # Explicit shard_map does not reshard its inputs: gather the leaves
        # that enter the scan whole here, once per step, and split the batch
        # over the axis if it is not already.
        inputs = jax.tree.map(
            lambda p, dim: p if dim is not None else _gathered(p, axis),
            params,
            layout.gather_dims,
        )
        batch = jax.tree.map(lambda leaf: _split_over(leaf, axis), batch)
        dynamic = [_gathered(jnp.asarray(leaf), axis) for leaf in dynamic]
    else:
        inputs = params
    param_specs = jax.tree.map(layout.param_spec, layout.gather_dims, is_leaf=is_leaf)
    grad_specs = jax.tree.map(grad_spec, layout.gather_dims, is_leaf=is_leaf)
    value, grads = jax.shard_map(
        device_step,
        in_specs=(param_specs, P(axis), P()),
        out_specs=(P(), grad_specs),
        axis_names={axis},
    )(inputs, batch, dynamic)
    if layout.explicit and not layout.unreduced:
        # Gradients of parameters sharded over the axis but gathered once
        # come out replicated: give them the parameter's sharding back (a
        # local slice, no communication).
        grads = jax.tree.map(
            lambda g, p: jax.sharding.reshard(g, jax.typeof(p).sharding.spec),
            grads,
            params,
        )
    return value, grads


def _gathered(leaf: jax.Array, axis: str) -> jax.Array:
    """``leaf`` resharded to be whole along ``axis`` (other axes kept)."""
    spec = jax.typeof(leaf).sharding.spec

    def drop(entry: Any) -> Any:
        if entry == axis:
            return None
        if isinstance(entry, tuple):
            kept = tuple(name for name in entry if name != axis)
            return kept or None
        return entry

    whole = P(*map(drop, spec))
    return leaf if whole == spec else jax.sharding.reshard(leaf, whole)


def _split_over(leaf: jax.Array, axis: str) -> jax.Array:
    """``leaf`` sharded over ``axis`` along its batch (leading) axis."""
    spec = jax.typeof(leaf).sharding.spec
    if spec and spec[0] == axis:
        return leaf
    return jax.sharding.reshard(_gathered(leaf, axis), P(axis))


def _dynamic_leaves(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Splits ``tree`` into its array leaves and a function rebuilding it.

    Arrays cross the ``shard_map`` boundary (replicated); other leaves
    (Python flags, strings) are closed over, as ``jax.jit`` would see them.
    """
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

    def rebuild(dynamic: list[Any]) -> Any:
        arrays = iter(dynamic)
        merged = [
            next(arrays) if a else leaf
            for a, leaf in zip(is_array, leaves, strict=True)
        ]
        return jax.tree.unflatten(treedef, merged)

    return [leaf for a, leaf in zip(is_array, leaves, strict=True) if a], rebuild


class _MicrobatchCall:
    """``value_and_grad(params, microbatch, *args, **kwargs)`` for micro-batch i.

    If the loss takes a PRNG key, micro-batch i gets ``fold_in(key, i)``:
    independent dropout masks per micro-batch, for raw and typed keys alike.
    With a data axis (``shard``) the key is first folded with the device
    index, so that devices draw different masks for their examples.
    """

    def __init__(self, value_and_grad_fn, params, args, kwargs, key_slot, shard):
        self._fn, self._params, self._shard = value_and_grad_fn, params, shard
        self._args, self._kwargs = list(args), dict(kwargs)
        # key_slot.position counts params and batch; args start after them.
        position = None if key_slot.position is None else key_slot.position - 2
        self._key_index = self._key_name = self._key = None
        if key_slot.name is not None and key_slot.name in kwargs:
            self._key_name, self._key = key_slot.name, kwargs[key_slot.name]
        elif position is not None and position < len(args):
            self._key_index, self._key = position, args[position]
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
    shard: _ShardedParams | None = None,
) -> tuple[Any, Any, jax.Array, Any, Any]:
    """Scans the micro-batches, summing ``w_i * value_i`` and ``w_i * grads_i``.

    With ``shard``, each weighted gradient contribution goes through
    ``shard.reduce_contribution`` (a reduce-scatter for parameters gathered
    per micro-batch) before it is added. Returns the value sums, gradient
    sums, the total weight, and the shapes and dtypes of one micro-batch's
    value and gradients.
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
                lambda g: g.astype(accumulator_dtype),
                call(mb, jnp.zeros((), jnp.uint32))[1],
            )
        ),
        first_microbatch,
    )

    def accumulate(carry: Any, scanned: Any) -> Any:
        acc_value, acc_grads, total_weight = carry
        microbatch, index = scanned
        value, grads = call(microbatch, index)
        weight = weight_of(microbatch).astype(accumulator_dtype)

        def weighted(new: jax.Array) -> jax.Array:
            # A micro-batch without valid examples often has a NaN loss
            # (0 / 0); weight 0 must drop it, and 0 * NaN = NaN.
            new = new.astype(accumulator_dtype)
            return jnp.where(weight != 0, weight * new, jnp.zeros_like(new))

        acc_value = jax.tree.map(jnp.add, acc_value, jax.tree.map(weighted, value))
        contribution = jax.tree.map(weighted, grads)
        acc_grads = jax.tree.map(jnp.add, acc_grads, reduce_contribution(contribution))
        return (acc_value, acc_grads, total_weight + weight), None

    init = (
        _zeros(value_shape, accumulator_dtype),
        _zeros(acc_shape, accumulator_dtype),
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
