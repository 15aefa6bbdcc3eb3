"""What reads compiled programs and states: bytes held, collectives run.

Memory and communication claims are checked on real objects, never on a
formula: `state_nbytes` sums the arrays a state holds; `all_reduces`,
`all_reduce_nbytes` and `collectives` read the collectives of a compiled
program's HLO (``jax.jit(f).lower(...).compile()``), with their bytes, their
device groups and mesh axes, and whether they run on every call or inside a
loop. `step_traffic` is the one check of a step that should communicate once
per window: what crosses each mesh axis per call and per window, and every
gather.
"""

from gradaccum_jax._collectives import Collective, collectives
from gradaccum_jax._measure import (
    AllReduce,
    all_reduce_nbytes,
    all_reduces,
    state_nbytes,
)
from gradaccum_jax._traffic import StepTraffic, step_traffic

__all__ = [
    "AllReduce",
    "Collective",
    "all_reduce_nbytes",
    "all_reduces",
    "collectives",
    "state_nbytes",
    "step_traffic",
    "StepTraffic",
]
