"""Helpers shared by the test modules.

``EAGER_AND_JIT`` runs one test body with and without ``jax.jit`` (the pytest
spelling of ``chex.variants(with_jit=True, without_jit=True)``): Python-side
branching and trace-time checks behave differently in the two.
"""

from __future__ import annotations

import jax
import pytest


def _eager(fn):
    return fn


EAGER_AND_JIT = pytest.mark.parametrize(
    "compile_fn", [_eager, jax.jit], ids=["eager", "jit"]
)
