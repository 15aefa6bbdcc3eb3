"""The demo's claims, on a short run: same parameters, less memory."""

from gradaccum_jax import demo


def test_accumulated_run_matches_the_big_batch_run(capsys):
    results = demo.main(["--steps", "30", "--hidden", "64", "--k", "4"])
    assert results["max_param_diff"] < 1e-5
    assert abs(results["big_batch_accuracy"] - results["accumulated_accuracy"]) < 0.01
    assert results["big_batch_accuracy"] > 0.85
    assert results["micro_batch_temp_bytes"] < 0.5 * results["big_batch_temp_bytes"]
    printed = capsys.readouterr().out
    assert "| MultiSteps, k=4 | 32 |" in printed
    assert "largest parameter difference between the runs" in printed
