"""Which layout of per-device terms a mesh gives: `terms_layout`."""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from gradaccum_jax import _placement
from gradaccum_jax._partials._device_terms import DeviceTerms
from gradaccum_jax._partials._layout import NoTerms, TermsLayout
from gradaccum_jax._partials._stacked import Stacked
from gradaccum_jax._partials._unreduced import Unreduced


def terms_layout(axes: frozenset[str]) -> TermsLayout:
    """The layout of per-device terms over ``axes`` on the current mesh.

    Explicit axes keep unreduced arrays; one Auto axis (which has no
    unreduced types) keeps stacked terms. A one-device Explicit axis also
    stacks: its single term is the sum, and jax 0.10.2 fails to lower some
    unreduced ops on a size-1 axis.
    """
    if not axes:
        return NoTerms()
    mesh = jax.sharding.get_abstract_mesh()
    missing = sorted(axes - set(mesh.axis_names))
    if missing:
        raise ValueError(
            f"`unreduced_axes` {sorted(axes)}: mesh axes {missing} are not in "
            f"the current mesh {mesh.axis_names}; call under jax.set_mesh(mesh)."
        )
    types = {_placement.axis_type(name) for name in axes}
    one_device = len(axes) == 1 and mesh.shape[next(iter(axes))] == 1
    if types == {AxisType.Explicit} and not one_device:
        return Unreduced(frozenset(axes))
    if len(axes) > 1 or not (one_device or types == {AxisType.Auto}):
        raise ValueError(
            f"`unreduced_axes` {sorted(axes)}: on a mesh that is not all "
            "Explicit, only one Auto axis is supported (terms stacked on a "
            f"leading axis), got types {sorted(str(t) for t in types)}."
        )
    (axis,) = axes
    return Stacked(axis, mesh.shape[axis])


def device_terms_layout(axes: frozenset[str]) -> DeviceTerms:
    """`terms_layout` for a window kept on each device: one with terms."""
    layout = terms_layout(axes)
    if not isinstance(layout, DeviceTerms):
        raise ValueError(
            f"A per-device window needs mesh axes for its terms, got {sorted(axes)}."
        )
    return layout
