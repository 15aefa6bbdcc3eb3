"""The public surface in three layers, each name in exactly one.

The top level holds what a user trains with; `gradaccum_jax.extend` the
accumulation engine's extension protocols and the parts' state types;
`gradaccum_jax.measure` what reads compiled programs and states. The lists
below are the surface: a name added, moved or removed changes one of them
on purpose, and no moved name stays behind as an alias. The scripts,
notebooks and guides use, and the docs and docstrings name, public names
only (read with ``ast`` and from the text: a stale name there imports or
renders nowhere else the tests look).
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import re
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
    "compressed_average_across_devices",
    "compressed_window_reduction",
    "diloco",
    "global_norm",
    "local_value_and_grad",
    "microbatched_value_and_grad",
    "skip_large_updates",
    "skip_not_finite",
    "stack_workers",
    "state_shardings",
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_dequantize",
    "ternary_quantize",
    "ternary_window_reduction",
    "worker_value_and_grad",
]

SUBMODULES = {
    "codecs": ["powersgd", "quantized", "ternary", "topk"],
    "extend": [
        "Codec",
        "CodecState",
        "CodecSum",
        "NoiseScaleState",
        "RunningMean",
        "TermsLayout",
        "TernaryAccumulatorState",
        "WindowAccumulator",
        "WindowPosition",
        "WindowReduction",
        "WindowStatistic",
        "Wire",
        "float_accumulator",
        "made_after",
    ],
    "measure": [
        "AllReduce",
        "Collective",
        "StepTraffic",
        "all_reduce_nbytes",
        "all_reduces",
        "collectives",
        "state_nbytes",
        "step_traffic",
    ],
}


def test_the_top_level_exports_what_a_user_trains_with():
    assert len(TOP_LEVEL) == 33
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


# --- every use outside the package names a public name ---------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Not the public surface, but names a script may read: the version, the
# demo's module (python -m gradaccum_jax.demo).
ALSO_PUBLIC = {"__version__", "demo"}


def _python_sources() -> dict[str, str]:
    """The Python the project shows its users, by file (a notebook's code
    cells, shell and magic lines left out; a guide's ``python`` blocks)."""
    sources = {}
    for path in sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")]):
        sources[str(path.relative_to(ROOT))] = path.read_text()
    for path in sorted(ROOT.glob("notebooks/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        lines = [
            line
            for cell in cells
            if cell["cell_type"] == "code"
            for line in "".join(cell["source"]).splitlines()
            if not line.lstrip().startswith(("%", "!"))
        ]
        sources[str(path.relative_to(ROOT))] = "\n".join(lines)
    for path in sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")]):
        blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)
        for number, block in enumerate(blocks):
            sources[f"{path.relative_to(ROOT)} (python block {number})"] = block
    return sources


def package_uses(source: str) -> set[str]:
    """The names below ``gradaccum_jax`` a Python source uses, qualified as
    `helpers.public_names` (``MultiSteps``, ``extend.WindowStatistic``):
    what it imports from the package, and each attribute chain read from a
    name bound to the package or to one of its submodules."""
    tree = ast.parse(source)
    bound: dict[str, list[str]] = {}  # local name -> its path below the package
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                path = alias.name.split(".")
                if path[0] == "gradaccum_jax":
                    bound[alias.asname or "gradaccum_jax"] = (
                        path[1:] if alias.asname else []
                    )
                    uses.add(".".join(path[1:]))
        elif isinstance(node, ast.ImportFrom) and node.module:
            path = node.module.split(".")
            if path[0] == "gradaccum_jax" and node.level == 0:
                for alias in node.names:
                    bound[alias.asname or alias.name] = [*path[1:], alias.name]
                    uses.add(".".join([*path[1:], alias.name]))
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in bound:
            uses.add(".".join([*bound[node.id], *chain]))
    return {use for use in uses if use}


def is_public(qualified: str) -> bool:
    """Whether a used name (or an attribute of one) is public: a top-level
    name, a public submodule or one of its names."""
    first, *rest = qualified.split(".")
    if first in gradaccum_jax.__all__ or first in ALSO_PUBLIC:
        return True
    if first in PUBLIC_SUBMODULES:
        return not rest or rest[0] in getattr(gradaccum_jax, first).__all__
    return first.startswith("_")  # a private module, read on purpose


SOURCES = _python_sources()


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_scripts_notebooks_and_guides_use_only_public_names(name):
    uses = package_uses(SOURCES[name])
    assert sorted(use for use in uses if not is_public(use)) == []


def written_references(text: str) -> list[str]:
    """The names a text refers to as ``gradaccum_jax.X`` in backticks (a
    docstring's reference, a guide's ``{py:class}`` role), below the
    package."""
    return re.findall(r"`gradaccum_jax\.([\w.]+)`", text)


def test_docs_and_docstrings_refer_to_public_names():
    # A reference to a moved name still renders, as plain text: only this
    # check notices it.
    paths = [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("docs/*.rst"),
        *ROOT.glob("gradaccum_jax/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("examples/*.py"),
    ]
    stale = [
        f"{path.relative_to(ROOT)}: gradaccum_jax.{name}"
        for path in paths
        if "docs/notebooks" not in path.as_posix()  # copies of notebooks/
        for name in written_references(path.read_text())
        if not is_public(name)
    ]
    assert stale == []


def test_the_use_check_reads_imports_aliases_and_chains():
    source = (
        "import gradaccum_jax as ga\n"
        "from gradaccum_jax import MultiSteps, WindowStatistic\n"
        "from gradaccum_jax.measure import state_nbytes\n"
        "from gradaccum_jax import extend\n"
        "ga.extend.WindowReduction; ga.float_accumulator(); extend.RunningMean\n"
        "ga.MultiSteps(1, 2).init; ga.measure.all_reduces\n"
    )
    uses = package_uses(source)
    assert sorted(use for use in uses if not is_public(use)) == [
        "WindowStatistic",
        "float_accumulator",
    ]
    assert {"extend.RunningMean", "measure.state_nbytes", "MultiSteps"} <= uses
    references = written_references(
        "a `gradaccum_jax.WindowStatistic`; "
        "{py:class}`gradaccum_jax.extend.RunningMean`"
    )
    assert [name for name in references if not is_public(name)] == ["WindowStatistic"]
