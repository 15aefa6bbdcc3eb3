"""Headline figures of two revisions side by side, measured in one run.

For a change that must not cost performance (a refactoring of the engine),
this runs ``bench_accumulation.py``, ``bench_sharded.py`` and
``bench_ternary.py`` of an earlier revision (``--before``, any git revision)
and of the working tree, alternating them round by round so that both see
the same machine load, and prints every headline figure of both with their
ratio. Each revision runs its own benchmark scripts against its own package
(``PYTHONPATH``), each in a fresh process; a figure's value is the median
over the rounds.

Run: ``python benchmarks/compare_revisions.py --before <rev> [--rounds 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# (script, arguments): the headline configurations of run_all.py, less the
# sweeps (the 16M point and its micro-step, window and memory ratios).
BENCHMARKS = (
    ("bench_accumulation.py", []),
    ("bench_sharded.py", []),
    ("bench_ternary.py", ["--seeds", "2"]),
)


def export(revision: str, into: Path) -> Path:
    """The package and benchmarks of ``revision``, written under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "gradaccum_jax", "benchmarks"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run(tree: Path, script: str, arguments: list[str], scratch: Path) -> dict:
    """One benchmark of one tree: ``{figure name: measured}``."""
    json_path = scratch / "figures.json"
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(
        [sys.executable, str(tree / "benchmarks" / script), *arguments]
        + ["--json", str(json_path)],
        check=True,
        env=environment,
        stdout=subprocess.DEVNULL,
        cwd=tree,
    )
    figures = json.loads(json_path.read_text())["figures"]
    return {figure["name"]: figure["measured"] for figure in figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "before").mkdir()
        trees = {"before": export(args.before, scratch / "before"), "after": REPO}
        samples: dict[tuple[str, str, str], list[float]] = {}
        for round_index in range(args.rounds):
            # Alternate who goes first: neither always runs on a warmer machine.
            order = list(trees) if round_index % 2 == 0 else list(trees)[::-1]
            for script, arguments in BENCHMARKS:
                for name in order:
                    print(f"round {round_index + 1}: {name} {script}", flush=True)
                    for figure, value in run(
                        trees[name], script, arguments, scratch
                    ).items():
                        samples.setdefault((script, figure, name), []).append(value)
    print(f"\n# before = {args.before}, after = working tree; medians of {args.rounds}")
    print("| benchmark | figure | before | after | after / before |")
    print("|---|---|---|---|---|")
    for script, _ in BENCHMARKS:
        figures = sorted({f for s, f, _ in samples if s == script})
        for figure in figures:
            before = statistics.median(samples.get((script, figure, "before"), [0]))
            after = statistics.median(samples.get((script, figure, "after"), [0]))
            ratio = after / before if before else float("nan")
            print(f"| {script} | {figure} | {before:.3g} | {after:.3g} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
