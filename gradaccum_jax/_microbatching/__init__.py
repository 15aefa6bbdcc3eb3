"""Micro-batching inside one jitted step.

``microbatched_value_and_grad`` is a drop-in replacement for
``jax.value_and_grad`` that splits the batch into micro-batches and sums
their gradients with ``jax.lax.scan``: only one micro-batch's activations
are alive at a time, so peak activation memory falls with the number of
micro-batches while the result stays the big-batch loss and gradient. This
is the in-step accumulation of levanter, MaxText and t5x, with the
valid-token weighting that fixes the gradient-accumulation loss bug
(a mean of per-micro-batch means is not the big-batch mean when the
micro-batches hold different numbers of valid examples).

docs/architecture.md lists the modules, one per step.
"""

from gradaccum_jax._microbatching._value_and_grad import microbatched_value_and_grad

__all__ = ["microbatched_value_and_grad"]
