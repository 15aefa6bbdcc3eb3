"""The documentation site (docs/) builds with Sphinx, warnings as errors.

The build renders the committed notebooks without executing them and
generates the API reference from the docstrings; it takes about 20 s. The
API page must document every public name: ``gradaccum_jax.__all__`` and
its public submodules' (``gradaccum_jax.extend``, ``gradaccum_jax.measure``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from helpers import public_names

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> pathlib.Path:
    """The site built into a fresh directory; the build's output on failure."""
    out = tmp_path_factory.mktemp("html")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-E",
            "-b",
            "html",
            "-d",
            str(out / ".doctrees"),
            str(DOCS),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return out


def documented_names(api: str) -> list[str]:
    """The names of the API page's directives, qualified as `public_names`."""
    module, names = "gradaccum_jax", []
    for line in api.splitlines():
        if current := re.fullmatch(r"\.\. currentmodule:: ([\w.]+)", line):
            module = current.group(1)
        elif directive := re.fullmatch(r"\.\. auto(?:function|class):: (\w+)", line):
            qualified = f"{module}.{directive.group(1)}"
            names.append(qualified.removeprefix("gradaccum_jax."))
    return names


def test_api_page_has_a_directive_for_every_public_name():
    documented = documented_names((DOCS / "api.rst").read_text())
    assert sorted(documented) == sorted(public_names())


def test_built_api_page_documents_every_public_name(html):
    page = (html / "api.html").read_text()
    for name in public_names():
        assert f'id="gradaccum_jax.{name}"' in page, name
    # Google-style sections are rendered (napoleon), not shown as text.
    assert "Args:" not in page
    assert "Parameters" in page


def test_every_page_is_built(html):
    for page in (
        "index",
        "getting_started",
        "architecture",
        "benchmarks",
        "changelog",
        "guides/accumulation",
        "guides/clipping",
        "guides/data_parallel",
        "guides/microbatching",
        "guides/ternary",
        "guides/noise_scale",
        "guides/nonfinite",
        "guides/checkpoints",
        "guides/frameworks",
        "api_summary",
        "guides/low_communication",
    ):
        assert (html / f"{page}.html").is_file(), page
    assert "Unreleased" in (html / "changelog.html").read_text()
    assert "The accumulation engine" in (html / "architecture.html").read_text()
    assert "benchmarks/run_all.py" in (html / "benchmarks.html").read_text()


def test_reference_moved_out_of_the_readme_is_rendered(html):
    # The README is the front door; its former reference sections live here.
    benchmarks = (html / "benchmarks.html").read_text()
    for command in ("bench_accumulation.py", "bench_microbatch.py", "bench_network.py"):
        assert command in benchmarks, command
    assert 'src="_images/network.png"' in benchmarks
    assert "<table" in (html / "api_summary.html").read_text()
    assert "skip_not_finite" in (html / "guides" / "nonfinite.html").read_text()
    assert (
        "set_requires_gradient_sync"
        in (html / "guides" / "data_parallel.html").read_text()
    )
    assert "--no-ternary" in (html / "getting_started.html").read_text()


@pytest.mark.parametrize(
    "path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem
)
def test_notebooks_are_rendered_with_their_saved_outputs(html, path):
    page = (html / "notebooks" / f"{path.stem}.html").read_text()
    # The committed plots, not re-executed: myst-nb writes them as images.
    assert re.search(r'<img alt="[^"]*" src="\.\./_images/', page), path.stem
