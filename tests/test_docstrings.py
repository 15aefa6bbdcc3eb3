"""The package's docstring examples: each ``>>>`` example runs and prints
what it shows, and every name the API table writes with its call signature
(a function, or a class the user constructs) has one, as
docs/api_summary.md promises.

One case per docstring that holds examples (collected with doctest's
finder over every module of gradaccum_jax), so every case runs an example:
a module without one is no case, since it could only fail on an import.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re

import pytest

import gradaccum_jax
from helpers import api_table_entries, public_object

MODULES = [
    "gradaccum_jax",
    *sorted(
        info.name
        for info in pkgutil.walk_packages(gradaccum_jax.__path__, "gradaccum_jax.")
    ),
]


def docstring_examples() -> list[doctest.DocTest]:
    """Every docstring of the package that holds ``>>>`` examples, once (the
    finder lists an object under the module that defines it only)."""
    finder = doctest.DocTestFinder()
    tests = []
    for name in MODULES:
        module = importlib.import_module(name)
        tests += [test for test in finder.find(module) if test.examples]
    return sorted(tests, key=lambda test: test.name)


def promised_examples() -> list[str]:
    """The names the API table writes with their call signature: each one's
    docstring shows it at work in a ``>>>`` example. Names optax defines
    (re-exported as they are, `skip_not_finite`) keep optax's docstring."""
    names = [
        re.match(r"[\w.]+", entry).group()
        for entry in api_table_entries()
        if "(" in entry
    ]
    return [
        name
        for name in names
        if public_object(name).__module__.startswith("gradaccum_jax")
    ]


@pytest.mark.parametrize(
    "test",
    docstring_examples(),
    ids=lambda test: test.name.removeprefix("gradaccum_jax."),
)
def test_docstring_example_runs(test):
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    result = runner.run(test)
    assert result.failed == 0, f"{result.failed} example(s) of {test.name} failed"


def test_every_name_written_with_its_signature_has_an_example():
    without = [
        name
        for name in promised_examples()
        if ">>>" not in (inspect.getdoc(public_object(name)) or "")
    ]
    assert without == [], (
        f"docs/api_summary.md writes {without} with a call signature, the "
        "promise of a `>>>` example in each one's docstring, and they have none"
    )


def test_the_api_table_promises_examples():
    # The promise reads the table: a table that lost its signatures would
    # promise nothing and the check above would pass vacuously.
    assert len(promised_examples()) >= 20
