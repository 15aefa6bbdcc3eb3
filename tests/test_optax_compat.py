"""optax's own MultiSteps tests, run unchanged against gradaccum_jax.

optax ships its test modules inside the package. Each one reaches
`MultiSteps` through its module global `_accumulation`; rebinding that global
to a namespace that serves our `MultiSteps` (and optax's other accumulation
transforms) runs optax's test bodies, unmodified, against our class. This is
the drop-in contract: code and tests written for `optax.MultiSteps` pass with
`gradaccum_jax.MultiSteps`.
"""

import types

import pytest
from optax.transforms import _accumulation as optax_accumulation

import gradaccum_jax

ours = types.SimpleNamespace(
    **{
        name: getattr(optax_accumulation, name)
        for name in dir(optax_accumulation)
        if not name.startswith("__")
    }
)
ours.MultiSteps = gradaccum_jax.MultiSteps
ours.MultiStepsState = gradaccum_jax.MultiStepsState
ours.skip_not_finite = gradaccum_jax.skip_not_finite
ours.skip_large_updates = gradaccum_jax.skip_large_updates

accumulation_test = pytest.importorskip("optax.transforms._accumulation_test")
alias_test = pytest.importorskip("optax._src.alias_test")
accumulation_test._accumulation = ours
alias_test._accumulation = ours


class TestOptaxAccumulationSuite(accumulation_test.AccumulationTest):
    """Every test of optax's accumulation module, MultiSteps being ours."""


class TestOptaxOptimizersWrapped(alias_test.AliasTest):
    """optax's check that every optimizer in optax works wrapped in MultiSteps."""


# Only the MultiSteps test of the optimizer suite concerns us; the rest of
# AliasTest tests optax's optimizers themselves and would only cost CI time.
for _name in list(vars(alias_test.AliasTest)):
    if _name.startswith("test") and not _name.startswith("test_gradient_accumulation"):
        setattr(TestOptaxOptimizersWrapped, _name, None)
