"""Helpers shared by the test modules.

``EAGER_AND_JIT`` runs one test body with and without ``jax.jit`` (the pytest
spelling of ``chex.variants(with_jit=True, without_jit=True)``): Python-side
branching and trace-time checks behave differently in the two.
``train_step_temp_bytes`` reads a donated train step's compiled temporaries.
"""

from __future__ import annotations

import jax
import optax
import pytest


def _eager(fn):
    return fn


EAGER_AND_JIT = pytest.mark.parametrize(
    "compile_fn", [_eager, jax.jit], ids=["eager", "jit"]
)


def train_step_temp_bytes(tx, params, make_grads=None) -> int:
    """Temporary bytes of a jitted train step (update + apply, donated).

    Gradients come in as arguments (buffers, as from a backward pass), or
    from ``make_grads(params, grads)`` inside the step, where XLA may fuse
    their producer into the accumulation.
    """

    def step(params, opt_state, grads):
        if make_grads is not None:
            grads = make_grads(params, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, tx.init(params), params)
        .compile()
    )
    return compiled.memory_analysis().temp_size_in_bytes
