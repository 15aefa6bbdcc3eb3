"""What the two layouts of per-device terms share.

Two ways of running a function on each device's own values:

* A function of each device's term (`DeviceTerms.map_terms`, a statistic of
  a micro-batch): the terms are viewed as one array stacked on a leading
  device axis (`DeviceTerms.as_stacked`, no data moves) and the function is
  ``jax.vmap``-ed over its rows. No ``shard_map``: a term split over another
  mesh axis (a tensor-parallel ``model`` axis) keeps its split, and what the
  function reduces over it (a squared norm's partial sums) is one
  all-reduce over that axis, as in the plain ``jax.grad`` step. (A
  ``shard_map`` manual over every axis would hand each device a block, not
  its term; one manual over the layout's axes alone gathers the split at
  its boundary on an Explicit mesh.)
* Per-device states (`DeviceTerms.map_device_states`, a window of its own
  on each device): a tree stacked on a leading device axis, one row per
  device, mapped with the device's terms and shared values in a
  ``shard_map`` over the layout's axis.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _placement, _tree
from gradaccum_jax._partials._layout import TermsLayout
from gradaccum_jax._partials._rows import term_shape


class DeviceTerms(TermsLayout, abc.ABC):
    """What the two layouts with per-device terms share."""

    # The partition spec of terms in a shard_map over the layout's axis
    # (whole leaves: a per-device state's), set by each layout.
    _term_spec: P

    @abc.abstractmethod
    def as_stacked(self, terms: Any) -> Any:
        """Terms as one array per leaf stacked on a leading device axis.

        Row ``d`` is device ``d``'s term; the other dimensions keep the
        term's split. No data moves: each device's own term is its row.
        """

    @abc.abstractmethod
    def from_stacked(self, terms: Any) -> Any:
        """Terms stacked on a leading device axis, in this layout."""

    def map_terms(self, fn):
        def mapped(terms, replicated):
            stacked = self.as_stacked(terms)
            rows = _map_rows(fn, stacked, replicated, self.row_axes())
            return self.from_stacked(rows)

        return mapped

    def stored_devices(self, weight: Any) -> int | None:
        # A stored weight is one row per device: (n,). Inside a step it is
        # unreduced (a scalar) or stacked (n,), which `load` never sees.
        return jnp.shape(weight)[0] if jnp.ndim(weight) == 1 else None

    def rows_total(self, stored: jax.Array, devices: int) -> jax.Array:
        """The sum of the terms `stored` keeps for ``devices`` devices.

        The devices need not be this mesh's: a state saved on another
        number of devices is summed whole here (its rows gathered first,
        once, on the call that resumes it).
        """
        shape = term_shape(jnp.shape(stored), devices)
        if AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types:
            stored = _placement.placed(stored, P())
        return jnp.sum(jnp.reshape(stored, (devices, *shape)), axis=0)

    def row_axes(self) -> str | tuple[str, ...]:
        """The mesh axes the leading axis of stacked terms is split over, in
        the mesh's order (a name for one axis)."""
        names = jax.sharding.get_abstract_mesh().axis_names
        rows = tuple(name for name in names if name in self.axes)
        return rows[0] if len(rows) == 1 else rows

    def micro_batch(self, fn):
        mapped = self.map_terms(_device_micro_batch(fn, self.device_count()))

        def run(grads, weight, *replicated):
            if self.is_weighted(weight):  # per-device weights, with the terms
                return mapped((grads, weight), (None, replicated))
            return mapped(grads, (weight, replicated))

        return run

    def device_count(self) -> int:
        """The number of devices over the layout's axes."""
        mesh_shape = jax.sharding.get_abstract_mesh().shape
        count = 1
        for name in self.axes:
            count *= mesh_shape[name]
        return count

    def map_device_states(
        self,
        fn: Callable[..., Any],
        states: Any,
        terms: tuple[Any, ...] = (),
        shared: tuple[Any, ...] = (),
    ) -> Any:
        """``fn(state, *terms, *shared)`` run by each device on its own state.

        No collective. ``states`` is a tree stacked on a leading device axis
        sharded over the (one) axis: each device's state is its row (plain
        arrays, checkpointable). ``terms`` are per-device terms in this
        layout, each device seeing its own; ``shared`` values are the same on
        every device. ``fn`` returns the device's new state; the result is
        stacked like ``states``.
        """
        return self._on_each_device(fn, states, terms, shared, to_terms=False)

    def device_states_to_terms(self, fn: Callable[[Any], Any], states: Any) -> Any:
        """``fn(state)`` run by each device on its own state, as its term.

        As `map_device_states`; ``fn`` returns the device's term of a sum,
        and the result is those terms in this layout.
        """
        return self._on_each_device(fn, states, (), (), to_terms=True)

    def _on_each_device(self, fn, states, terms, shared, to_terms):
        (axis,) = self.axes
        stacked = self.stacked

        def local(states, terms, shared):
            own_terms = [_unstack(term) if stacked else term for term in terms]
            out = fn(_unstack(states), *own_terms, *shared)
            if to_terms and not stacked:
                return out
            return jax.tree.map(lambda x: x[None], out)

        # Unreduced terms need check_vma=False (see `Unreduced.over_terms`).
        mapped = jax.shard_map(
            local,
            in_specs=(P(axis), self._term_spec, P()),
            out_specs=self._term_spec if to_terms else P(axis),
            check_vma=stacked,
        )
        # A per-device state restored from host arrays arrives unsplit,
        # which an Explicit shard_map rejects (an Auto one splits it).
        if _placement.is_explicit(axis):
            states = self.stack(states)
        return mapped(states, tuple(terms), tuple(shared))

    def stack(self, tree: Any) -> Any:
        """``tree`` (one per device, stacked on a leading axis) sharded over
        it: a no-op if it is; host arrays are sliced where they lie."""
        (axis,) = self.axes
        return jax.tree.map(lambda leaf: _placement.constrained(leaf, P(axis)), tree)


def _map_rows(
    fn: Callable[[Any, Any], Any], stacked: Any, replicated: Any, rows: Any
) -> Any:
    """``fn(row, replicated)`` on each row of ``stacked``, stacked again.

    On a mesh with Explicit axes the rows are mapped with every axis made
    Auto (``jax.sharding.auto_axes``, no data moves): jax 0.10.2 cannot
    ``vmap`` a while loop (`gradaccum_jax._control.run_if`) over an array
    split over an Explicit axis ("Resource axis: data ... is not found in
    mesh: ()"). The results get back the types ``fn`` gives one row, split
    by rows over ``rows``.
    """
    by_row = jax.vmap(fn, in_axes=(0, None))
    if AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types:
        return by_row(stacked, replicated)
    one_row = jax.eval_shape(fn, jax.tree.map(_row_type, stacked), replicated)
    specs = jax.tree.map(lambda leaf: P(rows, *_tree.partitions(leaf)), one_row)
    return jax.sharding.auto_axes(by_row, out_sharding=specs)(stacked, replicated)


def _row_type(leaf: Any) -> jax.ShapeDtypeStruct:
    """The type of one row of a stacked ``leaf``: its other partitions kept."""
    sharding = jax.typeof(leaf).sharding
    return jax.ShapeDtypeStruct(
        jnp.shape(leaf)[1:],
        jnp.result_type(leaf),
        sharding=sharding.update(spec=P(*_tree.partitions(leaf)[1:])),
    )


def _unstack(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: leaf[0], tree)


def _device_micro_batch(fn, device_count):
    """``fn`` of a device's mean gradient and weight, from its terms (see
    `TermsLayout.micro_batch`); built for `TermsLayout.map_terms`."""

    def local(terms, replicated):
        weight, rest = replicated
        if weight is None:  # per-device weights came in with the terms
            grads, device_weight = terms
            safe = jnp.where(device_weight != 0, device_weight, 1.0)
            scale = 1.0 / safe
        else:
            grads, device_weight = terms, weight / device_count
            scale = jnp.asarray(device_count, jnp.float32)
        mean = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        return fn(mean, device_weight, *rest)

    return local
