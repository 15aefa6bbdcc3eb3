"""Per-device terms of a sum, kept apart until a window is reduced.

Data parallelism under ``jax.jit`` needs one sum over devices per window,
not per micro-step. Until then each device keeps its own term, in one of
three layouts, decided once per trace by `terms_layout` from the mesh axes
and the current mesh (``jax.set_mesh``):

* `NoTerms` (no ``unreduced_axes``): values are whole; a sum is itself.
* `Unreduced` (Explicit axes): an *unreduced* array (type
  ``f32[...]{U:data}``), shaped like the value; JAX tracks that it is a sum
  and reduces it on ``reshard``.
* `Stacked` (one Auto axis, which has no unreduced types): the terms
  stacked on a leading axis of size ``n_devices``, sharded over the mesh
  axis; the sum is ``.sum(0)``.

The three share one interface (`TermsLayout`), so the code that keeps a
window never asks which one it holds. Either way a term crosses devices
only when a window is reduced: by default in `TermsLayout.reduce` (one
fused float all-reduce); a `gradaccum_jax.extend.WindowReduction` may send
something smaller. A term of a param split over another mesh axis (a
tensor-parallel ``model`` axis) keeps that split in every layout, and no
function run on a device's term gathers it (`DeviceTerms`).

docs/architecture.md lists the modules, one per idea.
"""

from gradaccum_jax._partials._choice import device_terms_layout, terms_layout
from gradaccum_jax._partials._device_terms import DeviceTerms
from gradaccum_jax._partials._layout import NoTerms, TermsLayout
from gradaccum_jax._partials._stacked import Stacked
from gradaccum_jax._partials._unreduced import Unreduced

__all__ = [
    "DeviceTerms",
    "NoTerms",
    "Stacked",
    "TermsLayout",
    "Unreduced",
    "device_terms_layout",
    "terms_layout",
]
