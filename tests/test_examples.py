"""The framework examples in examples/ run and keep their promises.

Each example trains on scikit-learn's digits with accumulation and with the
big batch it stands for, from the same start; these tests pin that the two
end with the same parameters, that training works, and what each example
adds (clipping logged in flax.linen, weighted ragged micro-batches in
equinox).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str, *requirements: str) -> ModuleType:
    """Imports examples/NAME.py (a script, not a package module)."""
    for requirement in requirements:
        pytest.importorskip(requirement)
    spec = importlib.util.spec_from_file_location(
        f"examples_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_trains(results: dict, prefixes: tuple[str, ...]) -> None:
    for prefix in prefixes:
        losses = results[f"{prefix}_losses"]
        assert losses[0] > 2.0, prefix  # about log(10) at initialization
        assert losses[-1] < 0.3, prefix
        assert results[f"{prefix}_accuracy"] > 0.9, prefix


def test_flax_nnx_optimizer_over_multisteps_matches_the_big_batch(capsys):
    example = load_example("flax_nnx", "flax.nnx", "sklearn")
    results = example.main()
    assert_trains(results, ("big_batch", "accumulated"))
    assert results["max_param_diff"] < 1e-5
    np.testing.assert_allclose(
        results["accumulated_losses"], results["big_batch_losses"], atol=1e-5
    )
    assert abs(results["accumulated_accuracy"] - results["big_batch_accuracy"]) < 0.01
    # nnx.Optimizer.step counts calls; MultiSteps counts optimizer updates.
    # Plus the end of the epoch: two micro-batches and their flushed window.
    assert results["optimizer_calls"] == example.K * example.UPDATES + 2
    assert results["gradient_steps"] == example.UPDATES + 1
    assert results["flushed_window_fill"] == 2
    assert "largest parameter difference" in capsys.readouterr().out


def test_flax_linen_train_state_logs_the_window_pre_clip_norm(capsys):
    example = load_example("flax_linen", "flax.linen", "sklearn")
    results = example.main()
    assert_trains(results, ("big_batch", "accumulated"))
    assert results["max_param_diff"] < 1e-5
    # The accumulated run clips the window's mean gradient: the norms it
    # logs are the big batch's, and clipping is active in about half the
    # updates (21 of 40 when measured).
    np.testing.assert_allclose(
        results["accumulated_pre_clip_norms"],
        results["big_batch_pre_clip_norms"],
        rtol=1e-5,
    )
    assert min(results["accumulated_pre_clip_norms"]) > 0.3
    assert max(results["accumulated_pre_clip_norms"]) < 1.0
    assert 10 <= results["accumulated_clipped_updates"] <= 30
    assert results["train_state_steps"] == example.K * example.UPDATES
    assert results["gradient_steps"] == example.UPDATES
    assert "updates clipped" in capsys.readouterr().out


def test_equinox_weighted_ragged_micro_batches_match_the_big_batch(capsys):
    example = load_example("equinox_mlp", "equinox", "sklearn")
    results = example.main()
    assert_trains(results, ("big_batch", "weighted", "unweighted"))
    # weight=n: the big-batch gradient, up to float32 rounding that adam
    # amplifies a little (5e-6 when measured).
    assert results["weighted_max_param_diff"] < 2e-5
    np.testing.assert_allclose(
        results["weighted_losses"], results["big_batch_losses"], atol=1e-4
    )
    # Unweighted: a mean of micro-batch means, a different trajectory
    # (0.31 when measured).
    assert results["unweighted_max_param_diff"] > 1e-2
    assert "weight=n" in capsys.readouterr().out
