"""DiLoCo (and Streaming DiLoCo), split by job: the state, the fragments,
one fragment's sync, one worker's call, the ``jax.jit`` layout of workers
stacked on a mesh axis, and `diloco`, which puts them together
(docs/architecture.md lists the modules).
"""

from gradaccum_jax._diloco._stacked import (
    anchor_params,
    stack_workers,
    worker_value_and_grad,
)
from gradaccum_jax._diloco._state import DiLoCoState
from gradaccum_jax._diloco._transformation import diloco

__all__ = [
    "DiLoCoState",
    "anchor_params",
    "diloco",
    "stack_workers",
    "worker_value_and_grad",
]
