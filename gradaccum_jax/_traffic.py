"""Whether a compiled step communicates once per window: `step_traffic`.

A step that accumulates a window of per-device terms should send nothing
over the summed axes (``data``) on a micro-step and one reduction of the
window when it emits; it should gather no window and no param that it
keeps split. Counting all-reduces alone misses the rest (a window
resharded every call shows as all-gathers, not all-reduces), so this reads
every collective of the program (`gradaccum_jax.measure.collectives`) and
sorts it by where it runs:

* every call: in the entry computation, or in a loop whose trip count XLA
  knows (a scan over layers runs on every call);
* once per window: inside a loop of a runtime trip count (the
  zero-or-one-trip loop in which a window is closed) or a conditional's
  branch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gradaccum_jax import _checks
from gradaccum_jax._collectives import Collective, collectives


class StepTraffic(NamedTuple):
    """What a compiled step sends, by mesh axes and by how often.

    Attributes:
      every_call: bytes (on one device, the collectives' result buffers) of
        the collectives that run on every call, by the mesh axes their
        device groups span (a tuple of names; None where the groups are no
        sub-mesh of the given mesh).
      per_window: the same for the collectives that run only when the step
        closes a window (inside a zero-or-one-trip loop).
      every_call_over_summed: the collectives that run on every call and
        span one of ``summed_axes`` (or cannot be placed on the mesh): what
        a step that communicates once per window has none of.
      gathers: the all-gathers that run on every call, whatever their
        axes: an FSDP program's own gathers of its params show here, and
        so would a window or a split param gathered by mistake.
    """

    every_call: dict[tuple[str, ...] | None, int]
    per_window: dict[tuple[str, ...] | None, int]
    every_call_over_summed: tuple[Collective, ...]
    gathers: tuple[Collective, ...]

    @property
    def once_per_window(self) -> bool:
        """Whether nothing crosses a summed axis on a micro-step."""
        return not self.every_call_over_summed


def step_traffic(compiled: Any, mesh: Any, summed_axes: Any = "data") -> StepTraffic:
    """What a compiled train step sends per micro-step and per window.

    The one check of a data-parallel step that should reduce once per
    window: ``step_traffic(compiled, mesh).once_per_window`` is False when
    anything crosses ``summed_axes`` on every call, and
    ``every_call_over_summed`` and ``gathers`` say what does.

    Args:
      compiled: ``jax.jit(step).lower(...).compile()``.
      mesh: the mesh the step was compiled for (its axes name the groups).
      summed_axes: the mesh axes a window's terms are summed over: a name
        or a tuple of names (``unreduced_axes``).

    Returns:
      A `StepTraffic`.

    Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> import gradaccum_jax as ga
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> with jax.set_mesh(mesh):
    ...     opt = ga.MultiSteps(optax.sgd(0.1), 4, unreduced_axes="data")
    ...     grad_fn = ga.local_value_and_grad(lambda w, x: jnp.mean((x @ w) ** 2))
    ...     def step(w, state, x):
    ...         _, grads = grad_fn(w, x)
    ...         updates, state = opt.update(grads, state, w)
    ...         return optax.apply_updates(w, updates), state
    ...     w = jnp.zeros(16)
    ...     x = jax.device_put(jnp.ones((32, 16)), P("data"))
    ...     compiled = jax.jit(step).lower(w, opt.init(w), x).compile()
    >>> traffic = ga.measure.step_traffic(compiled, mesh)
    >>> traffic.once_per_window, traffic.every_call, traffic.gathers
    (True, {}, ())
    >>> traffic.per_window  # the window's 16 floats and its weight, once
    {('data',): 68}
    """
    summed = _checks.axis_names("summed_axes", summed_axes)
    every_call: dict[tuple[str, ...] | None, int] = {}
    per_window: dict[tuple[str, ...] | None, int] = {}
    over_summed, gathers = [], []
    for found in collectives(compiled, mesh):
        runs_every_call = found.place != "branch" and None not in found.trips
        table = every_call if runs_every_call else per_window
        table[found.axes] = table.get(found.axes, 0) + found.nbytes
        if not runs_every_call:
            continue
        if found.axes is None or summed & set(found.axes):
            over_summed.append(found)
        if found.kind == "all-gather":
            gathers.append(found)
    return StepTraffic(every_call, per_window, tuple(over_summed), tuple(gathers))
