"""The sdist and the wheel build, pass `twine check`, and the wheel works.

The wheel is installed (not editable, without dependencies) into a fresh
virtual environment that then borrows the packages of the interpreter
running the tests (jax and optax are not downloaded again), and used from a
directory outside the source tree: every public name imports from the
installed copy, the metadata version is ``__version__``, and the demo's
command line starts. Builds run without isolation, with the setuptools the
dev extra installs, so no network is needed; together this takes about 20 s.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile

import pytest
from packaging.requirements import Requirement

import gradaccum_jax
from helpers import PUBLIC_SUBMODULES

pytest.importorskip("build")
pytest.importorskip("twine")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLOOR_PINS = ROOT / ".ci" / "floor_pins.py"
TIMEOUT_S = 120
# Run by the installed wheel's interpreter; SUBMODULES is PUBLIC_SUBMODULES.
PROBE = """
import importlib, importlib.metadata, json, sys
import gradaccum_jax
missing = [name for name in gradaccum_jax.__all__ if not hasattr(gradaccum_jax, name)]
for submodule in SUBMODULES:
    module = importlib.import_module("gradaccum_jax." + submodule)
    missing += [
        f"{submodule}.{name}" for name in module.__all__ if not hasattr(module, name)
    ]
from gradaccum_jax import *
print(json.dumps({
    "file": gradaccum_jax.__file__,
    "version": gradaccum_jax.__version__,
    "metadata_version": importlib.metadata.version("gradaccum-jax"),
    "missing": missing,
    "star_imported": sorted(set(gradaccum_jax.__all__) & set(globals())),
}))
""".replace("SUBMODULES", repr(PUBLIC_SUBMODULES))


def clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH: only the venv decides what imports."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# What a build does not read: version control, virtual environments, caches
# and earlier build outputs.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "venv", ".*_cache", ".hypothesis", "__pycache__",
    "*.egg-info", "build", "dist", ".ipynb_checkpoints",
)  # fmt: skip


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    """An sdist and a wheel built from the sdist, as `python -m build` makes them.

    Built from a copy of the source tree: a build writes into the tree it
    runs in (egg-info, and the sdist's staging directory, removed when
    done), and two builds in one tree at once, from two test processes,
    delete each other's files.
    """
    source = tmp_path_factory.mktemp("source") / "gradaccum_jax"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    out = tmp_path_factory.mktemp("dist")
    run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)],
        cwd=source,
    )
    return out


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(python of a fresh venv holding the wheel, a directory outside the tree)."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    (wheel,) = dist.glob("*.whl")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        env=clean_env(),
    )
    purelib = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        env=clean_env(),
    ).stdout.strip()
    borrow_site_packages(pathlib.Path(purelib) / "_borrowed_site_packages.pth")
    outside = tmp_path_factory.mktemp("elsewhere")
    return python, outside


def borrow_site_packages(pth: pathlib.Path) -> None:
    """Lets the venv import this interpreter's installed packages (jax, optax).

    Not ``system_site_packages=True``: that lends the base interpreter's
    packages, which, when the tests run in a virtualenv, are not the ones
    installed for them. A ``.pth`` file's lines are appended to ``sys.path``
    after the venv's own site-packages, so the wheel's copy is the one
    imported; and a plain directory line does not run that directory's own
    ``.pth`` files, so an editable install of the source tree stays out.
    """
    dirs = site.getsitepackages()
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    pth.write_text("".join(f"{path}\n" for path in dirs if os.path.isdir(path)))


def test_sdist_and_wheel_are_built_with_the_package_and_license(dist):
    version = gradaccum_jax.__version__
    assert sorted(path.name for path in dist.iterdir()) == [
        f"gradaccum_jax-{version}-py3-none-any.whl",
        f"gradaccum_jax-{version}.tar.gz",
    ]
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gradaccum_jax/__init__.py" in names
    assert "gradaccum_jax/_ternary/_accumulator.py" in names
    assert "gradaccum_jax/py.typed" in names
    assert f"gradaccum_jax-{version}.dist-info/licenses/LICENSE" in names
    assert not [name for name in names if name.startswith("tests/")]
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
    for name in ("LICENSE", "README.md", "pyproject.toml", "gradaccum_jax/demo.py"):
        assert f"gradaccum_jax-{version}/{name}" in members


def test_wheel_metadata(dist):
    (wheel,) = dist.glob("*.whl")
    version = gradaccum_jax.__version__
    metadata = (
        zipfile.ZipFile(wheel)
        .read(f"gradaccum_jax-{version}.dist-info/METADATA")
        .decode()
    )
    assert "Name: gradaccum-jax\n" in metadata
    assert f"Version: {version}\n" in metadata
    assert "License-Expression: Apache-2.0\n" in metadata
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = [
        line.removeprefix("Requires-Dist: ")
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
    # The wheel writes a requirement's bounds in its own order.
    assert list(map(Requirement, required)) == list(
        map(Requirement, declared["dependencies"])
    )
    assert "Description-Content-Type: text/markdown\n" in metadata


def test_floor_pins_pin_each_core_dependency_at_its_declared_floor():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    result = run([sys.executable, str(FLOOR_PINS)])
    assert result.stdout.split() == [
        requirement.replace(">=", "==").split(",")[0]
        for requirement in declared["dependencies"]
    ]


def test_floor_pins_keep_the_floor_of_a_dependency_with_a_ceiling(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["jax >= 0.10.2, < 0.11"]\n')
    result = run([sys.executable, str(FLOOR_PINS), str(pyproject)])
    assert result.stdout.split() == ["jax==0.10.2"]


def test_floor_pins_reject_a_core_dependency_without_one_floor(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["jax>=0.10.2", "optax<0.3"]\n')
    result = subprocess.run(
        [sys.executable, str(FLOOR_PINS), str(pyproject)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 1
    assert "core dependency 'optax<0.3' is not of the form 'name>=version' or " in (
        result.stderr
    )
    assert result.stdout == ""


def test_twine_check_passes(dist):
    result = run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            *map(str, sorted(dist.iterdir())),
        ]
    )
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_installed_wheel_imports_every_public_name(installed):
    python, outside = installed
    result = run([str(python), "-c", PROBE], cwd=outside, env=clean_env())
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    env_dir = python.parent.parent.resolve()
    assert pathlib.Path(probe["file"]).resolve().is_relative_to(env_dir), probe
    assert probe["version"] == gradaccum_jax.__version__
    assert probe["metadata_version"] == probe["version"]
    assert probe["missing"] == []
    assert probe["star_imported"] == sorted(gradaccum_jax.__all__)


def test_installed_demo_command_line_starts(installed):
    python, outside = installed
    result = run(
        [str(python), "-m", "gradaccum_jax.demo", "--help"],
        cwd=outside,
        env=clean_env(),
    )
    assert result.stdout.startswith("usage: ")
    for option in ("--k", "--micro-batch", "--clip", "--no-ternary", "--devices"):
        assert option in result.stdout
