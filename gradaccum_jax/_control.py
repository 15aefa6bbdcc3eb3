"""Control flow that keeps large buffers in place."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

from gradaccum_jax._tree import vary_over, varying_axes

Carry = TypeVar("Carry")


def run_if(pred: jax.Array, fn: Callable[[Carry], Carry], carry: Carry) -> Carry:
    """Returns ``fn(carry)`` if ``pred`` else ``carry``, updating buffers in place.

    Semantically ``lax.cond(pred, fn, lambda c: c, carry)``. It is written as
    a ``lax.while_loop`` that runs zero or one time because XLA aliases a
    while loop's carry with its result, whereas ``lax.cond`` on XLA:CPU
    copies every buffer it passes through (the parameters and optimizer
    moments, several times the model's size) even on the branch that does
    nothing. Praxis made the same substitution for the same reason. ``fn``
    must return a carry of the same structure, shapes and dtypes.

    Inside ``shard_map`` a carry leaf and ``fn``'s result for it may differ
    in the mesh axes they vary over (zeros or a psum result are the same on
    every device, a gradient is not); both are marked as varying over the
    union, which moves no data.

    Under differentiation (``jax.jvp``, ``jax.grad``, meta-gradients through
    an unrolled training loop) it behaves as ``lax.cond``: a while loop has
    no reverse-mode derivative, a cond has one (see `_run_if_jvp`).

    Called eagerly (no tracer in ``pred`` or ``carry``: an optax-style loop
    without ``jax.jit``) it is a Python ``if``: there are no buffers to keep
    in place there, and a while loop would be traced and compiled anew on
    every call (its body closes over fresh arrays), about a quarter of a
    second each time on CPU.
    """
    if not any(
        isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((pred, carry))
    ):
        return fn(carry) if bool(pred) else carry
    axes = jax.tree.map(
        lambda before, after: varying_axes(before) | varying_axes(after),
        carry,
        jax.eval_shape(fn, carry),
    )
    carry = jax.tree.map(vary_over, carry, axes)

    def varied_fn(inner: Carry) -> Carry:
        return jax.tree.map(vary_over, fn(inner), axes)

    # The closed-over values ``fn`` reads (params, a learning rate) become
    # explicit operands: a custom_jvp rule cannot differentiate with respect
    # to values it does not see.
    converted_fn, consts = jax.closure_convert(varied_fn, carry)
    return _run_if(converted_fn, pred, carry, consts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _run_if(fn, pred, carry, consts):
    def body(loop_carry):
        trips, count, inner = loop_carry
        # XLA hoists loop-invariant code out of while loops, and work that
        # reads only values the loop passes through unchanged (a window a
        # nested loop reads, the closed-over params) is invariant: hoisted,
        # it would run even when the loop runs zero times, into a temporary
        # copied into the carry afterwards. Tied to the trip count through a
        # barrier, everything the body reads varies, and nothing is hoisted.
        inner, consts_ = jax.tree.map(
            functools.partial(_tie_to, count), (inner, consts)
        )
        return trips - 1, count + 1, fn(inner, *consts_)

    trips = jnp.asarray(pred, jnp.int32)
    count = jnp.zeros([], jnp.int32)
    _, _, carry = jax.lax.while_loop(
        lambda loop_carry: loop_carry[0] > 0, body, (trips, count, carry)
    )
    return carry


def _tie_to(count: jax.Array, leaf: jax.Array) -> jax.Array:
    """``leaf``, made to depend on ``count`` for XLA (an optimization barrier).

    ``count`` is cast to the mesh axes ``leaf`` varies over, so that inside
    ``shard_map`` the barrier leaves ``leaf``'s type as it is. (The trip
    count itself may vary over axes the leaf does not.)
    """
    _, leaf = jax.lax.optimization_barrier((vary_over(count, varying_axes(leaf)), leaf))
    return leaf


@_run_if.defjvp
def _run_if_jvp(fn, primals, tangents):
    """Differentiates as ``lax.cond``: JAX cannot transpose a while loop.

    The rule only runs under differentiation (jvp, grad, vjp), so the
    buffer copies of ``lax.cond`` are paid there only; JAX linearizes and
    transposes ``lax.cond``, and its backward pass runs the taken branch
    only, so a branch that was not taken cannot put a NaN (0 * inf from
    ``sqrt`` at 0, say) into the gradient. The predicate is not
    differentiable and its tangent is ignored.
    """
    pred, carry, consts = primals
    _, carry_dot, consts_dot = tangents

    def as_cond(carry, consts):
        return jax.lax.cond(pred, lambda c: fn(c, *consts), lambda c: c, carry)

    return jax.jvp(as_cond, (carry, consts), (carry_dot, consts_dot))
