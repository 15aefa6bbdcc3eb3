"""Which leaves are compressed, and the tree plumbing around them.

Compression is decided per leaf from its static shape (`is_compressed`);
leaves that keep nothing in a state are a `NoResidual` there (their shape,
no array).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _checks

# Leaves with fewer elements than this are left uncompressed by default.
# Below a few hundred elements (biases, LayerNorm scales, the last layer's
# bias) compression saves < 1 KiB per leaf, while one scale shared by so few
# elements makes the quantization noise relatively largest (a bias's few
# entries often differ by orders of magnitude); every compressed leaf also
# costs a scale, a PRNG draw and, with error feedback, a residual. Such
# leaves are a negligible share of a model's bytes, so keeping them exact is
# almost free.
DEFAULT_MIN_SIZE = 256


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NoResidual:
    """A state slot that keeps no array, only its leaf's shape.

    A static pytree node: no leaves, so it costs no memory and passes
    through ``jax.jit``, ``pmap`` and checkpoints like ``optax.MaskedNode()``,
    while the shape (in the tree definition) still lets `check_updates`
    reject updates of the wrong shape at such a leaf.
    """

    shape: tuple[int, ...]


def real_leaves(tree: Any, what: str, coder: str) -> None:
    """Raises, naming the leaf and ``coder``, if any leaf of ``tree`` is
    complex.

    A ternary code is a sign and a real scale, and every codec of
    `gradaccum_jax.codecs` codes float32 inputs: a complex value has no sign
    to round to, and casting it to float32 silently drops its imaginary
    part. Every complex leaf is rejected, whatever its size: leaves below
    ``min_size`` are kept or summed in float32 too, and an error that
    appeared only once a leaf grew past ``min_size`` would be a surprise.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} has dtype "
                f"{dtype.name}: {coder} takes real floating-point "
                "leaves only (float32, bfloat16, float16, ...), since its codes "
                "are real: a complex value has no sign to round to and its "
                "imaginary part would be lost. Keep complex leaves out of it "
                "(optax.masked, optax.multi_transform) and give them an "
                "uncompressed transformation (accumulate or MultiSteps for a "
                "window, average_across_devices for a mean), or split each "
                "into its real and imaginary parts."
            )


def keeps_no_array(node: Any) -> bool:
    """Whether a state slot holds no array for its leaf (a `NoResidual`).

    ``optax.MaskedNode`` is not such a slot: it stands where ``optax.masked``
    (or ``optax.multi_transform``) left a leaf out of the params, the
    updates and so the state alike, and flattens to no leaf in each, so the
    trees still pair leaf by leaf.
    """
    return isinstance(node, NoResidual)


def slots(tree: Any) -> list[Any]:
    """A state tree's slots in order: its arrays and its `NoResidual` nodes."""
    return jax.tree.leaves(tree, is_leaf=keeps_no_array)


def with_slots(tree: Any, new: list[Any]) -> Any:
    """``tree`` with its `slots` replaced by ``new``, in order."""
    return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=keeps_no_array), new)


def check_updates(updates: Any, template: Any, caller: str, coder: str) -> None:
    """Raises, naming the leaf, if ``updates`` do not match a state template.

    ``template`` is shaped like the params: arrays, or a `NoResidual`
    recording the shape where the state keeps no array. ``coder`` names
    what codes them, for messages.
    """
    _checks.floating_leaves(updates, f"{caller}: updates")
    real_leaves(updates, f"{caller}: updates", coder)
    _checks.same_structure(
        updates,
        template,
        f"{caller}: updates",
        "the parameters the state was initialized with",
        placeholder=keeps_no_array,
    )
    leaves = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, leaf), slot in zip(leaves, slots(template), strict=True):
        if isinstance(slot, NoResidual) and np.shape(leaf) != slot.shape:
            raise ValueError(
                f"{caller}: updates leaf {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(leaf)}, but "
                "the parameters the state was initialized with have shape "
                f"{slot.shape} there."
            )


def is_compressed(leaf: Any, min_size: int) -> bool:
    """Whether a leaf is ternarized (static: from its shape only)."""
    return shape_is_compressed(np.shape(leaf), min_size)


def shape_is_compressed(shape: tuple[int, ...], min_size: int) -> bool:
    """Whether a leaf of ``shape`` is compressed: it has at least
    ``min_size`` elements, and at least one (the ``min_size`` rule of the
    ternary functions and of every codec)."""
    return int(np.prod(shape, dtype=np.int64)) >= max(min_size, 1)
