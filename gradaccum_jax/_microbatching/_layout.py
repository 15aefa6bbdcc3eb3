"""How a step's parameters are laid out over a mesh's data axis: which
leaves are gathered once and which in every micro-batch (`DataLayout`), and
how one device sees them inside the scan (`ShardedParams`)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement
from gradaccum_jax._tree import mesh_axes_of, vary_over


class DataLayout(NamedTuple):
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
    def of(cls, axis, params, gather_params_once, unreduced) -> DataLayout:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or axis not in mesh.axis_names:
            raise ValueError(
                f"`data_axis`={axis!r} is not an axis of the current mesh "
                f"(axes {tuple(mesh.axis_names)}); set a mesh with that axis "
                "with `jax.set_mesh(mesh)` around the call (or the jit)."
            )
        kind = _placement.axis_type(axis)
        explicit = kind == jax.sharding.AxisType.Explicit
        if unreduced and not explicit:
            raise ValueError(
                f"`unreduced_grads`=True needs `data_axis`={axis!r} to be an "
                f"Explicit mesh axis, but it is {kind}: unreduced arrays are a "
                "type of Explicit sharding."
            )

        # Gathering in every micro-batch takes a shard_map manual over the
        # data axis, which jax 0.10.2 lowers with every other Explicit axis
        # replicated: a param split over `model` too would be all-gathered
        # over it at the map's boundary (on the 0.81B reference made FSDP +
        # tensor parallel, 6 gathers of 1,152 MiB a device and 3.19 GiB of
        # temporaries against 1.13 gathered once). Such params are gathered
        # once per step, as with True.
        split_elsewhere = any(
            mesh_axes_of(leaf) - {axis} for leaf in jax.tree.leaves(params)
        )

        def gather_dim(leaf: Any) -> int | None:
            # Auto axes do not show in the type while tracing: a leaf then
            # looks replicated and shard_map gathers it once.
            if gather_params_once or not explicit or split_elsewhere:
                return None
            spec = jax.typeof(leaf).sharding.spec
            dims = [i for i, entry in enumerate(spec) if entry == axis]
            return dims[0] if dims else None

        gather_dims = jax.tree.map(gather_dim, params)
        return cls(axis, mesh.shape[axis], explicit, gather_dims, unreduced)

    def param_spec(self, dim: int | None) -> P:
        return P() if dim is None else P(*[None] * dim, self.axis)


class ShardedParams:
    """Parameters as one device sees them inside the scan, and how its
    weighted gradient contribution is reduced in each micro-batch.

    Leaves gathered once are marked varying so that ``jax.grad`` keeps each
    device's gradient (an invariant primal would make it psum the gradient
    in every micro-batch). Leaves gathered per micro-batch are all-gathered
    when the loss runs and their weighted contribution reduce-scattered back
    to the shard, so the accumulator holds only the shard.
    """

    def __init__(self, layout: DataLayout, manual: bool = True):
        # Under `_per_device.over_axis` (a vmap, not a manual shard_map, and
        # no leaf gathered per micro-batch) nothing is typed as varying.
        self._layout = layout
        self._manual = manual

    @property
    def axis(self) -> str:
        return self._layout.axis

    def full(self, params: Any) -> Any:
        axis = self._layout.axis
        if not self._manual:
            return params

        def gather(leaf: jax.Array, dim: int | None) -> jax.Array:
            if dim is not None:
                leaf = jax.lax.all_gather(leaf, axis, axis=dim, tiled=True)
            return vary_over(leaf, frozenset({axis}))

        return jax.tree.map(gather, params, self._layout.gather_dims)

    def reduce_contribution(self, grads: Any) -> Any:
        axis = self._layout.axis

        def scatter(leaf: jax.Array, dim: int | None) -> jax.Array:
            return leaf if dim is None else _reduce_scatter(leaf, axis, dim)

        return jax.tree.map(scatter, grads, self._layout.gather_dims)


def _reduce_scatter(leaf: jax.Array, axis: str, dim: int) -> jax.Array:
    """``psum_scatter`` of ``leaf`` over ``axis`` along ``dim``.

    jax 0.10 fails to lower a reduce-scatter whose operand is also sharded
    over a mesh axis outside the ``shard_map`` (an AssertionError in
    ``_reduce_scatter_lowering`` for FSDP x tensor-parallel
    ``P("data", "model")``): it then runs in a nested ``shard_map`` manual
    over those axes too, on each device's block, since a reduce-scatter
    acts on every position of the other dimensions alike.
    """
    scatter = functools.partial(
        jax.lax.psum_scatter, axis_name=axis, scatter_dimension=dim, tiled=True
    )
    spec = jax.typeof(leaf).sharding.spec
    others = set(mesh_axes_of(leaf))
    if not others:
        return scatter(leaf)
    return jax.shard_map(scatter, in_specs=spec, out_specs=spec, axis_names=others)(
        leaf
    )
