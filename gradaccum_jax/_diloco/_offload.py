"""DiLoCo's outer state in host memory (``diloco(offload_outer_state=True)``).

The anchor, the outer optimizer's states and the outer reduction's states
are read once per cycle, by a sync. Between syncs they need not take
accelerator memory: they are kept in the host memory kind
(``pinned_host``, ``jax.memory.Space.Host``), and a fragment's sync
brings its pieces to the device, steps them, and puts them back. Only one
fragment's pieces are on the device at a time (each fragment syncs at its
own step of the cycle), so Streaming DiLoCo's ``fragments=F`` bounds what
a sync brings over to about 1/F of the outer state.

A move to the memory an array is already in moves nothing: the moves
below are safe on a state in either memory (a checkpoint restored without
its memory kinds is put back on the first call).
"""

from __future__ import annotations

from typing import Any

import jax

HOST_MEMORY_KIND = "pinned_host"


def check_host_memory(argument: str) -> None:
    """Raises unless the default backend's devices have a host memory kind."""
    device = jax.devices()[0]
    kinds = sorted(memory.kind for memory in device.addressable_memories())
    if HOST_MEMORY_KIND not in kinds:
        raise ValueError(
            f"diloco: `{argument}=True` keeps the outer state in host memory "
            f"(memory kind {HOST_MEMORY_KIND!r}), which the {device.platform} "
            f"backend's devices do not have (their memory kinds: {kinds}). "
            f"Pass {argument}=False to keep it in device memory."
        )


def to_host(tree: Any) -> Any:
    """Every array of ``tree`` in host memory (where it is already: as is)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def to_device(tree: Any) -> Any:
    """Every array of ``tree`` in device memory (where it is already: as is)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)
