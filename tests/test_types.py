"""The package passes mypy with the configuration in pyproject.toml.

The configuration checks the bodies of unannotated functions too
(``check_untyped_defs``); the second test pins that it does, on a function
with a type error and no annotations.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("mypy")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )


def test_package_passes_mypy():
    result = mypy("gradaccum_jax")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found"), result.stdout


def test_mypy_checks_the_bodies_of_unannotated_functions(tmp_path):
    module = tmp_path / "untyped.py"
    module.write_text("def f():\n    return 1 + 'a'\n")
    result = mypy(str(module))
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'Unsupported operand types for + ("int" and "str")' in result.stdout
