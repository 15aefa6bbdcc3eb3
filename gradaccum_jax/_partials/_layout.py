"""The interface of every layout of per-device terms, and `NoTerms`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gradaccum_jax import _tree, _weights


class TermsLayout:
    """Where the per-device terms of a sum live: the interface of all three.

    This base class is the layout without terms (`NoTerms`): every value is
    whole, on every device, and a "sum of terms" is the value itself.
    """

    axes: frozenset[str] = frozenset()
    # Whether a term carries a leading device axis, one row per device (an
    # Auto axis's terms), else it is shaped like its value.
    stacked: bool = False

    def zeros(self, leaf: Any) -> jax.Array:
        """A zero sum, as terms, of a value shaped (and sharded) like ``leaf``."""
        return _tree.zeros_like(leaf)

    def lift(self, value: jax.Array) -> jax.Array:
        """A whole value as terms: whole on the first device, zero elsewhere."""
        return value

    def reduce(self, tree: Any) -> Any:
        """Every leaf of ``tree`` (all terms) summed over the devices, in one go."""
        return tree

    def placed_like(self, value: Any, like: Any) -> Any:
        """A whole ``value`` (restored from host arrays) split as ``like``
        where the split is in the types (Explicit axes), to be lifted."""
        del like
        return value

    def stored(self, term: Any) -> Any:
        """A term as a state keeps it between jitted calls: an ordinary
        array, each device's buffer its own term (`loaded` inverts it)."""
        return term

    def loaded(self, stored: Any) -> Any:
        """A term `stored` keeps, as terms again, on this mesh's devices."""
        return stored

    def term_spec(self, parts: tuple[Any, ...]) -> Any:
        """The ``shard_map`` spec of terms of a value split as ``parts`` over
        the mesh axes other than the layout's: each device gets its own
        term's block."""
        return P(*parts)

    def device_count(self) -> int:
        """The number of devices over the layout's axes (1 without terms)."""
        return 1

    def stored_spec(self, stored: Any) -> Any:
        """The partition spec a stored term keeps where the types show it
        (Explicit axes); None where they do not."""
        del stored
        return None

    def stored_devices(self, weight: Any) -> int | None:
        """How many devices' terms a stored window holds, read from its
        weight; None for a whole window (`reduce_window`'s) or where the
        state holds the terms themselves."""
        del weight
        return None

    def rows_total(self, stored: Any, devices: int) -> Any:
        """The whole value of a term `stored` keeps for ``devices`` devices
        (a state saved on another number of devices)."""
        raise NotImplementedError(f"{self!r} stores no rows of terms.")

    def holds_terms(self, leaf: Any, like: Any) -> bool:
        """Whether ``leaf`` holds terms of a value shaped like ``like``."""
        del leaf, like
        return False

    def is_weighted(self, weight: Any) -> bool:
        """Whether ``weight`` is per-device terms (gradients then weighted)."""
        del weight
        return False

    def add_terms(self, acc: Any, terms: Any, weight: Any) -> Any:
        """``acc + terms``, leaf by leaf, on each device whose weight is not 0.

        ``terms`` are already weighted (``w_d g_d``, one per device, in this
        layout) and ``weight`` holds each device's ``w_d``. A device of
        weight 0 keeps its ``acc``: a select, since a device of padding only
        has a NaN gradient (a 0 / 0 loss), and 0 * NaN is NaN.
        """
        return jax.tree.map(lambda a, t: jnp.where(weight != 0, a + t, a), acc, terms)

    def as_weight(self, weight: Any, caller: str) -> jax.Array:
        """A micro-batch's ``weight=`` validated: a float32 scalar (1 if None),
        or per-device terms as the layout keeps them."""
        if weight is not None and jnp.ndim(weight) == 1 and not self.axes:
            raise ValueError(
                f"{caller}: `weight` must be a scalar (the number of examples "
                f"or tokens behind this gradient), got shape "
                f"{jnp.shape(weight)}; weights of one row per device "
                "(local_value_and_grad's) need an accumulator built with "
                "unreduced_axes over that mesh axis."
            )
        return _weights.scalar_weight(weight, caller)

    def as_terms(self, value: jax.Array, like: Any) -> jax.Array:
        """``value`` as terms, lifted if it is a whole value."""
        return value if self.holds_terms(value, like) else self.lift(value)

    def total(self, value: Any, like: Any) -> Any:
        """The whole value of ``value``: its terms summed, if it holds terms."""
        return self.reduce(value) if self.holds_terms(value, like) else value

    def arrival_shape(self, leaf: Any) -> Any:
        """The shape of the terms of a value shaped like ``leaf``."""
        return leaf

    def arrives_whole(self, grad: Any, param: Any) -> bool:
        """Whether gradient leaf ``grad`` is whole where terms are due.

        Whole: summed over the devices, as ``jax.grad`` returns it.
        ``param`` is its param, or None where the params are not given.
        """
        del grad, param
        return False

    def map_terms(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``fn(local, replicated)`` on each device's own term, kept as terms.

        A nonlinear function of a term (a squared norm) is computed where the
        term lies: nothing crosses the layout's axes. ``fn`` sees a device's
        term whole, with the split it has over other mesh axes (a
        tensor-parallel ``model`` axis) kept; what it reduces over such a
        split (a squared norm's partial sums) is reduced over that axis, as
        in the plain ``jax.grad`` step. ``fn`` holds no collective over the
        layout's axes.
        """
        return fn

    def over_terms(
        self, fn: Callable[[Any, Any], tuple[Any, Any]]
    ) -> Callable[[Any, Any], tuple[Any, Any]]:
        """``fn(local, state)`` on each device's whole term; replicated results.

        ``fn`` runs where each device sees its own term as a value varying
        over the axes and ``state`` replicated; it must return values that
        are the same on every device (results of collectives over the axes).
        A term split over another mesh axis (tensor parallelism) is gathered
        over it first, since ``fn`` asks for it whole: `over_term_blocks`
        keeps the split.
        """
        return fn

    def over_term_blocks(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`over_terms` on each device's own block of a term, not gathered.

        ``fn(blocks, splits, state)`` sees each device's block of each term
        and how the term is split over the mesh axes other than the layout's
        (a `gradaccum_jax._compression._blocks.Split` per leaf: its partitions,
        ``()`` for a block that is the whole term). What depends on the
        whole term (a sum, a maximum) ``fn`` computes with collectives over
        those axes. It returns the sums as blocks, and a state the same on
        every device.
        """
        return self.over_terms(lambda t, s: fn(t, [()] * len(jax.tree.leaves(t)), s))

    def micro_batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(mean_grads, weight, *replicated)`` on each device's micro-batch.

        Returns ``g(grads, weight, *replicated)``, whose result is ``fn``'s
        as terms. Each device's term of a micro-batch's gradient is a small
        batch of its own; ``fn`` sees it as the mean gradient of that batch
        and the batch's weight (and ``replicated``, values that are the same
        on every device, as they are). With a per-device weight ``w_d`` the
        terms are ``w_d g_d`` (`gradaccum_jax.local_value_and_grad` with
        ``has_weight=True``), so the mean is the term over ``w_d``; a
        replicated weight ``w`` is spread evenly over the ``n`` devices,
        whose terms are then ``g_d / n``. The scaling is one multiply that
        XLA fuses into ``fn``'s reduction. A device of zero weight gets its
        gradients scaled by a safe 1 (its NaNs are ``fn``'s to drop with a
        select).
        """
        return fn


class NoTerms(TermsLayout):
    """Values kept whole: no ``unreduced_axes``."""

    def __repr__(self) -> str:
        return "NoTerms()"
