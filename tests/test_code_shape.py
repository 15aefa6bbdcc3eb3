"""The package keeps sizes a reader can hold: no module over 500 lines, no
function or method (nested ones included, from ``def`` to its last line, its
docstring left out) over 80 lines, no class body over 300 lines, and no
import cycle among its modules or among its parts (a subpackage, or a
top-level module, taken as a whole). Read from the source with ``ast``;
nothing is imported.

A function's docstring does not count against it: the limit is on how much
logic one function holds, and a public function's docstring (its Args, its
runnable example, which `test_docstrings` asks for) grows with the care put
into documenting it, not with the ideas in its body. Modules and classes
count every line."""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import pytest

PACKAGE = "gradaccum_jax"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def module_paths(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package under ``package_dir``, by dotted name
    (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, from ``def`` to its last line, less its docstring."""
    first = node.body[0]
    is_docstring = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    return _lines(node) - (_lines(first) if is_docstring else 0)


def size_violations(path: pathlib.Path, label: str) -> list[str]:
    """What in the module at ``path`` is over its size limit, one line each,
    naming ``label`` (the file), the object and its size."""
    source = path.read_text()
    found = []
    module_lines = len(source.splitlines())
    if module_lines > MAX_MODULE_LINES:
        found.append(
            f"{label}: module is {module_lines} lines (limit {MAX_MODULE_LINES})"
        )

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                if _function_lines(child) > MAX_FUNCTION_LINES:
                    found.append(
                        f"{label}: function {name} (line {child.lineno}) is "
                        f"{_function_lines(child)} lines (limit "
                        f"{MAX_FUNCTION_LINES})"
                    )
                name += "."
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                if _lines(child) > MAX_CLASS_LINES:
                    found.append(
                        f"{label}: class {name} (line {child.lineno}) is "
                        f"{_lines(child)} lines (limit {MAX_CLASS_LINES})"
                    )
                name += "."
            visit(child, name)

    visit(ast.parse(source, filename=str(path)), "")
    return found


def _imported_modules(
    tree: ast.Module, module: str, is_package: bool, known: set[str]
) -> set[str]:
    """The package modules that ``module`` imports anywhere in its source
    (inside functions and ``if TYPE_CHECKING:`` too).

    ``from a import b`` names the module ``a.b`` when that is a module, else
    ``a`` itself; relative imports are resolved against ``module``'s package.
    Parent packages that Python also runs on the way are not counted: every
    submodule import would otherwise be an edge to the package's
    ``__init__``.
    """
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                imported.add(submodule if submodule in known else source)
    return {name for name in imported if name in known and name != module}


def import_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = module_paths(package_dir)
    known = set(modules)
    return {
        module: _imported_modules(
            ast.parse(path.read_text(), filename=str(path)),
            module,
            path.name == "__init__.py",
            known,
        )
        for module, path in modules.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that is on a cycle, each as a
    path that starts and ends at the same module; each cycle listed once."""
    cycles, seen = [], set()
    for start in sorted(graph):
        # Breadth-first from start's imports back to start: the shortest cycle.
        parents = {start: None}
        frontier = [start]
        closing = None
        while frontier and closing is None:
            next_frontier = []
            for module in frontier:
                for target in sorted(graph[module]):
                    if target == start:
                        closing = module
                        break
                    if target not in parents:
                        parents[target] = module
                        next_frontier.append(target)
                if closing is not None:
                    break
            frontier = next_frontier
        if closing is None:
            continue
        path = [closing]
        while path[-1] != start:
            path.append(parents[path[-1]])
        path.reverse()
        key = frozenset(path)
        if key not in seen:
            seen.add(key)
            cycles.append([*path, start])
    return cycles


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen part by part: each module stands for the part
    of the package it belongs to (its subpackage, or itself for a
    top-level module), an edge where a module of one part imports one of
    another. The package's own ``__init__`` (the public names, importing
    every part) is left out. Importing a submodule runs its package's
    ``__init__`` too, so a cycle between parts is a cycle Python meets
    even where no two modules import each other."""
    root = next(name for name in graph if "." not in name)

    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: dict[str, set[str]] = {}
    for module, imports in graph.items():
        if module == root:
            continue
        edges = parts.setdefault(part(module), set())
        edges.update(part(m) for m in imports if m != root and part(m) != part(module))
    return parts


MODULES = module_paths(PACKAGE_DIR)


@pytest.mark.parametrize(
    "path",
    MODULES.values(),
    ids=[str(p.relative_to(PACKAGE_DIR.parent)) for p in MODULES.values()],
)
def test_module_function_and_class_sizes(path):
    label = str(path.relative_to(PACKAGE_DIR.parent))
    found = size_violations(path, label)
    assert not found, "\n".join(found)


def test_no_import_cycle_among_package_modules():
    cycles = import_cycles(import_graph(PACKAGE_DIR))
    assert not cycles, "\n".join("import cycle: " + " -> ".join(c) for c in cycles)


def test_no_import_cycle_among_package_parts():
    cycles = import_cycles(package_graph(import_graph(PACKAGE_DIR)))
    assert not cycles, "\n".join("import cycle: " + " -> ".join(c) for c in cycles)


def test_the_part_graph_layers_compression_below_the_codecs():
    parts = package_graph(import_graph(PACKAGE_DIR))
    assert "gradaccum_jax._compression" in parts["gradaccum_jax._codecs"]
    assert "gradaccum_jax._codecs" in parts["gradaccum_jax._ternary"]
    assert "gradaccum_jax._compression" in parts["gradaccum_jax._diloco"]
    assert "gradaccum_jax._codecs" not in parts["gradaccum_jax._diloco"]


def test_the_graph_sees_the_package_imports():
    # The cycle test would pass on an empty graph: pin a few known edges.
    graph = import_graph(PACKAGE_DIR)
    assert "gradaccum_jax._tree" in graph["gradaccum_jax._microbatching._scan"]
    assert "gradaccum_jax._checks" in graph["gradaccum_jax._averaging"]
    assert "gradaccum_jax._microbatching" in graph["gradaccum_jax"]


def _write(root: pathlib.Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def test_the_checker_catches_oversized_objects(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    _write(
        tmp_path,
        "pkg/big.py",
        "def outer():\n"
        "    def inner():\n"
        + "".join("    " + line + "\n" for line in body.splitlines())
        + "    return inner\n"
        "\n"
        "class Small:\n"
        "    def fine(self):\n"
        "        return 1\n",
    )
    found = size_violations(tmp_path / "pkg/big.py", "pkg/big.py")
    assert found == [
        "pkg/big.py: function outer (line 1) is 83 lines (limit 80)",
        "pkg/big.py: function outer.inner (line 2) is 81 lines (limit 80)",
    ]
    # A docstring does not count; the code after it does.
    docstring = '    """' + "Documented.\n" * 100 + '    """\n'
    _write(
        tmp_path,
        "pkg/documented.py",
        "def short():\n" + docstring + "    return 1\n\n"
        "def long():\n" + docstring + "    x = 0\n" * 80 + "    return x\n",
    )
    assert size_violations(tmp_path / "pkg/documented.py", "pkg/documented.py") == [
        "pkg/documented.py: function long (line 105) is 82 lines (limit 80)"
    ]
    methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(160))
    _write(tmp_path, "pkg/wide.py", "class Wide:\n" + methods)
    assert size_violations(tmp_path / "pkg/wide.py", "pkg/wide.py") == [
        "pkg/wide.py: class Wide (line 1) is 321 lines (limit 300)"
    ]
    _write(tmp_path, "pkg/long.py", "x = 1\n" * (MAX_MODULE_LINES + 1))
    assert size_violations(tmp_path / "pkg/long.py", "pkg/long.py") == [
        "pkg/long.py: module is 501 lines (limit 500)"
    ]


def test_the_checker_catches_an_import_cycle(tmp_path):
    _write(tmp_path, "pkg/__init__.py", "from pkg._a import a\n")
    _write(tmp_path, "pkg/_a.py", "from pkg import _b\n\ndef a():\n    return _b\n")
    _write(
        tmp_path,
        "pkg/_b.py",
        "def b():\n    from ._sub._c import c\n    return c\n",
    )
    _write(tmp_path, "pkg/_sub/__init__.py", "")
    _write(tmp_path, "pkg/_sub/_c.py", "from .. import _a\n\nc = 1\n")
    _write(tmp_path, "pkg/_d.py", "import pkg._a\nimport typing\n")
    graph = import_graph(tmp_path / "pkg")
    assert graph == {
        "pkg": {"pkg._a"},
        "pkg._a": {"pkg._b"},
        "pkg._b": {"pkg._sub._c"},
        "pkg._sub": set(),
        "pkg._sub._c": {"pkg._a"},
        "pkg._d": {"pkg._a"},
    }
    assert import_cycles(graph) == [["pkg._a", "pkg._b", "pkg._sub._c", "pkg._a"]]
    # Breaking one edge breaks the cycle.
    _write(tmp_path, "pkg/_sub/_c.py", "c = 1\n")
    assert import_cycles(import_graph(tmp_path / "pkg")) == []


def test_the_checker_catches_a_cycle_between_parts(tmp_path):
    # No two modules import each other, but _sub/_c imports _a, and _a
    # imports _sub/_e: the parts _a and _sub form a cycle.
    _write(tmp_path, "pkg/__init__.py", "from pkg._a import a\n")
    _write(tmp_path, "pkg/_a.py", "from pkg._sub import _e\n\na = 1\n")
    _write(tmp_path, "pkg/_sub/__init__.py", "")
    _write(tmp_path, "pkg/_sub/_c.py", "from pkg import _a\n")
    _write(tmp_path, "pkg/_sub/_e.py", "e = 1\n")
    graph = import_graph(tmp_path / "pkg")
    assert import_cycles(graph) == []
    parts = package_graph(graph)
    assert parts == {"pkg._a": {"pkg._sub"}, "pkg._sub": {"pkg._a"}}
    assert import_cycles(parts) == [["pkg._a", "pkg._sub", "pkg._a"]]


# Jaxpr equation parameters a JAX release renamed: a test reading one by its
# old name fails on the new release (0.11 replaced the scan's num_consts and
# num_carry with the flat trees ft_in and ft_out). Read them through
# `helpers.scan_carries`, which knows both.
RENAMED_JAXPR_PARAMS = ("num_consts", "num_carry")


def renamed_param_reads(root: pathlib.Path) -> list[str]:
    """``file:line`` of every read of a renamed jaxpr parameter under
    ``root``'s package, tests and benchmarks, but for the one reader (and
    this checker's own test of itself)."""
    found = []
    for folder in (PACKAGE, "tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if folder == "tests" and path.name in (
                "helpers.py",
                pathlib.Path(__file__).name,
            ):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if any(
                    re.search(rf"""(\[|\.get\()\s*["']{name}["']""", line)
                    for name in RENAMED_JAXPR_PARAMS
                ):
                    found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_nothing_reads_a_renamed_jaxpr_parameter_but_the_helper():
    assert renamed_param_reads(PACKAGE_DIR.parent) == []


def test_the_renamed_parameter_check_sees_a_read(tmp_path):
    _write(tmp_path, f"{PACKAGE}/__init__.py", "")
    _write(tmp_path, "tests/test_x.py", 'start = eqn.params["num_consts"]\n')
    _write(tmp_path, "benchmarks/b.py", "")
    assert renamed_param_reads(tmp_path) == ["tests/test_x.py:1"]


def test_no_context_variable_or_thread_local_chooses_behaviour():
    """What a function does is decided by its arguments: a context
    variable or thread-local set by one caller and read deep in another
    module is invisible to a user's own part (diloco's leaf layouts reach a
    reduction as an ``update`` extra argument)."""
    found = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{number}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bcontextvars\b|\bContextVar\b|threading\.local\b", line)
    ]
    assert found == []


def test_the_ternary_front_doors_are_thin():
    """`ternary_average_across_devices` and `ternary_window_reduction` are
    front doors over the compressed_* pair: at most 20 lines of code each
    (signature and docstring left out), each handing the ternary codec to
    the pair's shared function."""
    path = PACKAGE_DIR / "_ternary" / "_reductions.py"
    tree = ast.parse(path.read_text())
    doors = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }
    assert set(doors) == {"ternary_average_across_devices", "ternary_window_reduction"}
    for name, node in doors.items():
        body = node.body[1:]  # the docstring left out
        code_lines = body[-1].end_lineno - body[0].lineno + 1
        assert code_lines <= 20, (name, code_lines)
        called = {
            call.func.id
            for call in ast.walk(node)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        }
        assert "ternary" in called, name
        assert called & {"average", "window_reduction"}, name
