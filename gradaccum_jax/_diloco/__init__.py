"""DiLoCo (and Streaming DiLoCo), split by job.

- `_state`: `DiLoCoState` and the fresh state;
- `_fragments`: which param leaves sync together, and at which step;
- `_sync`: one fragment's sync (outer gradient, mean, outer step);
- `_worker`: one worker's call (inner step, each fragment's sync when due);
- `_stacked`: the ``jax.jit`` layout (workers stacked on a mesh axis) and
  its public helpers, each worker's gradient among them;
- `_update`: `diloco`'s update on that layout;
- `_transformation`: `diloco`, which puts them together.
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
