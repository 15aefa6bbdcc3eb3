"""`diloco`: DiLoCo and Streaming DiLoCo as an optax transformation."""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax

from gradaccum_jax import _checks
from gradaccum_jax._averaging import average_across_devices
from gradaccum_jax._diloco import _fragments, _stacked
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
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo: workers train alone and sync every ``sync_every`` steps.

    DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
    Training of Language Models", arXiv 2311.08105). Each worker applies
    ``inner`` to its own gradients on every call, with no communication.
    On every ``sync_every``-th call the *outer gradient* ``anchor -
    params_w`` (where the worker's inner steps took it since the last sync)
    is averaged over the workers, ``outer`` steps the anchor with it, and
    every worker continues from the new anchor: the returned updates take
    the worker's params to it (``params + updates == new anchor``, up to
    rounding: ``p + (a - p)`` is not always ``a`` where ``a`` is much
    smaller than ``p``, and a worker may then start the cycle an ulp off
    the anchor there, by an ulp of ``p`` (on 4% of the elements after a
    4-step Adam cycle in the tests). The anchor itself is bitwise the same on
    every worker). The other
    calls' updates are the inner step's.

    The workers are the devices of ``axis_name``, on three layouts:

    * inside ``jax.pmap`` or ``jax.shard_map`` with ``axis_name`` bound:
      each device is a worker and holds its own params and state;
    * under ``jax.jit`` over a mesh (``jax.set_mesh``) with an axis
      ``axis_name``: the workers' params, gradients and states are stacked
      on a leading axis of that axis' size, sharded over it (MaxText's
      layout). `stack_workers` builds them, `worker_value_and_grad` takes
      each worker's gradient on its shard of a global batch, and
      `anchor_params` gives the model to evaluate. ``weight=`` is then
      None, a scalar, or one per worker (shape ``(n,)``). Params may be
      sharded over other mesh axes (tensor parallelism over ``model``),
      not over the workers' axis: each worker holds whole params.
    * ``axis_name=None``: a single worker (no communication at all).

    Which one is decided when ``update`` is traced. The sync runs inside a
    loop of zero or one trip (`_control.run_if`), so a call that does not
    sync has no collective and updates the anchor and outer state in
    place; the sync is one all-reduce of the params' float32 bytes (plus a
    scalar).

    **Streaming DiLoCo** (Douillard et al. 2025, arXiv 2501.18512):
    ``fragments=F`` splits the param leaves into ``F`` groups of about equal
    bytes (deterministically, from their shapes and dtypes); fragment ``f``
    syncs on the call completing step ``(f + 1) * sync_every // F`` of each
    cycle, so each sync moves about ``1 / F`` of the params. Each fragment
    has its own outer optimizer state and cycle weight.

    **Weights.** ``update(grads, state, params, weight=w)``, ``w`` the
    number of tokens (or examples) behind this call's gradient: a worker's
    weights are summed over the cycle, and the outer gradient is the mean
    over workers weighted by those sums. A worker with zero cycle weight
    does not pull the anchor (NaN params included) and still continues
    from the new anchor; a zero total leaves the anchor (and the outer
    momentum) where it is. A call with ``w == 0`` moves nothing and leaves
    the inner state as it is (its gradients may be NaN). ``weight=`` and
    other extra arguments are passed on to ``inner``.

    **Outer reduction.** By default the outer gradients are averaged in
    float32 by `average_across_devices`. ``outer_reduction`` replaces it
    with any transformation that averages over the workers' axis and reads
    ``weight=``, e.g. ``ternary_average_across_devices(axis_name, seed=0)``
    (ternary codes on the wire, about 1/7 of the bytes on 8 workers, its
    error-feedback residual kept per worker in the state). Give it the
    same axis name as ``axis_name``; it works unchanged on all three
    layouts.

    Example (one worker, an outer step that lands on the inner params):

    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> opt = ga.diloco(optax.sgd(0.1), sync_every=2, outer=optax.sgd(1.0))
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> for _ in range(4):
    ...     grads = {"w": jnp.ones(3)}
    ...     updates, state = opt.update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> [round(float(x), 4) for x in params["w"]]
    [0.6, 0.6, 0.6]
    >>> int(state.cycle_step)
    0

    Data-parallel over 8 devices with ``jax.pmap``::

      opt = ga.diloco(optax.adamw(1e-3), sync_every=100, axis_name="data")
      state = jax.pmap(opt.init)(replicated_params)

      @functools.partial(jax.pmap, axis_name="data")
      def step(params, state, batch):
          grads = jax.grad(loss_fn)(params, batch)
          updates, state = opt.update(grads, state, params)
          return optax.apply_updates(params, updates), state

    Args:
      inner: the workers' optimizer, e.g. ``optax.adamw(...)``, or a chain
        with clipping or `accumulate`.
      sync_every: ``H``, the number of inner steps between syncs (>= 1).
      outer: the outer optimizer, stepping the anchor with the averaged
        outer gradient. Default: Nesterov SGD with learning rate 0.7 and
        momentum 0.9, as in the paper.
      axis_name: the workers' axis: a ``pmap``/``shard_map`` axis, or an
        axis of the current mesh for the stacked layout; None for a single
        worker.
      outer_reduction: None (weighted float32 mean) or a transformation
        averaging over ``axis_name`` (see above).
      fragments: ``F``, the number of fragments synced at staggered steps
        (1: plain DiLoCo); at most ``sync_every`` and the number of param
        leaves.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a `DiLoCoState`.
      ``update`` needs ``params``.

    Raises:
      ValueError: at construction for a bad argument; at ``init`` if
        ``fragments`` exceeds the number of param leaves; at trace time if
        ``params`` is None or, under ``jax.jit``, ``axis_name`` is neither
        bound nor an axis of the current mesh.
    """
    inner = optax.with_extra_args_support(_checks.transformation("inner", inner))
    sync_every = _checks.window_size("sync_every", sync_every)
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    outer = _checks.transformation("outer", outer)
    axis = _checks.optional_axis_name("axis_name", axis_name)
    reduction = _checks.outer_reduction(outer_reduction, axis)
    fragments = _checks.fragments(fragments, sync_every)
    if axis is not None and reduction is None:
        reduction = average_across_devices(axis)
    config = WorkerConfig(inner, outer, reduction, sync_every, fragments)

    def init_fn(params: Any) -> DiLoCoState:
        groups = _fragments.assign(jax.tree.leaves(params), fragments)
        return init_state(params, inner, outer, reduction, groups)

    def update_fn(
        updates: Any,
        state: DiLoCoState,
        params: Any = None,
        *,
        weight: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, DiLoCoState]:
        if params is None:
            raise ValueError(
                "diloco: `update` needs `params` (the worker's current "
                "params): the outer gradient is the anchor minus them. Call "
                "opt.update(grads, state, params)."
            )
        _checks.same_structure(updates, params, "diloco: gradients", "the params")
        _checks.same_structure(params, state.anchor, "diloco: params", "the anchor")
        _checks.floating_leaves(updates, "diloco: gradient")
        worker_fn = functools.partial(
            worker_update, extra_args=extra_args, config=config
        )
        if axis is None or _is_bound(axis):
            return worker_fn(updates, state, params, weight)
        return _stacked.run_stacked(worker_fn, axis, updates, state, params, weight)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_bound(axis: Any) -> bool:
    """Whether ``axis`` is a bound mapped axis (inside pmap / shard_map)."""
    try:
        jax.lax.axis_size(axis)
    except NameError:
        return False
    return True
