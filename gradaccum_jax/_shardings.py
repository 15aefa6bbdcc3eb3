"""The shardings of a transformation's state, from the params' shardings.

A program that declares its shardings (``jax.jit(step, in_shardings=...,
out_shardings=...)``, flax's logical partitioning) needs them for the
optimizer state too. Deriving them from the params' annotations, as flax's
``nn.get_sharding`` does from the boxes ``tx.init`` hands on, is right for
optax's leaves (shaped like their params) and wrong for a state laid out
otherwise: per-device window terms are rows, one block per device, and a
param's ``P(None, "fsdp")`` on them reshards the window on every call.

`state_shardings` asks the transformation itself: it traces ``tx.init`` on
abstract params carrying their shardings, on an Explicit twin of the mesh
(the same devices and names, every axis Explicit), where every leaf's type
says how it is split. A state has the same shapes on either kind of mesh,
so the specs read there hold on the user's mesh as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree


def state_shardings(tx: Any, params: Any, mesh: Any = None) -> Any:
    """The shardings of ``tx.init(params)``: what jit's ``in_shardings`` and
    ``out_shardings`` declare for the optimizer state.

    Works for any optax transformation (ours alone or inside
    ``optax.chain``), on Explicit and Auto meshes alike: a leaf shaped
    like a param is split like it, a window's per-device terms one block
    of rows per device of the summed axes (split like their param over the
    other axes), a counter replicated.

    Args:
      tx: an ``optax.GradientTransformation`` (anything with ``init``).
      params: the params, or their stand-ins: arrays placed on the mesh,
        ``jax.ShapeDtypeStruct``s with shardings, flax linen's partitioning
        boxes (``nn.LogicallyPartitioned``, mapped to mesh axes by their
        rules or the active ``nn.logical_axis_rules``; ``nn.Partitioned``)
        or nnx ``Variable``s with sharding metadata (``sharding_names``).
        A leaf with no sharding counts as replicated.
      mesh: the mesh; by default the current one (``jax.set_mesh``).

    Returns:
      A tree of ``jax.sharding.NamedSharding``s on ``mesh``, structured like
      ``tx.init`` of the params unboxed (plain arrays, as flax's
      ``nn.unbox`` leaves them).

    Raises:
      ValueError: without a mesh, naming the argument.

    Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import AxisType
    >>> import gradaccum_jax as ga
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    >>> params = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
    >>> tx = ga.MultiSteps(optax.adam(1e-3), 4, unreduced_axes="data")
    >>> with jax.set_mesh(mesh):
    ...     shardings = ga.state_shardings(tx, params)
    >>> shardings.acc_grads["w"].spec  # 8 terms of (16, 4): a block each
    P('data', None)
    >>> shardings.inner_opt_state[0].mu["w"].spec  # adam's: like the param
    P(None, None)
    """
    mesh = _concrete_mesh(mesh)
    twin = jax.sharding.Mesh(
        mesh.devices,
        mesh.axis_names,
        axis_types=(AxisType.Explicit,) * len(mesh.axis_names),
    )
    abstract = jax.tree.map(
        lambda leaf: _abstract_on(twin, leaf), params, is_leaf=_tree.is_metadata_box
    )
    with jax.set_mesh(twin):
        # A jaxpr's types, not jax.eval_shape's: they keep where each leaf
        # lives (host memory, for `diloco(offload_outer_state=True)`).
        traced, state = jax.make_jaxpr(tx.init, return_shape=True)(abstract)
    return jax.tree.unflatten(
        jax.tree.structure(state),
        [
            NamedSharding(mesh, _spec(aval), memory_kind=_memory_kind(aval))
            for aval in traced.out_avals
        ],
    )


def _concrete_mesh(mesh: Any) -> jax.sharding.Mesh:
    if mesh is None:
        mesh = jax.sharding.get_mesh()
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        raise ValueError(
            "state_shardings: `mesh` must be a jax.sharding.Mesh, or call it "
            f"under jax.set_mesh(mesh); got {mesh!r}."
        )
    return mesh


def _abstract_on(twin: jax.sharding.Mesh, leaf: Any) -> Any:
    """``leaf`` as a ``jax.ShapeDtypeStruct`` split on the twin mesh as the
    leaf (its sharding, its box's names) says."""
    spec = _declared_spec(leaf)
    value = leaf.value if _tree.is_metadata_box(leaf) else leaf
    return jax.ShapeDtypeStruct(
        np.shape(value),
        jax.dtypes.result_type(value),
        sharding=NamedSharding(twin, spec),
    )


def _declared_spec(leaf: Any) -> P:
    """How ``leaf`` is split: a box's names, an array's or a
    ``ShapeDtypeStruct``'s ``NamedSharding``; replicated otherwise."""
    if _tree.is_metadata_box(leaf):
        return _box_spec(leaf)
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return P(*sharding.spec)
    return P()


def _box_spec(box: Any) -> P:
    """The mesh partitions of a flax box (imported only for one)."""
    from flax import linen as nn  # noqa: PLC0415 (flax is optional)

    if isinstance(box, nn.LogicallyPartitioned):
        return P(*(nn.logical_to_mesh_axes(box.names, box.rules) or ()))
    if isinstance(box, nn.Partitioned):
        return P(*box.names)
    metadata = box.get_metadata() if hasattr(box, "get_metadata") else {}
    names = metadata.get("out_sharding") or metadata.get("sharding_names")
    return P(*names) if names else P()


def _memory_kind(aval: Any) -> str | None:
    """``"pinned_host"`` for a leaf typed in host memory; None (the
    default, device memory) otherwise."""
    if getattr(aval, "memory_space", None) == jax.memory.Space.Host:
        return "pinned_host"
    return None


def _spec(leaf: Any) -> P:
    """A state leaf's spec as the twin's types give it (replicated if none)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return P()
    return P(*sharding.spec)
