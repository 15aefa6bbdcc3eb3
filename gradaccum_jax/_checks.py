"""Argument and input validation shared by every transformation.

Configuration errors are raised at construction as ``ValueError`` naming the
argument and the accepted range. Input errors are raised at trace time and
name the offending pytree leaf by its path (``jax.tree_util.keystr``), so a
user never has to decode a shape error from deep inside XLA.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def positive_int(name: str, value: Any) -> int:
    """Returns ``value`` as an int, or raises if it is not an integer >= 1."""
    return _integer_at_least(name, value, 1)


# Window sizes and step counters are int32 arrays inside the state.
_MAX_INT32 = 2**31 - 1


def window_size(name: str, value: Any) -> int:
    """Returns ``value`` as an int, or raises unless it is in [1, 2**31 - 1]."""
    value = _integer_at_least(name, value, 1)
    if value > _MAX_INT32:
        raise ValueError(
            f"`{name}` must be an integer in [1, {_MAX_INT32}] (2**31 - 1): the "
            f"window's counters are int32, got {value}."
        )
    return value


def nonnegative_int(name: str, value: Any) -> int:
    """Returns ``value`` as an int, or raises if it is not an integer >= 0."""
    return _integer_at_least(name, value, 0)


def _integer_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}, got {value!r} "
            f"of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value}.")
    return int(value)


def positive_finite(name: str, value: Any) -> Any:
    """Returns ``value`` as a float, or raises if it is not finite and > 0.

    A traced scalar (a hyperparameter under ``optax.inject_hyperparams``
    inside ``jax.jit``) has no value to check at construction and is
    returned as it is: the check covers what is concrete.
    """
    if isinstance(value, jax.core.Tracer):
        if np.ndim(value) != 0:
            raise ValueError(
                f"`{name}` must be a positive finite scalar, got a traced array "
                f"of shape {np.shape(value)}."
            )
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, jax.Array | np.ndarray) and np.ndim(value) == 0:
            value = float(value)
        else:
            raise ValueError(
                f"`{name}` must be a positive finite number, got {value!r} "
                f"of type {type(value).__name__}."
            )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number, got {value}.")
    return float(value)


def decay_rate(name: str, value: Any) -> float:
    """Returns ``value`` as a float, or raises unless it is in [0, 1)."""
    return _real_in(name, value, "[0, 1)", lambda v: 0 <= v < 1)


def fraction(name: str, value: Any, *, zero: bool = False) -> float:
    """Returns ``value`` as a float, or raises unless it is in (0, 1] (in
    [0, 1] with ``zero``)."""
    if zero:
        return _real_in(name, value, "[0, 1]", lambda v: 0 <= v <= 1)
    return _real_in(name, value, "(0, 1]", lambda v: 0 < v <= 1)


def _real_in(name: str, value: Any, accepted: str, test: Callable) -> float:
    """``value`` as a float if it is a real number that passes ``test``
    (NaN passes none), else a ValueError naming ``accepted``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"`{name}` must be a number in {accepted}, got {value!r} "
            f"of type {type(value).__name__}."
        )
    if not test(float(value)):
        raise ValueError(f"`{name}` must be a number in {accepted}, got {value}.")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """Returns ``value``, or raises if it is not a bool (``"False"`` is truthy)."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(
            f"`{name}` must be a bool (True or False), got {value!r} "
            f"of type {type(value).__name__}."
        )
    return bool(value)


def one_of(name: str, value: Any, accepted: tuple[str, ...]) -> str:
    """Returns ``value``, or raises if it is not one of the ``accepted`` strings."""
    if not isinstance(value, str) or value not in accepted:
        names = ", ".join(repr(option) for option in accepted)
        raise ValueError(f"`{name}` must be one of {names}, got {value!r}.")
    return value


def integer_in(name: str, value: Any, accepted: tuple[int, ...]) -> int:
    """Returns ``value`` as an int, or raises if it is not one of ``accepted``
    (a float such as ``8.0``, a string or a bool is refused)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value not in accepted
    ):
        *rest, last = (str(option) for option in accepted)
        options = f"{', '.join(rest)} or {last}" if rest else last
        raise ValueError(f"`{name}` must be {options}, got {value!r}.")
    return int(value)


# jax.random.key keeps 32 bits of a seed unless jax_enable_x64 is set: 2**32
# would silently give seed 0's key, and 2**64 overflows.
_MAX_SEED = 2**32 - 1


def prng_seed(name: str, value: Any) -> int:
    """Returns ``value`` as an int, or raises if it is not in [0, 2**32 - 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`{name}` must be an integer in [0, {_MAX_SEED}] (2**32 - 1), got "
            f"{value!r} of type {type(value).__name__}."
        )
    if not 0 <= int(value) <= _MAX_SEED:
        raise ValueError(
            f"`{name}` must be an integer in [0, {_MAX_SEED}] (2**32 - 1): "
            f"jax.random.key keeps only 32 bits of a seed, got {value}."
        )
    return int(value)


def residual_dtype(name: str, dtype: Any) -> jnp.dtype:
    """Returns ``dtype`` as float32 or bfloat16, or raises for anything else:
    an error-feedback residual needs float32's range, which float16 lacks
    (a residual of large gradients would overflow to infinity)."""
    canonical = float_dtype(name, dtype)
    if canonical not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"`{name}` must be jnp.float32 or jnp.bfloat16, got {canonical.name}."
        )
    return canonical


def float_dtype(name: str, dtype: Any) -> jnp.dtype:
    """Returns the canonical floating dtype, or raises for anything else."""
    if dtype is None:
        # jnp.dtype(None) is float64 (float32 without x64): optax reads
        # dtype=None as "the params' dtype", so None must not pass silently.
        raise ValueError(
            f"`{name}` must be a floating dtype such as jnp.float32, got None."
        )
    try:
        canonical = jnp.dtype(dtype)
    except TypeError as error:
        raise ValueError(
            f"`{name}` must be a floating dtype such as jnp.float32, got {dtype!r}."
        ) from error
    if not jnp.issubdtype(canonical, jnp.floating):
        raise ValueError(
            f"`{name}` must be a floating dtype such as jnp.float32, "
            f"got {canonical.name}."
        )
    return jax.dtypes.canonicalize_dtype(canonical)


def axis_name(name: str, value: Any) -> Any:
    """Returns a mapped-axis name, or raises if it cannot name an axis."""
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(v, str) and v for v in value)
    ):
        return value
    raise ValueError(
        f"`{name}` must be a non-empty string naming a pmap/shard_map axis "
        f"(or a tuple of such names), got {value!r}."
    )


def axis_names(name: str, value: Any) -> frozenset[str]:
    """Returns a set of mesh-axis names from a string or a sequence of them."""
    names = (value,) if isinstance(value, str) else value
    if (
        isinstance(names, tuple | list | set | frozenset)
        and all(isinstance(v, str) and v for v in names)
        and len(set(names)) == len(tuple(names))
    ):
        return frozenset(names)
    raise ValueError(
        f"`{name}` must be a mesh-axis name or a sequence of distinct "
        f"non-empty mesh-axis names (e.g. ('data',)), or () for none, got "
        f"{value!r}."
    )


def bound_axis_size(axis: Any, caller: str) -> int:
    """Returns the size of a mapped axis, or explains how to bind it."""
    try:
        return jax.lax.axis_size(axis)
    except NameError as error:
        raise NameError(
            f"{caller}: axis name {axis!r} is not bound. Call it inside "
            f"`jax.pmap(..., axis_name={axis!r})` or "
            f"`jax.shard_map(..., mesh=Mesh(..., axis_names=({axis!r},)))`; "
            "under plain `jax.jit` with sharded arrays the mean over devices "
            "is already implicit and no averaging transformation is needed."
        ) from error


def same_structure(
    tree: Any,
    reference: Any,
    what: str,
    reference_name: str,
    *,
    placeholder: Callable[[Any], bool] | None = None,
) -> None:
    """Raises if ``tree`` and ``reference`` differ in structure or leaf shapes.

    The message names the first leaf whose path or shape differs. Leaves of
    ``reference`` for which ``placeholder`` is true (e.g. a ``NoResidual``
    where a state keeps nothing) match a leaf of any shape.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    ref_leaves = jax.tree_util.tree_flatten_with_path(reference, is_leaf=placeholder)[0]
    difference = _path_difference(leaves, ref_leaves)
    if difference:
        missing, extra = difference
        raise ValueError(
            f"{what} do not have the structure of {reference_name}: "
            f"missing leaves {missing or 'none'}, unexpected leaves "
            f"{extra or 'none'}. Expected structure "
            f"{jax.tree.structure(reference, is_leaf=placeholder)}, got "
            f"{jax.tree.structure(tree)}."
        )
    for (path, leaf), (_, ref_leaf) in zip(leaves, ref_leaves, strict=True):
        if placeholder is not None and placeholder(ref_leaf):
            continue
        if np.shape(leaf) != np.shape(ref_leaf):
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(leaf)}, but {reference_name} has shape "
                f"{np.shape(ref_leaf)} there."
            )


def made_like(state: Any, expected: Any, what: str, made_with: str) -> None:
    """Raises unless ``state`` has the leaves (key paths) of ``expected``,
    what ``init`` makes for these params (abstract values will do).

    A state made with another configuration (``made_with`` names what may
    differ), or restored from such a run, would otherwise fail deep inside
    the update or be read as something else. Only the leaves are compared:
    static nodes (a split recorded on an Auto mesh) may differ between an
    eager ``init`` and this abstract one.
    """
    difference = _path_difference(
        jax.tree_util.tree_flatten_with_path(state)[0],
        jax.tree_util.tree_flatten_with_path(expected)[0],
    )
    if difference:
        missing, unexpected = difference
        raise ValueError(
            f"{what} does not have the leaves this transformation's init makes "
            f"for these params (missing {missing[:4] or 'none'}, unexpected "
            f"{unexpected[:4] or 'none'}): it was made with another {made_with}. "
            "Initialize it with this transformation's init (and restore a "
            "checkpoint into that target)."
        )


def _path_difference(
    leaves: list[tuple[Any, Any]], reference: list[tuple[Any, Any]]
) -> tuple[list[str], list[str]] | None:
    """``(missing, unexpected)`` key paths of flattened ``leaves`` against
    flattened ``reference`` (``tree_flatten_with_path``'s), sorted; None
    where the paths are the same, in the same order."""
    paths = [jax.tree_util.keystr(path) for path, _ in leaves]
    ref_paths = [jax.tree_util.keystr(path) for path, _ in reference]
    if paths == ref_paths:
        return None
    return sorted(set(ref_paths) - set(paths)), sorted(set(paths) - set(ref_paths))


def gradients_as_terms(grads: Any, params: Any, layout: Any) -> None:
    """Raises unless ``grads`` are gradients of ``params`` in ``layout``'s form.

    ``layout`` is the window's `TermsLayout`; ``params`` may be None. Whole
    gradients where per-device terms are due (``jax.grad``'s, given to an
    accumulator built with ``unreduced_axes``) are the likely mistake on
    that path: they get their own error, before the shapes are compared
    (stacked terms against the params' shapes would not say why).
    """
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    param_leaves: list[Any] = [None] * len(leaves)
    if params is not None and jax.tree.structure(params) == jax.tree.structure(grads):
        param_leaves = jax.tree.leaves(params)
    for (path, grad), param in zip(leaves, param_leaves, strict=True):
        if layout.arrives_whole(grad, param):
            raise whole_gradient_error(jax.tree_util.keystr(path), layout.axes)
    if params is not None:
        terms = jax.tree.map(layout.arrival_shape, params)
        same_structure(grads, terms, "gradients", "params")


def whole_gradient_error(path: str, axes: frozenset[str]) -> ValueError:
    """The error for a whole gradient leaf where per-device terms are due."""
    names = sorted(axes)
    spelled = repr(names[0]) if len(names) == 1 else repr(tuple(names))
    local = (
        f"gradaccum_jax.local_value_and_grad(loss_fn, {spelled})"
        if len(names) == 1
        else f"gradaccum_jax.local_value_and_grad (over {names})"
    )
    return ValueError(
        f"Gradient leaf {path} came whole (summed over the devices, as "
        f"jax.grad returns it), but the accumulator was built with "
        f"unreduced_axes={spelled} and keeps one term per device. Take the "
        f"gradients with {local} instead: each device's own term, reduced "
        "once per window. Or, to keep jax.grad, build the accumulator without "
        "unreduced_axes (unreduced_axes=(), the default) and init it again: "
        "XLA then all-reduces every micro-batch's gradient."
    )


def floating_leaves(tree: Any, what: str) -> None:
    """Raises if any leaf of ``tree`` is not a floating-point array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} has dtype "
                f"{dtype.name}; gradients must be floating point "
                "(float32, bfloat16, float16, ...). Integer parameters have no "
                "gradient: mask them out of the optimizer (optax.masked) or "
                "cast the gradient first."
            )


def transformation(name: str, value: Any) -> Any:
    """Returns ``value``, or raises unless it has callable init and update."""
    if not (
        callable(getattr(value, "init", None))
        and callable(getattr(value, "update", None))
    ):
        raise ValueError(
            f"`{name}` must be an optax.GradientTransformation such as "
            f"optax.adam(1e-3) (not the factory optax.adam), got {value!r}."
        )
    return value


def optional_callable(name: str, value: Any, signature: str) -> Any:
    """Returns ``value``, or raises unless it is None or callable."""
    if value is not None and not callable(value):
        raise ValueError(
            f"`{name}` must be None or a callable {signature}, got {value!r}."
        )
    return value


def fragments(value: Any, sync_every: int) -> int:
    """Returns ``value`` as an int, or raises unless it is in [1, sync_every].

    Each fragment of Streaming DiLoCo syncs at its own step of the
    ``sync_every``-step cycle, so there can be no more fragments than steps.
    (Whether there are enough parameter leaves is checked at ``init``.)
    """
    value = _integer_at_least("fragments", value, 1)
    if value > sync_every:
        raise ValueError(
            f"`fragments` must be an integer in [1, sync_every] = [1, "
            f"{sync_every}]: each fragment syncs at its own step of the "
            f"cycle, got {value}."
        )
    return value


def fragments_fit(value: int, num_leaves: int) -> None:
    """Raises unless ``value`` fragments can each hold one of ``num_leaves``."""
    if value > num_leaves:
        raise ValueError(
            f"`fragments` must be an integer in [1, number of parameter leaves] "
            f"= [1, {num_leaves}]: a fragment is a group of whole leaves, got "
            f"{value}. To split scanned leaves along their layer axis, pass "
            "fragment_axis=0."
        )


def fragment_axis(value: Any) -> Any:
    """Returns ``value``, or raises unless it is None, an integer >= 0, or a
    pytree (a prefix of the params, checked at ``init``) whose leaves are
    None or integers >= 0."""
    entries = jax.tree.leaves(value, is_leaf=lambda node: node is None)
    valid = all(
        entry is None
        or (
            isinstance(entry, numbers.Integral)
            and not isinstance(entry, bool)
            and int(entry) >= 0
        )
        for entry in entries
    )
    if not valid:
        raise ValueError(
            "`fragment_axis` must be None (fragments of whole leaves), an "
            "integer >= 0 (the axis each param leaf is split along: 0 for "
            "the layer axis of scanned layers), or a pytree prefix of the "
            "params with None or such integers as leaves (e.g. {'embed': None, "
            f"'layers': 0}}), got {value!r}."
        )
    return value


def outer_reduction(value: Any, axis: Any) -> Any:
    """Returns ``value``, or raises unless it is None or a transformation.

    A reduction averages over workers, so it needs workers: an
    ``axis_name``.
    """
    if value is None:
        return None
    if not (
        callable(getattr(value, "init", None))
        and callable(getattr(value, "update", None))
    ):
        raise ValueError(
            "`outer_reduction` must be None (a weighted float32 mean) or an "
            "optax.GradientTransformation that averages over the workers' axis, "
            "such as ternary_average_across_devices('data', seed=0), or "
            "compressed_average_across_devices('data', codec) for a codec of "
            f"gradaccum_jax.codecs, got {value!r}."
        )
    if axis is None:
        raise ValueError(
            "`outer_reduction` must be None when `axis_name` is None: with a "
            "single worker there is nothing to average. Pass the workers' "
            "axis as `axis_name` too."
        )
    return value


def optional_axis_name(name: str, value: Any) -> Any:
    """Returns None or a mapped-axis name (see `axis_name`)."""
    return None if value is None else axis_name(name, value)
