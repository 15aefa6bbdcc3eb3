"""Helpers shared by the test modules.

``EAGER_AND_JIT`` runs one test body with and without ``jax.jit`` (the pytest
spelling of ``chex.variants(with_jit=True, without_jit=True)``): Python-side
branching and trace-time checks behave differently in the two.
``train_step_temp_bytes`` reads a donated train step's compiled temporaries;
``entry_arrays`` lists the arrays a compiled step makes on every call.
``init_as_users_do`` initializes a state on the current mesh as a user would.
``public_names`` lists the package's public names, its submodules' too.
``compiled_reference`` compiles paths of ``benchmarks/bench_scale.py``'s
reference configuration on 64 devices, in a process of its own.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import optax
import pytest

import gradaccum_jax
from gradaccum_jax.measure import collectives

# The page whose table lists every public name with its signature.
API_TABLE_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "api_summary.md"

REPO = pathlib.Path(__file__).resolve().parent.parent

# The public submodules: their names are public below the package's.
PUBLIC_SUBMODULES = ("codecs", "extend", "measure")


def _eager(fn):
    return fn


EAGER_AND_JIT = pytest.mark.parametrize(
    "compile_fn", [_eager, jax.jit], ids=["eager", "jit"]
)


def train_step_temp_bytes(tx, params, make_grads=None) -> int:
    """Temporary bytes of a jitted train step (update + apply, donated).

    Gradients come in as arguments (buffers, as from a backward pass), or
    from ``make_grads(params, grads)`` inside the step, where XLA may fuse
    their producer into the accumulation.
    """

    def step(params, opt_state, grads):
        if make_grads is not None:
            grads = make_grads(params, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, tx.init(params), params)
        .compile()
    )
    return compiled.memory_analysis().temp_size_in_bytes


def entry_arrays(compiled, dtype: str) -> list[tuple[str, int]]:
    """(instruction, element count) of the ``dtype`` arrays (an HLO type:
    ``u32``, ``f32``) that ``compiled``'s entry computation makes, not
    counting its parameters and their bitcasts: work that runs on every
    call, whether or not a loop in the step runs."""
    entry = compiled.as_text().split("\nENTRY ", 1)[1].split("\n}\n", 1)[0]
    found = []
    for line in entry.splitlines()[1:]:
        match = re.search(rf"= {dtype}\[([\d,]*)\]\S* (\S+)\(", line)
        if match and match.group(2) not in ("parameter", "bitcast"):
            dims = [int(d) for d in match.group(1).split(",") if d]
            found.append((line.strip()[:120], int(np.prod(dims))))
    return found


def moved_arrays(compiled) -> list[tuple[str, str, str]]:
    """(collective, element type, place) of every all-gather, all-to-all
    and collective-permute in ``compiled``'s HLO: the collectives that move
    values between devices without summing them. ``place`` is as in
    `gradaccum_jax.measure.collectives`: ``"entry"`` (every call),
    ``"loop"`` (e.g. a window's emission) or ``"branch"``."""
    moves = ("all-gather", "all-to-all", "collective-permute")
    return [
        (c.kind, shape.split("[", 1)[0], c.place)
        for c in collectives(compiled)
        if c.kind in moves
        for shape in c.shapes
    ]


def public_names() -> list[str]:
    """Every public name, qualified below the package: ``MultiSteps``,
    ``measure.collectives``: the top level's ``__all__`` and each public
    submodule's."""
    names = list(gradaccum_jax.__all__)
    for submodule in PUBLIC_SUBMODULES:
        module = getattr(gradaccum_jax, submodule)
        names += [f"{submodule}.{name}" for name in module.__all__]
    return names


def public_object(qualified_name: str) -> Any:
    """The object a name of `public_names` stands for."""
    return functools.reduce(getattr, qualified_name.split("."), gradaccum_jax)


def api_table_entries() -> list[str]:
    """The backticked names and calls of the first column of the API table."""
    text = API_TABLE_PAGE.read_text()
    start = text.index("| name | what it is |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    entries = []
    for row in rows:
        first_column = row.split(" | ")[0].removeprefix("| ")
        entries += re.findall(r"`([^`]+)`", first_column)
    return entries


def compiled_reference(
    scratch: pathlib.Path, *paths: str, config: str = "reference"
) -> dict[str, dict]:
    """Each of ``paths`` of ``benchmarks/bench_scale.py`` compiled on its
    configuration ``config`` (default its 0.81B-param reference, ``data`` 8
    x ``model`` 8): its row of ``scale.json`` (memory and collectives), by
    path. The compile runs in a process of its own, whose 64 devices this
    process (8) cannot have."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_scale.py"),
            "--only",
            config,
            "--paths",
            *paths,
            "--plots",
            str(scratch),
            "--no-figure",
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=env,
    )
    rows = json.loads((scratch / "scale.json").read_text())
    return {row["path"]: row for row in rows}


def init_as_users_do(init: Any, params: Any) -> Any:
    """``init(params)`` on the current mesh: eagerly where it has Auto axes,
    whose split ``init`` reads from the placed params (under ``jax.jit``
    their types do not say it); jitted on Explicit axes."""
    if jax.sharding.AxisType.Auto in jax.sharding.get_abstract_mesh().axis_types:
        return init(params)
    return jax.jit(init)(params)


def scan_carries(eqn: Any) -> list[Any]:
    """The carry operands (the accumulators) of a ``scan`` jaxpr equation.

    JAX 0.11 replaced the scan's ``num_consts`` / ``num_carry`` parameters
    with flat trees (``ft_in``: consts, carry, xs): both are read.
    """
    params = eqn.params
    if "ft_in" in params:
        _, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
        return list(carry)
    start = params["num_consts"]
    return list(eqn.invars[start : start + params["num_carry"]])


def assert_no_unreduced_or_reduced(tree: Any, name: str) -> None:
    """Asserts that no leaf of ``tree`` (what a jitted function returned)
    is typed unreduced or reduced over a mesh axis: newer JAX releases
    refuse such an array as the next call's input."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        marked = set(getattr(spec, "unreduced", ()) or ()) | set(
            getattr(spec, "reduced", ()) or ()
        )
        assert not marked, (
            f"{name} returned {jax.tree_util.keystr(path)} typed {spec}: "
            "unreduced or reduced across a jit boundary"
        )
