"""`diloco`: DiLoCo and Streaming DiLoCo as an optax transformation."""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax

from gradaccum_jax import _checks
from gradaccum_jax._averaging import average_across_devices
from gradaccum_jax._compression._error_feedback import keeps_a_residual
from gradaccum_jax._diloco import _fragments, _update
from gradaccum_jax._diloco._offload import check_host_memory
from gradaccum_jax._diloco._state import DiLoCoState, init_state
from gradaccum_jax._diloco._worker import WorkerConfig, worker_update


def diloco(
    inner: optax.GradientTransformation,
    sync_every: int,
    *,
    outer: optax.GradientTransformation | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    outer_reduction: optax.GradientTransformation | None = None,
    fragments: int = 1,
    fragment_axis: Any = None,
    keep_unsent: float = 0.0,
    offload_outer_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo: workers train alone and sync every ``sync_every`` steps.

    DiLoCo (Douillard et al. 2023, arXiv 2311.08105): each worker applies
    ``inner`` to its own gradients on every call, with no communication; on
    every ``sync_every``-th call the outer gradient ``anchor - params_w`` is
    averaged over the workers (weighted by the tokens each saw in the
    cycle, ``weight=``), ``outer`` steps the anchor, and every worker
    continues from it (``params + updates`` is the new anchor, up to an ulp
    of ``params``). A worker with zero cycle weight does not pull the
    anchor; a zero total leaves it. The sync runs in a loop of zero or one
    trip: a call that does not sync has no collective. Streaming DiLoCo
    (arXiv 2501.18512): ``fragments=F`` syncs F groups of leaves (about
    equal bytes) at staggered steps of the cycle, each about 1/F of the
    params; with ``fragment_axis=0`` a scanned model's leaves are cut along
    their layer axis, so each fragment is a block of layers (and ``F`` is
    bounded by the layers, not by the leaves). Workers: the devices of
    ``axis_name`` in ``pmap`` / ``shard_map``, or under ``jax.jit`` stacked
    on a leading axis sharded over the mesh axis ``axis_name``
    (`stack_workers`); see the low-communication guide.

    With a compressing ``outer_reduction`` (a codec with error feedback),
    each worker has a part of its outer gradient it did not send, which
    the codec's residual keeps for the next sync. ``keep_unsent=k`` moves
    the fraction ``k`` of it into the worker's params: the worker
    continues from the new anchor less ``k`` of its unsent outer gradient
    (the progress of its own steps it has not shared yet), and the
    residual keeps the rest. The next outer gradient is measured from the
    anchor, so it carries the part kept in the params again: nothing
    unsent is lost, and the workers no longer all start a cycle from the
    anchor (`anchor_params` is the model to evaluate). The
    low-communication guide measures what it buys.

    Example (one worker, an outer step that lands on the inner params):

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> opt = ga.diloco(optax.sgd(0.1), sync_every=2, outer=optax.sgd(1.0))
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> for _ in range(4):
    ...     updates, state = opt.update({"w": jnp.ones(3)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> [round(float(x), 4) for x in params["w"]]
    [0.6, 0.6, 0.6]

    Args:
      inner: the workers' optimizer (e.g. ``optax.adamw``, or a chain with
        clipping or `accumulate`); it gets ``weight=`` and extra arguments.
      sync_every: ``H``, inner steps between syncs (>= 1).
      outer: steps the anchor (default Nesterov SGD, lr 0.7, momentum 0.9).
      axis_name: the workers' axis (bound, or of the mesh); None: one worker.
      outer_reduction: None (weighted float32 mean) or a transformation
        averaging over ``axis_name``, e.g. ``ternary_average_across_devices(
        axis_name, seed=0)`` (its residual kept per worker). Its ``update``
        gets the extra arguments ``weight=`` (the worker's cycle weight)
        and, on stacked workers under ``jax.jit``, ``leaf_layouts=`` (each
        leaf's split over the mesh axes the workers' map makes Auto, a tuple
        of partitions per leaf, ``()`` for a whole one): a reduction of your
        own takes them as optax passes extras (``**extra_args``).
      fragments: ``F`` (1: plain DiLoCo), at most ``sync_every``; with
        whole leaves, at most the leaf count.
      fragment_axis: None: each fragment is a group of whole leaves. An
        integer ``a``: every param leaf with an axis ``a`` is cut along it
        into ``F`` contiguous blocks of rows, the first ``rows % F`` one
        row longer (8 layers in 3: 3, 3, 2), and fragment ``f`` syncs block
        ``f`` of each; leaves without that axis stay whole. A pytree
        prefix of the params with None or integers as leaves chooses per
        subtree (``{"embed": None, "layers": 0}``); whole leaves go to the
        fragments with the fewest bytes. A cut axis needs at least ``F``
        rows and must not be sharded over a mesh axis (``init`` and
        ``update`` name the leaf otherwise); each fragment's outer state is
        over its pieces (`DiLoCoState`).
      keep_unsent: in [0, 1]: the part of its unsent outer gradient a worker
        keeps in its params after a sync (0: every worker continues from
        the anchor). Above 0 it needs an ``outer_reduction`` that keeps an
        error-feedback residual, e.g. ``compressed_average_across_devices(
        axis_name, codecs.topk(0.03, bits=4))``.
      offload_outer_state: keep the anchor, the outer optimizer's states and
        the ``outer_reduction``'s states (a codec's residual) in host memory
        (memory kind ``pinned_host``), where ``init`` puts them; each
        fragment's sync brings its part to the device and puts it back.
        The values are the same bitwise; a device holds the inner state
        and at most one fragment's outer state (``fragments=F``: about 1/F
        of it, during its sync). Under ``jax.jit`` (stacked workers, one
        worker) and ``jax.shard_map``; ``jax.pmap`` returns every output in
        device memory, so there the state comes back each call. A backend
        without a host memory kind is refused here.

    Returns:
      A transformation with a `DiLoCoState`; ``update`` needs ``params``.
    """
    config, axis = _config(
        inner, sync_every, outer, axis_name, outer_reduction, fragments, fragment_axis
    )
    config = config._replace(
        keep_unsent=_keep_unsent(keep_unsent, outer_reduction),
        offload=_checks.boolean("offload_outer_state", offload_outer_state),
    )
    if config.offload:
        check_host_memory("offload_outer_state")

    def init_fn(params: Any) -> DiLoCoState:
        pieces = _fragments.assign(params, config.fragments, config.fragment_axis)
        state = init_state(
            params,
            config.inner,
            config.outer,
            config.reduction,
            pieces,
            config.offload,
        )
        if config.keep_unsent:
            _check_keeps_residual(state, config.keep_unsent)
        return state

    def update_fn(
        updates: Any,
        state: DiLoCoState,
        params: Any = None,
        *,
        weight: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, DiLoCoState]:
        _check_update(updates, state, params)
        worker_fn = functools.partial(
            worker_update, extra_args=extra_args, config=config
        )
        if axis is None or _is_bound(axis):
            _check_state(state, jax.eval_shape(init_fn, params))
            return worker_fn(updates, state, params, weight)
        layout = _update.state_layout(init_fn, params)
        _check_state(state, layout)
        return _update.run_stacked(
            worker_fn, axis, updates, state, params, weight, layout
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _config(
    inner, sync_every, outer, axis_name, outer_reduction, fragments, fragment_axis
) -> tuple[WorkerConfig, Any]:
    """``diloco``'s arguments, validated: the workers' config and their axis."""
    inner = optax.with_extra_args_support(_checks.transformation("inner", inner))
    sync_every = _checks.window_size("sync_every", sync_every)
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    outer = _checks.transformation("outer", outer)
    axis = _checks.optional_axis_name("axis_name", axis_name)
    reduction = _checks.outer_reduction(outer_reduction, axis)
    fragments = _checks.fragments(fragments, sync_every)
    fragment_axis = _checks.fragment_axis(fragment_axis)
    if axis is not None and reduction is None:
        reduction = average_across_devices(axis)
    config = WorkerConfig(
        inner, outer, reduction, sync_every, fragments, fragment_axis, axis=axis
    )
    return config, axis


def _keep_unsent(value: Any, outer_reduction: Any) -> float:
    """``keep_unsent``, checked: above 0 only with an ``outer_reduction``."""
    keep_unsent = _checks.fraction("keep_unsent", value, zero=True)
    if keep_unsent and outer_reduction is None:
        raise ValueError(
            f"`keep_unsent` {keep_unsent} needs an `outer_reduction` that keeps "
            "what each worker did not send (error feedback), such as "
            "compressed_average_across_devices('data', codecs.topk(0.03, "
            "bits=4)); the default float32 mean sends everything. Pass one, or "
            "keep_unsent=0."
        )
    return keep_unsent


def _check_keeps_residual(state: DiLoCoState, keep_unsent: float) -> None:
    """Raises unless the outer reduction's state keeps a residual (for some
    leaf of some fragment): otherwise ``keep_unsent`` would keep nothing."""
    if not any(keeps_a_residual(s) for s in state.reduction_states):
        raise ValueError(
            f"`keep_unsent` {keep_unsent} needs an `outer_reduction` that keeps "
            "an error-feedback residual per worker, got one whose state keeps "
            f"none ({type(state.reduction_states[0]).__name__}): use "
            "compressed_average_across_devices or ternary_average_across_devices "
            "with error_feedback=True and a leaf large enough to compress, or "
            "keep_unsent=0."
        )


def _check_update(updates: Any, state: DiLoCoState, params: Any) -> None:
    """Raises unless ``update`` got params, and gradients shaped like them."""
    if params is None:
        raise ValueError(
            "diloco: `update` needs `params` (the worker's current "
            "params): the outer gradient is the anchor minus them. Call "
            "opt.update(grads, state, params)."
        )
    _checks.same_structure(updates, params, "diloco: gradients", "the params")
    _checks.same_structure(params, state.anchor, "diloco: params", "the anchor")
    _checks.floating_leaves(updates, "diloco: gradient")


def _check_state(state: DiLoCoState, expected: Any) -> None:
    """Raises unless ``state`` has the leaves of ``expected`` (`init`'s)."""
    _checks.made_like(
        state,
        expected,
        "diloco: the state",
        "inner or outer optimizer, outer_reduction or number of fragments",
    )


def _is_bound(axis: Any) -> bool:
    """Whether ``axis`` is a bound mapped axis (inside pmap / shard_map)."""
    try:
        jax.lax.axis_size(axis)
    except NameError:
        return False
    return True
