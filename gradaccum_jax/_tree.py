"""Small pytree helpers shared by the transformations."""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(leaf: Any) -> frozenset[str]:
    """The ``shard_map`` mesh axes over which ``leaf`` varies (none outside).

    Accepts an array, a tracer or a ``jax.ShapeDtypeStruct``.
    """
    aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
    manual_axis_type = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    axes = getattr(manual_axis_type, "varying", None)
    if axes is None:
        axes = getattr(aval, "vma", None) or ()  # older jax releases
    return frozenset(axes)


def vary_over(leaf: jax.Array, axes: frozenset[str]) -> jax.Array:
    """Marks ``leaf`` as varying over ``axes`` too (no data moves).

    Inside ``shard_map`` (with ``check_vma``) a loop carry must keep its
    type, and a value that is the same on every device (zeros, the result of
    a psum) has another type than one each device computes for itself.
    """
    missing = tuple(sorted(axes - varying_axes(leaf)))
    if not missing:
        return leaf
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(leaf, missing, to="varying")
    return jax.lax.pvary(leaf, missing)


def any_mapped_axis_bound() -> bool:
    """Whether the code is traced under ``pmap``, ``shard_map`` or a named vmap.

    JAX has no public query for it; where its internals differ, the answer
    is True, the cautious one for the callers (they then assume that other
    devices may see other values).
    """
    try:
        from jax._src import core  # noqa: PLC0415

        return bool(core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):
        return True
