"""`compressed_window_reduction`: a window's per-device terms summed by a codec.

Each device's part of the state (its residual, the codec's own state) is
a row of arrays stacked over the window's mesh axes, each residual split
like its leaf over the others: each device codes, sends and keeps its own
block (on an Auto mesh, as ``init`` saw the params split).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _checks, _placement, _reduction, _tree
from gradaccum_jax._codecs import _mean
from gradaccum_jax._codecs._average import codec_argument
from gradaccum_jax._codecs._protocol import Codec, CodecState
from gradaccum_jax._compression import _auto_splits, _blocks, _error_feedback
from gradaccum_jax._compression._leaves import (
    NoResidual,
    keeps_no_array,
    real_leaves,
    slots,
    with_slots,
)

_CALLER = "compressed_window_reduction"


def compressed_window_reduction(
    codec: Codec,
    *,
    seed: int = 0,
    error_feedback: bool = True,
    residual_dtype: Any = jnp.float32,
) -> _reduction.WindowReduction:
    """Sums a window's per-device terms over the devices with ``codec``.

    For `MultiSteps` with ``unreduced_axes`` (``window_reduction=``): at the
    emitting call each device holds its term ``S_d`` of the window's sum.
    Instead of a float32 all-reduce of the ``S_d``, ``codec`` sums them
    (`gradaccum_jax.compressed_average_across_devices` run on each device's
    term, its sum instead of its mean); leaves the codec does not compress,
    the window's weight among them, are summed exactly.

    With ``error_feedback`` each device keeps what it did not send,
    ``S_d + residual_d - sent_d``, and adds it to its next window's term:
    the state holds one residual per device, stacked on a leading axis
    sharded over ``unreduced_axes`` (and split like the param over other
    axes), so a checkpoint saves and restores it mid-window like the
    window itself. A window of zero total weight is not applied, yet its
    residuals move on: only the residuals themselves are coded then.

    A term split over another mesh axis (a tensor-parallel param's) is
    coded where it lies, each device its own block: on Explicit axes as
    its type says; on an Auto mesh as ``init`` saw the params split, when
    ``MultiSteps.init`` is given placed arrays (not under ``jax.jit``,
    whose types do not say it on Auto axes), else whole.

    Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> from jax.sharding import AxisType
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    >>> reduction = ga.compressed_window_reduction(
    ...     ga.codecs.topk(density=0.25, bits=32, min_size=1)
    ... )
    >>> opt = ga.MultiSteps(
    ...     optax.sgd(1.0), 2, unreduced_axes="data", window_reduction=reduction
    ... )
    >>> def loss_fn(w, x):
    ...     return jnp.mean(x @ w)
    >>> w, x = jnp.zeros(4), jnp.arange(32.0).reshape(8, 4)
    >>> with jax.set_mesh(mesh):
    ...     state = opt.init(w)
    ...     grad_fn = jax.jit(ga.local_value_and_grad(loss_fn))
    ...     for _ in range(2):
    ...         _, grads = grad_fn(w, x)
    ...         updates, state = jax.jit(opt.update)(grads, state, w)
    >>> updates  # each device sent its largest element; the rest waits
    Array([ -0.,  -0.,  -0., -17.], dtype=float32)

    Args:
      codec: what goes on the wire, from `gradaccum_jax.codecs`.
      seed: an integer in [0, 2**32 - 1]: the codec's random draws.
      error_feedback: keep each device's unsent part for its next window.
      residual_dtype: ``jnp.float32`` or ``jnp.bfloat16``: the residuals'
        dtype (bfloat16 halves their bytes; see
        `gradaccum_jax.compressed_average_across_devices`).

    Returns:
      A `gradaccum_jax.extend.WindowReduction` whose state is a
      `gradaccum_jax.extend.CodecState` (residuals stacked per device).
    """
    return window_reduction(
        codec, seed, error_feedback, _CALLER, residual_dtype=residual_dtype
    )


def window_reduction(
    codec: Any,
    seed: Any,
    error_feedback: Any,
    caller: str,
    coder: str | None = None,
    residual_dtype: Any = jnp.float32,
) -> _reduction.WindowReduction:
    """`compressed_window_reduction`, its messages naming ``caller`` (and
    ``coder``, what codes the leaves: the codec by default)."""
    codec = codec_argument(codec)
    seed = _checks.prng_seed("seed", seed)
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    residual_dtype = _checks.residual_dtype("residual_dtype", residual_dtype)

    def config(layout: Any) -> _mean.Reduce:
        axes = tuple(sorted(layout.axes))
        return _mean.Reduce(
            codec,
            axes[0] if len(axes) == 1 else axes,
            error_feedback,
            mean=False,
            # A codec that does not report its excess reports 0 (`CodecSum`).
            report_sq_excess=codec.reports_sq_excess,
            caller=caller,
            coder=coder,
            residual_dtype=residual_dtype,
        )

    def init_fn(params, layout):
        real_leaves(params, f"{caller}: params", coder or f"the codec {codec.name}")
        whole = _mean.state_init(config(layout), params, seed)
        leaves = jax.tree.leaves(params)
        shapes = [tuple(np.shape(leaf)) for leaf in leaves]
        parts = iter(_term_parts(layout, whole.auto_splits, leaves, shapes))
        residual = [
            slot if keeps_no_array(slot) else _per_device(slot, layout, part)
            for slot, part in zip(slots(whole.residual), parts, strict=True)
        ]
        return whole._replace(
            residual=with_slots(whole.residual, residual),
            codec=jax.tree.map(lambda leaf: _per_device(leaf, layout, ()), whole.codec),
        )

    def reduce_fn(terms, layout, state):
        return reduce_terms(config(layout), terms, layout, state)

    return _reduction.WindowReduction(init_fn, reduce_fn, place=place_state)


def place_state(state: CodecState, layout: Any, like: Any) -> CodecState:
    """``state``'s per-device parts split over the layout's axes, and each
    residual like its leaf of ``like`` (the gradients or params) over the
    others: a state restored from host arrays has lost both splits."""
    residual_slots = slots(state.residual)
    if layout.stacked:  # Auto: as `init` saw the params
        shapes = [
            slot.shape if keeps_no_array(slot) else tuple(slot.shape[1:])
            for slot in residual_slots
        ]
        parts = _term_parts(layout, state.auto_splits, residual_slots, shapes)
    else:
        like_leaves = (
            jax.tree.leaves(like)
            if like is not None and len(jax.tree.leaves(like)) == len(residual_slots)
            else [None] * len(residual_slots)
        )
        parts = [
            _blocks.WHOLE
            if keeps_no_array(slot)
            else _tree.partitions(slot)[1:]
            if leaf is None
            else _tree.partitions(leaf)[: jnp.ndim(slot) - 1]
            for slot, leaf in zip(residual_slots, like_leaves, strict=True)
        ]
    placed = [
        slot
        if keeps_no_array(slot)
        else _placement.constrained(slot, _device_spec(layout, part))
        for slot, part in zip(residual_slots, parts, strict=True)
    ]
    return state._replace(
        residual=with_slots(state.residual, placed),
        codec=jax.tree.map(
            lambda leaf: _placement.constrained(leaf, _device_spec(layout, ())),
            state.codec,
        ),
    )


def _term_parts(
    layout: Any,
    seen: _auto_splits.AutoSplits,
    leaves: list[Any],
    shapes: list[tuple[int, ...]],
) -> list[_blocks.Split]:
    """How each device's term of each leaf (one device's term of ``shapes``)
    lies over the other mesh axes.

    On Explicit axes: as the leaf's type says. Stacked terms (an Auto
    axis): as ``init`` saw the params split (``seen``), less the stacking
    axis (an FSDP leaf's terms are stacked over it whole), where the split
    fits; ``()`` (whole) for a leaf past the params' or where nothing was
    seen.
    """
    if not layout.stacked:
        return [_tree.partitions(leaf) for leaf in leaves]
    parts = []
    for i, shape in enumerate(shapes):
        split = seen.splits[i] if i < len(seen.splits) else _blocks.WHOLE
        for axis in layout.axes:
            split = tuple(_placement.without_axis(part, axis) for part in split)
        parts.append(split if _auto_splits.fits(shape, split) else _blocks.WHOLE)
    return parts


def _device_spec(layout: Any, parts: tuple[Any, ...]) -> P:
    """A per-device state leaf's spec: stacked over the layout's axes, then
    split like its leaf (``parts``) over the others."""
    axes = tuple(sorted(layout.axes))
    return P(axes[0] if len(axes) == 1 else axes, *parts)


def _per_device(leaf: Any, layout: Any, parts: tuple[Any, ...]) -> Any:
    """``leaf`` (one device's) repeated for every device, stacked and placed."""
    if keeps_no_array(leaf):
        return leaf
    stacked = jnp.broadcast_to(leaf, (layout.device_count(), *jnp.shape(leaf)))
    return _placement.constrained(stacked, _device_spec(layout, parts))


def reduce_terms(
    config: _mean.Reduce, terms: Any, layout: Any, state: CodecState
) -> tuple[Any, CodecState, jax.Array]:
    """The window's terms summed with the codec: ``(sums, state, sq_excess)``.

    ``state.residual`` holds the params' leaves, stacked per device; the
    terms may have more leaves after them (the window's weight, the
    statistics' terms), which the codec must not compress.
    """
    leaves, treedef = jax.tree.flatten(terms)
    residuals = slots(state.residual)
    stacked = layout.stacked
    term_slots = _residual_slots(config, leaves, residuals, stacked)
    param_shapes = [
        tuple(np.shape(leaf))[1:] if stacked else tuple(np.shape(leaf))
        for leaf in leaves[: len(residuals)]
    ]
    _mean.check_codec_state(config, param_shapes, state.codec)
    shapes = [tuple(np.shape(leaf))[1:] for leaf in leaves]
    parts = _term_parts(layout, state.auto_splits, leaves, shapes)
    residual_specs = [
        None if keeps_no_array(slot) else _device_spec(layout, parts[i])
        for i, slot in enumerate(term_slots)
    ]
    state_spec = _device_spec(layout, ())
    term_specs = [layout.term_spec(p) for p in parts]
    arrays = [slot for slot in term_slots if not keeps_no_array(slot)]
    array_specs = [spec for spec in residual_specs if spec is not None]

    def local(leaves, key, arrays, codec_state):
        if stacked:
            leaves = [leaf[0] for leaf in leaves]
        # Residual rows keep their leading axis (see `_error_feedback.fed_back`).
        rows = iter(arrays)
        device_slots = [
            slot if keeps_no_array(slot) else next(rows) for slot in term_slots
        ]
        codec_state = jax.tree.map(lambda leaf: leaf[0], codec_state)
        sums, new, sq_excess = _mean.reduce_with_codec(
            config,
            leaves,
            CodecState(key, device_slots, codec_state),
            None,
            parts,
        )
        new_arrays = [r for r in new.residual if not keeps_no_array(r)]
        new_codec = jax.tree.map(lambda leaf: leaf[None], new.codec)
        return sums, new.key, sq_excess, new_arrays, new_codec

    # Unchecked: JAX has no cast from unreduced terms to varying, and sums
    # from ``all_gather`` are typed varying though the same on every device.
    sums, key, sq_excess, arrays, codec_state = jax.shard_map(
        local,
        in_specs=(term_specs, P(), array_specs, state_spec),
        out_specs=(
            [P(*p) for p in parts],
            P(),
            P(),
            array_specs,
            state_spec,
        ),
        check_vma=False,
    )(
        leaves,
        state.key,
        [
            _placement.constrained(a, s)
            for a, s in zip(arrays, array_specs, strict=True)
        ],
        jax.tree.map(
            lambda leaf: _placement.constrained(leaf, state_spec), state.codec
        ),
    )
    new_arrays = iter(arrays)
    new_residuals = [
        slot if keeps_no_array(slot) else next(new_arrays) for slot in term_slots
    ][: len(residuals)]
    new_state = state._replace(
        key=key,
        residual=with_slots(state.residual, new_residuals),
        codec=codec_state,
    )
    return jax.tree.unflatten(treedef, sums), new_state, sq_excess


def _residual_slots(
    config: _mean.Reduce, leaves: list[Any], residuals: list[Any], stacked: bool
) -> list[Any]:
    """A residual slot per term leaf: the state's for the params' leaves,
    none for the leaves after them (the weight, the statistics' terms)."""
    if config.keeps_residual and len(leaves) >= len(residuals):
        _error_feedback.check_dtype(
            leaves[: len(residuals)], residuals, config.residual_dtype, config.caller
        )
    if len(leaves) < len(residuals):
        raise ValueError(
            f"{config.caller}: the window has {len(leaves)} leaves, but the state was "
            f"initialized with params of {len(residuals)}: initialize it with "
            "the params the gradients come from."
        )
    result = list(residuals)
    for i, leaf in enumerate(leaves):
        shape = tuple(np.shape(leaf))[1:] if stacked else tuple(np.shape(leaf))
        if i >= len(residuals):
            if config.keeps_residual and _mean.compresses(config.codec, shape):
                raise ValueError(
                    f"{config.caller}: the window's extra term {i - len(residuals)} "
                    f"(shape {shape}) would be compressed by {config.codec.name}, "
                    "which keeps no residual for it."
                )
            result.append(NoResidual(shape))
    return result
