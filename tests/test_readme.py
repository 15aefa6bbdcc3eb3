"""The README and the docs pages are true as written.

Their ```python blocks run, in order, as one script in a fresh interpreter
(a new user copying the page top to bottom): the README's Quickstart, and
every page of docs/ and docs/guides/ (where the longer examples live). The
API table of docs/api_summary.md gives each public name's real signature,
and the README's links lead to files of the repository.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax.numpy as jnp
import pytest
from packaging.requirements import Requirement

from helpers import api_table_entries, public_names, public_object

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS_PAGES = sorted(
    [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guides").glob("*.md")]
)
RUN_TIMEOUT_S = 240

_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: pathlib.Path) -> list[str]:
    return _BLOCK.findall(page.read_text())


def run_blocks(page: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Runs the page's python blocks as one script; fails naming the block."""
    blocks = python_blocks(page)
    script = tmp_path / "page.py"
    first_lines = []  # 1-based line of each block's first line in the script
    text = ""
    for block in blocks:
        first_lines.append(text.count("\n") + 1)
        text += block + "\n"
    script.write_text(text)
    env = dict(os.environ)
    # As the page tells a reader on a CPU: 8 emulated devices, set in the
    # environment before Python starts; with them the suite's flags that
    # make compiling cheaper (tests/conftest.py), which change nothing the
    # pages print or assert on.
    env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
        env=env,
    )
    if result.returncode != 0:
        lines = re.findall(
            rf'File "{re.escape(str(script))}", line (\d+)', result.stderr
        )
        block = "?"
        if lines:
            line = int(lines[-1])
            block = str(sum(first <= line for first in first_lines))
        pytest.fail(
            f"{page.relative_to(ROOT)}: python block {block} of {len(blocks)} "
            f"raised:\n{result.stderr[-4000:]}"
        )


def test_readme_python_blocks_run_top_to_bottom(tmp_path):
    # The front door holds the Quickstart; the other examples are on the
    # docs pages, run by the next test.
    blocks = python_blocks(README)
    assert len(blocks) == 1
    text = README.read_text()
    assert text.index("## Quickstart") < text.index("```python")
    run_blocks(README, tmp_path)


@pytest.mark.parametrize(
    "page",
    [p for p in DOCS_PAGES if python_blocks(p)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_docs_page_python_blocks_run_top_to_bottom(page, tmp_path):
    run_blocks(page, tmp_path)


def test_quickstart_configures_no_devices():
    blocks = python_blocks(README)
    assert "jax_num_cpu_devices" not in blocks[0]
    assert "XLA_FLAGS" not in blocks[0]


@pytest.mark.parametrize(
    "page",
    [p for p in [README, *DOCS_PAGES] if "jax.make_mesh(" in p.read_text()],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_mesh_examples_say_how_to_get_devices_before_the_first_mesh(page):
    text = page.read_text()
    first_mesh = text.index("jax.make_mesh(")
    assert text.index("XLA_FLAGS=--xla_force_host_platform_device_count=8") < first_mesh


def test_a_page_shows_a_mesh_example():
    # The parametrized test above must not pass by finding no page.
    assert any("jax.make_mesh(" in page.read_text() for page in DOCS_PAGES)


# --- the README's links ----------------------------------------------------


def readme_link_targets() -> list[str]:
    """The relative targets of the README's markdown links, without anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    return sorted(
        {
            target.split("#")[0]
            for target in targets
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")
        }
    )


def test_readme_links_lead_to_files_in_the_repository():
    missing = [
        target for target in readme_link_targets() if not (ROOT / target).exists()
    ]
    assert missing == []


def test_readme_links_every_guide():
    guides = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "docs" / "guides").glob("*.md")
    )
    assert sorted(set(guides) - set(readme_link_targets())) == []


# --- the README's commands and notebooks -----------------------------------


def readme_commands() -> list[str]:
    """The commands of the README's first bash block, comments dropped."""
    block = re.search(r"^```bash\n(.*?)^```$", README.read_text(), re.S | re.M)
    lines = block.group(1).splitlines()
    return [line.split("#")[0].strip() for line in lines if line.strip()]


def _distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_distributions(extra: str) -> set[str]:
    """What ``pip install ".[extra]"`` installs from pyproject.toml's lists
    (the core dependencies too), its own extras expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for line in project["dependencies"] + project["optional-dependencies"][extra]:
        requirement = Requirement(line)
        if _distribution(requirement.name) == _distribution(project["name"]):
            for inner in requirement.extras:
                names |= extra_distributions(inner)
        else:
            names.add(_distribution(requirement.name))
    return names


def demo_imports() -> set[str]:
    """The distributions of the third-party modules gradaccum_jax.demo imports."""
    tree = ast.parse((ROOT / "gradaccum_jax" / "demo.py").read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    modules -= {*sys.stdlib_module_names, "__future__", "gradaccum_jax"}
    installed = importlib.metadata.packages_distributions()
    return {_distribution(installed.get(m, [m])[0]) for m in modules}


def test_readme_demo_command_installs_what_the_demo_imports_and_no_dev_tools():
    install, run = readme_commands()[0].split(" && ")
    assert run == "python -m gradaccum_jax.demo"
    extra = re.fullmatch(r'pip install -e "\.\[(\w+)\]"', install).group(1)
    installed = extra_distributions(extra)
    assert {"scikit-learn", "tqdm"} <= demo_imports()  # the parse finds them
    assert sorted(demo_imports() - installed) == []
    # A newcomer running the demo needs no test, docs or release tooling.
    assert sorted(installed & {"pytest", "sphinx", "mypy", "twine", "build"}) == []


def test_readme_test_command_installs_the_dev_extra():
    assert readme_commands()[1] == 'pip install -e ".[dev]" && pytest'
    assert "pytest" in extra_distributions("dev")


def test_readme_notebook_table_lists_every_notebook_with_its_colab_badge():
    text = README.read_text()
    colab = "https://colab.research.google.com/github/gradaccum-jax/gradaccum_jax"
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        row = next(
            (
                line
                for line in text.splitlines()
                if f"](notebooks/{notebook.name})" in line
            ),
            None,
        )
        assert row is not None, f"{notebook.name} is not in the README's table"
        assert f"({colab}/blob/main/notebooks/{notebook.name})" in row


# --- the API table ---------------------------------------------------------


def written_signature(entry: str) -> tuple[str, list[tuple[str, str, str | None]]]:
    """``name(args)`` as written: (name, [(param, kind, default source)]);
    the name qualified as `public_names` (``measure.collectives``)."""
    name, arguments = entry.split("(", 1)
    function = ast.parse(f"def signature({arguments}: pass").body[0]
    args = function.args
    params = [(a.arg, "POSITIONAL_OR_KEYWORD") for a in args.args]
    defaults = [None] * (len(args.args) - len(args.defaults)) + args.defaults
    params = [(a, k, d) for (a, k), d in zip(params, defaults, strict=True)]
    params += [
        (a.arg, "KEYWORD_ONLY", d)
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    return name, [(a, k, None if d is None else ast.unparse(d)) for a, k, d in params]


def test_api_table_names_every_public_name():
    names = {re.match(r"[\w.]+", entry).group() for entry in api_table_entries()}
    assert sorted(set(public_names()) - names) == []
    assert sorted(names - set(public_names())) == []


@pytest.mark.parametrize(
    "entry", [e for e in api_table_entries() if "(" in e], ids=lambda e: e[:40]
)
def test_api_table_signature_is_the_real_one(entry):
    name, written = written_signature(entry)
    real = inspect.signature(public_object(name)).parameters.values()
    assert [(p.name, p.kind.name) for p in real] == [(a, k) for a, k, _ in written]
    for param, (_, _, default) in zip(real, written, strict=True):
        if param.default is inspect.Parameter.empty:
            assert default is None, f"{name}: `{param.name}` has no default"
        else:
            assert default is not None, f"{name}: `{param.name}` has a default"
            value = eval(default, {"jnp": jnp})  # noqa: S307 - the table's text
            assert value is param.default or value == param.default, (
                f"{name}: `{param.name}` defaults to {param.default!r}, the "
                f"API table says {default}"
            )
