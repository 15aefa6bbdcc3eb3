"""Each device's own window: `per_device_accumulator`.

A `WindowAccumulator` that cannot add per-device terms itself (ternary code
sums: a sum of codes is not a code) is run by each device on its own
window, stacked on a leading axis sharded over one mesh axis, and decoded
into that device's float term of the window's sum at the emission
(`gradaccum_jax._window._store.DecodedWindow`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax import _partials, _placement, _tree
from gradaccum_jax._window._accumulator import WindowAccumulator, check_arrival


class PerDeviceWindow(NamedTuple):
    """The windows of `per_device_accumulator`, one per device.

    Attributes:
      local: the inner accumulator's state, each leaf stacked on a leading
        axis of size ``n_devices`` sharded over the mesh axis: plain
        arrays, valid jit inputs and outputs, checkpointable as they are.
    """

    local: Any

    @property
    def local_devices(self) -> Any:
        """One leaf of ``local``: its leading axis counts the devices."""
        return jax.tree.leaves(self.local)[0]


def per_device_accumulator(
    accumulator: WindowAccumulator, axes: frozenset[str]
) -> WindowAccumulator:
    """``accumulator`` run by each device on its own window, over mesh ``axes``.

    For gradients that arrive as per-device terms (`local_value_and_grad`):
    every device adds its own term to its own window (``add`` runs in a
    ``jax.shard_map``, no collective), and ``total`` decodes each device's
    window into its float term of the window's sum, which the engine then
    reduces once, with the window weight, in one fused all-reduce. As in
    `float_accumulator`, a per-device weight means each device's gradients
    are already weighted: the device adds them with weight 1 (0 if its own
    weight is 0, so that its NaNs are dropped).

    Args:
      accumulator: the per-device window (e.g. ternary code sums).
      axes: one mesh axis.

    Returns:
      A `WindowAccumulator` whose state is a `PerDeviceWindow`.
    """

    def init(params):
        _placement.check_not_sharded_over(params, axes, "Param")
        _check_whole_per_device(params)
        layout = _partials.device_terms_layout(axes)
        local = accumulator.init(params)
        devices = jnp.arange(layout.device_count())
        if accumulator.for_device is None:
            windows = jax.tree.map(
                lambda leaf: jnp.broadcast_to(leaf, (len(devices), *jnp.shape(leaf))),
                local,
            )
        else:
            windows = jax.vmap(accumulator.for_device, in_axes=(None, 0))(
                local, devices
            )
        return PerDeviceWindow(layout.stack(windows))

    def add(acc, grads, weight):
        layout = _partials.device_terms_layout(axes)
        weighted = layout.is_weighted(weight)
        jax.tree_util.tree_map_with_path(
            lambda path, grad: check_arrival(path, layout, None, grad, weighted),
            grads,
        )
        _check_device_count(acc, axes)

        def local_add(window, grads, weight):
            if weighted:  # w_d g_d already: add once, or not at all
                weight = (weight != 0).astype(jnp.float32)
            return accumulator.add(window, grads, weight)

        terms, shared = ((grads, weight), ()) if weighted else ((grads,), (weight,))
        return PerDeviceWindow(
            layout.map_device_states(local_add, acc.local, terms, shared)
        )

    def total(acc):
        _check_device_count(acc, axes)
        layout = _partials.device_terms_layout(axes)
        return layout.device_states_to_terms(accumulator.total, acc.local)

    def reset(acc):
        _check_device_count(acc, axes)
        layout = _partials.device_terms_layout(axes)
        return PerDeviceWindow(layout.map_device_states(accumulator.reset, acc.local))

    return WindowAccumulator(init, add, total, reset)


def _check_whole_per_device(params: Any) -> None:
    """Raises if a param is split over a mesh axis (explicit sharding).

    Each device's window runs in a ``shard_map`` manual over every mesh axis
    (its terms are unreduced arrays), where it sees the whole leaf: a
    window of its own is a function of the whole term (a ternary window's
    scale), which a block of it does not give.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        split = sorted(_tree.mesh_axes_of(leaf))
        if split:
            raise ValueError(
                f"Param {jax.tree_util.keystr(path)} ({jax.typeof(leaf)}) is "
                f"split over mesh axis {split[0]!r}: a window kept on each "
                "device (a window accumulator of its own with `unreduced_axes`, "
                "as in ternary_accumulate(..., unreduced_axes=...)) holds whole "
                "leaves. Keep the window as float32 terms and send ternary "
                "codes at its emission instead (MultiSteps(..., "
                "unreduced_axes=..., window_reduction=ternary_window_reduction("
                "seed))), which keeps the split, or accumulate without "
                "`unreduced_axes`."
            )


def _check_device_count(acc: PerDeviceWindow, axes: frozenset[str]) -> None:
    """Raises unless ``acc`` holds one window per device of the mesh axis.

    A state saved on one number of devices and restored on another would
    otherwise fail deep inside the engine (a select of shapes (4, 2) and
    (8, 2)), or, sharded evenly, silently keep every other device's window.
    """
    (axis,) = axes
    saved = jnp.shape(acc.local_devices)[0]
    devices = jax.sharding.get_abstract_mesh().shape.get(axis, saved)
    if saved != devices:
        raise ValueError(
            f"The accumulator state holds the windows of {saved} devices (one "
            f"per device, stacked on a leading axis), but mesh axis {axis!r} "
            f"has {devices} devices. Each device keeps its own window (its own "
            "ternary code sums and scales), which cannot be split or merged "
            "over another number of devices; `reduce_window` does not help "
            "(it reduces the window's weight, not the per-device windows). "
            f"Restore the state on a mesh whose {axis!r} axis has {saved} "
            "devices, or drop the partial window under the new mesh: "
            "`state = opt.reset(state._replace(acc_grads=opt.init(params)"
            ".acc_grads))`."
        )
