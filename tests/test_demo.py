"""The demo's claims, on short runs: same parameters, less memory."""

import pytest

from gradaccum_jax import demo


def test_accumulated_run_matches_the_big_batch_run(capsys):
    summary = demo.main(
        ["--steps", "30", "--hidden", "64", "--k", "4", "--no-progress"]
    )
    big, accumulated, ternary = (
        summary["big batch"],
        summary["MultiSteps, k=4"],
        summary["ternary_accumulate, k=4"],
    )
    assert accumulated["max_param_diff"] < 1e-5
    assert abs(big["accuracy"] - accumulated["accuracy"]) < 0.01
    assert big["accuracy"] > 0.85
    assert ternary["accuracy"] > 0.75  # learns; bench_ternary.py pins accuracy
    assert accumulated["grad_temp_bytes"] < 0.5 * big["grad_temp_bytes"]
    printed = capsys.readouterr().out
    assert "| MultiSteps, k=4 | 32 |" in printed
    assert "| ternary_accumulate, k=4 | 32 |" in printed


def test_data_parallel_run_with_clipping_matches_the_big_batch_run():
    summary = demo.main(
        [
            "--steps",
            "20",
            "--hidden",
            "32",
            "--k",
            "2",
            "--devices",
            "4",
            "--clip",
            "1.0",
            "--no-ternary",
            "--no-progress",
        ]
    )
    assert list(summary) == ["big batch", "MultiSteps, k=2, 4 devices"]
    assert summary["MultiSteps, k=2, 4 devices"]["max_param_diff"] < 1e-5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--k", "0"], "--k must be >= 1"),
        (["--micro-batch", "30", "--devices", "4"], "must be a multiple of"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.main(argv)
    assert message in capsys.readouterr().err
