"""The public surface in three layers, each name in exactly one.

The top level holds what a user trains with; `gradaccum_jax.extend` the
accumulation engine's extension protocols and the parts' state types;
`gradaccum_jax.measure` what reads compiled programs and states. The lists
below are the surface: a name added, moved or removed changes one of them
on purpose, and no moved name stays behind as an alias.
"""

from __future__ import annotations

import importlib
import types

import pytest

import gradaccum_jax
from helpers import PUBLIC_SUBMODULES

TOP_LEVEL = [
    "AccumulationStats",
    "AccumulationTransformation",
    "AdaptiveWindow",
    "ClipByGlobalNormState",
    "DiLoCoState",
    "MultiSteps",
    "MultiStepsState",
    "NoiseScaleEstimate",
    "ShouldSkipUpdateFunction",
    "TernaryState",
    "accumulate",
    "adaptive_every_k",
    "anchor_params",
    "average_across_devices",
    "clip",
    "clip_by_global_norm",
    "diloco",
    "global_norm",
    "local_value_and_grad",
    "microbatched_value_and_grad",
    "skip_large_updates",
    "skip_not_finite",
    "stack_workers",
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_dequantize",
    "ternary_quantize",
    "ternary_window_reduction",
    "worker_value_and_grad",
]

SUBMODULES = {
    "extend": [
        "NoiseScaleState",
        "RunningMean",
        "TermsLayout",
        "TernaryAccumulatorState",
        "WindowAccumulator",
        "WindowPosition",
        "WindowReduction",
        "WindowStatistic",
        "float_accumulator",
    ],
    "measure": [
        "AllReduce",
        "Collective",
        "all_reduce_nbytes",
        "all_reduces",
        "collectives",
        "state_nbytes",
    ],
}


def test_the_top_level_exports_what_a_user_trains_with():
    assert len(TOP_LEVEL) == 30
    assert sorted(gradaccum_jax.__all__) == TOP_LEVEL


@pytest.mark.parametrize("submodule", sorted(SUBMODULES))
def test_each_submodule_exports_its_names(submodule):
    assert sorted(getattr(gradaccum_jax, submodule).__all__) == SUBMODULES[submodule]


def test_the_public_submodules_are_the_layers():
    assert sorted(PUBLIC_SUBMODULES) == sorted(SUBMODULES)


def _public_attributes(module: types.ModuleType) -> set[str]:
    """The names a module binds that are neither private nor modules."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


@pytest.mark.parametrize(
    "layer", ["gradaccum_jax", *(f"gradaccum_jax.{s}" for s in sorted(SUBMODULES))]
)
def test_a_layer_binds_nothing_public_outside_its_all(layer):
    # An alias left behind (``gradaccum_jax.WindowAccumulator``) would still
    # import: the layer's namespace must hold its __all__ and nothing else.
    module = importlib.import_module(layer)
    assert _public_attributes(module) == set(module.__all__)


def test_no_name_is_in_two_layers():
    layers = [gradaccum_jax.__all__] + [
        getattr(gradaccum_jax, submodule).__all__ for submodule in SUBMODULES
    ]
    names = [name for layer in layers for name in layer]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
