"""Stepping the inner optimizer on a closed window, in the window's own buffers.

Once a window is emitted its sum is dead, so the inner optimizer's updates
are computed in its buffers (`UpdateSlots`); the inner optimizer steps only
when the window has weight (`window_has_weight`), and gets the window's
total weight as the extra argument ``weight`` when it accepts one
(`with_weight_if_accepted`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree
from gradaccum_jax._tree import any_mapped_axis_bound, varying_axes


class UpdateSlots:
    """Where an emission computes its updates: in the window's own buffers.

    Once a window is emitted its sum is dead, and the next window resets it
    lazily (its first ``add`` sees ``reset(acc)``). So each accumulator leaf
    with the shape and dtype of the matching update leaf holds that update:
    no parameter-sized buffer is allocated for the updates, in the step that
    emits or in any other. Update leaves without such a twin (a ternary
    window, a low-precision accumulator) take the dead micro-batch gradients
    of the step, or fresh zeros.

    A window of per-device terms (unreduced over the summed axes) holds its
    updates too, where a term has the update's shape and split: the carry
    holds the term's buffers typed as an ordinary array (`_reduced_view`),
    the reduction reads them typed as terms again (`_unreduced_view`), and
    the updates come back in them. No slot is allocated beside the window's
    terms and its reduced sum.

    The emission loop's carry is then ``(updates, rest)``: the update leaves
    (some of them the window's) and the window leaves that hold no update.
    `window` puts the two back together as the accumulator.
    """

    def __init__(self, acc: Any, updates_shape: Any):
        acc_leaves, self._acc_def = jax.tree.flatten(acc)
        self._update_shapes, self._updates_def = jax.tree.flatten(updates_shape)
        same_tree = self._acc_def == self._updates_def
        # holds_update[i]: accumulator leaf i holds update leaf i, as it is;
        # viewed[i]: ... in its per-device term's buffers, retyped.
        self._holds_update = [
            same_tree and _same_layout(leaf, self._update_shapes[i])
            for i, leaf in enumerate(acc_leaves)
        ]
        self._viewed = [
            same_tree and _dead_term_fits(leaf, self._update_shapes[i])
            for i, leaf in enumerate(acc_leaves)
        ]
        self._term_axes = [set(_tree.unreduced_axes(leaf)) for leaf in acc_leaves]

    @property
    def holds_none(self) -> bool:
        """Whether no window leaf holds an update as it is (per-device terms
        may, retyped: their reduced sum is a buffer of its own)."""
        return not any(self._holds_update)

    def fits_updates(self, tree: Any) -> bool:
        """Whether ``tree``'s leaves can hold the updates, one for one."""
        leaves = jax.tree.leaves(tree)
        return len(leaves) == len(self._update_shapes) and all(
            _same_layout(leaf, shape)
            for leaf, shape in zip(leaves, self._update_shapes, strict=True)
        )

    def initial_updates(self, acc: Any, scratch: Any) -> list[jax.Array]:
        """The update buffers before the loop (their contents are never read)."""
        acc_leaves = jax.tree.leaves(acc)
        scratch_leaves = (
            jax.tree.leaves(scratch)
            if scratch is not None and jax.tree.structure(scratch) == self._updates_def
            else [None] * len(self._update_shapes)
        )
        return [
            self._initial(i, acc_leaves, scratch_leaves[i], shape)
            for i, shape in enumerate(self._update_shapes)
        ]

    def _initial(self, i, acc_leaves, scratch_leaf, shape):
        if i < len(self._holds_update) and self._holds_update[i]:
            return acc_leaves[i]
        if i < len(self._viewed) and self._viewed[i]:
            return _reduced_view(acc_leaves[i])
        return _reuse_or_zeros(scratch_leaf, shape)

    def _holds(self, i: int) -> bool:
        return self._holds_update[i] or self._viewed[i]

    def rest(self, acc: Any) -> list[Any]:
        """The accumulator leaves that hold no update."""
        return [
            leaf for i, leaf in enumerate(jax.tree.leaves(acc)) if not self._holds(i)
        ]

    def window(self, updates: list[jax.Array], rest: list[Any]) -> Any:
        """The accumulator made of its update-holding leaves and the rest."""
        return self.with_held(updates, self.terms(updates, rest))

    def terms(self, updates: list[jax.Array], rest: list[Any]) -> list[Any]:
        """The leaves the reduction reads: ``rest`` (the carry's) with the
        per-device terms held in update slots, typed as terms again."""
        rest_iter = iter(rest)
        return [
            _unreduced_view(updates[i], self._term_axes[i])
            if self._viewed[i]
            else next(rest_iter)
            for i in range(len(self._holds_update))
            if not self._holds_update[i]
        ]

    def with_held(self, updates: list[jax.Array], terms: list[Any]) -> Any:
        """The accumulator made of the leaves holding updates as they are
        and ``terms`` (`terms`' leaves, or their reduced sums) for the rest."""
        terms_iter = iter(terms)
        return self._acc_def.unflatten(
            [
                updates[i] if holds else next(terms_iter)
                for i, holds in enumerate(self._holds_update)
            ]
        )

    def updates_tree(self, updates: list[jax.Array]) -> Any:
        """The update leaves as a tree shaped like the inner optimizer's output."""
        return self._updates_def.unflatten(updates)


def with_weight_if_accepted(inner_update, *args):
    """``(inner_update, its updates' shapes)``, ``weight=`` dropped if rejected.

    ``inner_update(*args, pass_weight)`` runs the inner optimizer with the
    window weight as the extra argument ``weight`` or without it. Most
    transformations ignore extra arguments they do not use, but some reject
    them: optax's line searches (in `optax.lbfgs`) forward every extra
    argument to ``value_fn`` and raise a TypeError naming ``weight``, and a
    plain function without ``**kwargs`` raises one too. Those get no
    weight; everything else (`average_across_devices` in particular) does.
    Both are decided at trace time, by shape evaluation only.
    """
    try:
        updates_shape, _ = jax.eval_shape(inner_update, *args)
        return inner_update, updates_shape
    except TypeError as error:
        if "weight" not in str(error):
            raise
    without_weight = functools.partial(inner_update, pass_weight=False)
    updates_shape, _ = jax.eval_shape(without_weight, *args)
    return without_weight, updates_shape


def _same_layout(leaf: Any, shape: jax.ShapeDtypeStruct) -> bool:
    """Whether ``leaf``'s buffer can hold an update of ``shape``.

    The loop carry keeps the type of its initial value, so the types must
    agree too. An unreduced window leaf never holds an update as it is (an
    update is a reduced value); retyped, it may (`UpdateSlots`). Inside
    ``shard_map``, ``leaf`` must vary over no mesh axis the update does not
    vary over: an update that is the same on every device (after an
    `average_across_devices` in the inner chain) must stay typed so, or
    params updated with it could not be returned with ``out_specs=P()``.
    """
    return (
        jnp.shape(leaf),
        jnp.result_type(leaf),
        _tree.unreduced_axes(leaf),
    ) == (
        shape.shape,
        shape.dtype,
        _tree.unreduced_axes(shape),
    ) and varying_axes(leaf) <= varying_axes(shape)


def _reuse_or_zeros(leaf: Any, shape: jax.ShapeDtypeStruct) -> jax.Array:
    """``leaf`` if it has the layout of ``shape``, else zeros of that layout.

    The initial value of the loop's updates slot is never read (the loop
    either overwrites it or the result is masked to zero), so a dead buffer
    of the right layout serves, and XLA updates it in place instead of
    allocating (and page-faulting in) a fresh parameter-sized buffer.
    """
    if leaf is not None and _same_layout(leaf, shape):
        return leaf
    if leaf is not None and _dead_term_fits(leaf, shape):
        return _reduced_view(leaf)
    return _tree.zeros_like(shape)


def _dead_term_fits(leaf: Any, shape: jax.ShapeDtypeStruct) -> bool:
    """Whether ``leaf``, a dead per-device term, has ``shape``'s buffer on
    every device: its shape, dtype and partitions, unreduced over axes."""
    return (
        bool(_tree.unreduced_axes(leaf))
        and not _tree.unreduced_axes(shape)
        and (jnp.shape(leaf), jnp.result_type(leaf)) == (shape.shape, shape.dtype)
        and _placement.normalized(_tree.partitions(leaf))
        == _placement.normalized(_tree.partitions(shape))
    )


def _unreduced_view(leaf: jax.Array, axes: set[str]) -> jax.Array:
    """``leaf``'s buffers typed as per-device terms unreduced over ``axes``
    (`_reduced_view`'s inverse), no data moved."""
    parts = _tree.partitions(leaf)
    return jax.shard_map(
        lambda block: block,
        in_specs=P(*parts),
        out_specs=P(*parts, unreduced=axes),
        check_vma=False,
    )(leaf)


def _reduced_view(leaf: jax.Array) -> jax.Array:
    """``leaf``'s buffers typed as an ordinary array, no data moved: an
    identity on each device's block (their values, which nothing reads,
    differ from device to device). Unchecked: JAX has no cast from
    unreduced to varying or replicated."""
    parts = _tree.partitions(leaf)
    return jax.shard_map(
        lambda block: block,
        in_specs=P(*parts, unreduced=set(_tree.unreduced_axes(leaf))),
        out_specs=P(*parts),
        check_vma=False,
    )(leaf)


def window_has_weight(acc_weight: jax.Array) -> jax.Array:
    """Whether a closing window steps the inner optimizer, alike on all devices.

    Devices that average inside the inner optimizer must decide alike, or
    the one whose own window is empty keeps its state while the others
    apply the averaged update, and they diverge. Inside ``shard_map`` the
    weight's type says which mesh axes it varies over: the decision is
    taken on its sum over them (one scalar psum, at the emitting call).
    Where mapped axes are bound but the weight has no such type (``pmap``,
    ``shard_map(check_vma=False)``), nothing tells which axes the devices
    share: every closing window steps (the empty one with a zero gradient,
    which is the right thing when the inner optimizer averages). Without
    mapped axes the window's own weight decides. ``!= 0`` rather than
    ``> 0``: a NaN weight (a negative one under jit) must step, so that the
    update comes out NaN, loudly wrong, instead of silently skipped.
    """
    axes = tuple(sorted(varying_axes(acc_weight)))
    if axes:
        return jax.lax.psum(acc_weight, axes) != 0
    if any_mapped_axis_bound():
        return jnp.asarray(True)
    return acc_weight != 0


def window_gradient(
    window_sum: Any, weight: jax.Array, grads_like: Any, use_grad_mean: bool
) -> Any:
    """The window's weighted mean (or sum), in the gradients' dtypes."""
    if use_grad_mean:
        # A window of zero total weight emits zeros rather than 0/0.
        has_weight = weight > 0
        inverse = jnp.where(has_weight, 1.0, 0.0) / jnp.where(has_weight, weight, 1.0)
        window_sum = jax.tree.map(lambda t: t * inverse.astype(t.dtype), window_sum)
    return optax.tree.cast_like(window_sum, grads_like)


def keep_dtypes(new_state: Any, old_state: Any) -> Any:
    """``new_state`` in ``old_state``'s dtypes.

    A loop carry must keep its dtypes; optax.MultiSteps casts the same way
    (some optimizers promote their state on update). A leaf of an extended
    dtype (a typed PRNG key, as in ``optax.noisy_sgd(key=jax.random.key(0))``)
    is kept as it is: no arithmetic promotes a key, and a concrete key array
    has no ``astype`` (it raises NotImplementedError), so casting it would
    break every eager call while the traced one passes.
    """

    def cast(new: Any, old: Any) -> Any:
        dtype = jnp.result_type(old)
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            return new
        return jnp.asarray(new).astype(dtype)

    return jax.tree.map(cast, new_state, old_state)


def ordered_after(weight: jax.Array, tree: Any) -> jax.Array:
    """``weight`` again, computed from every leaf of ``tree``.

    Dividing the window by a weight that depends on the statistics' results
    orders the update after their reads of the window's buffers, so XLA
    overwrites them in place with the update. Without that data dependency
    the two are unordered and XLA copies the window (a parameter-sized
    temporary, measured on XLA:CPU; an optimization barrier does not survive
    its passes). One element of each leaf is read, so a statistic whose
    result is any of its leaves is ordered. ``x < -inf`` never holds (NaN
    compares false): the factor is 1. (``|x| < 0`` would not do: XLA
    knows that it is false and drops the dependency, measured.)
    """
    firsts = [
        jnp.ravel(leaf)[0].astype(jnp.float32)
        for leaf in jax.tree.leaves(tree)
        if jnp.size(leaf)
    ]
    if not firsts:
        return weight
    return weight * jnp.where(sum(firsts) < -jnp.inf, 0.5, 1.0)
