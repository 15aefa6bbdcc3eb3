"""Every ``>>>`` example in the package's docstrings runs and prints what it
shows (doctest over every module of gradaccum_jax)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradaccum_jax

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(gradaccum_jax.__path__, "gradaccum_jax.")
)


@pytest.mark.parametrize("name", ["gradaccum_jax", *MODULES])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False,
        report=True,
    )
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"


def test_the_package_has_docstring_examples():
    attempted = 0
    for name in MODULES:
        finder = doctest.DocTestFinder()
        module = importlib.import_module(name)
        attempted += sum(len(t.examples) for t in finder.find(module))
    assert attempted > 0
