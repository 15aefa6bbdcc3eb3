"""Runs every benchmark, prints one markdown summary and writes a PNG plot.

Each benchmark runs in its own process (the ternary and sharded ones need 8
emulated devices, the others one) and prints its full table; this script then prints
the headline figures of all of them side by side, each against its target,
and plots them as fractions of their targets.

Run: ``python benchmarks/run_all.py [--plot benchmarks/results.png] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, arguments for a full run, arguments for a quick check)
BENCHMARKS = (
    ("bench_accumulation.py", [], ["--params", "2000000", "--windows", "2"]),
    ("bench_microbatch.py", [], ["--batch", "2048", "--repeats", "3"]),
    ("bench_ternary.py", [], ["--seeds", "1", "--epochs", "5"]),
    ("bench_sharded.py", [], ["--repeats", "2"]),
)


def machine() -> str:
    """The machine the figures come from, in words."""
    import jax

    device = jax.devices()[0]
    return (
        f"{platform.machine()} {device.platform} ({device.device_kind}), "
        f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"jax {jax.__version__}"
    )


def run_benchmark(script: str, arguments: list[str], json_path: Path) -> dict:
    command = [sys.executable, str(HERE / script), *arguments, "--json", str(json_path)]
    print(f"$ {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    print(flush=True)
    return json.loads(json_path.read_text())


def summary_table(results: list[dict]) -> str:
    lines = [
        "| benchmark | figure | measured | target | met |",
        "|---|---|---:|---:|:---:|",
    ]
    for result in results:
        for figure in result["figures"]:
            met = "yes" if figure["measured"] <= figure["target"] else "**no**"
            lines.append(
                f"| {result['benchmark']} | {figure['name']} "
                f"| {figure['measured']:.2f} | <= {figure['target']:.2f} | {met} |"
            )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, fractions, colors = [], [], []
    for result in results:
        for figure in result["figures"]:
            names.append(f"{result['benchmark']}: {figure['name']}")
            # Accuracy losses may be negative (ternary better than float32).
            fractions.append(max(figure["measured"], 0.0) / figure["target"])
            met = figure["measured"] <= figure["target"]
            colors.append("tab:green" if met else "tab:red")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    ax.barh(names[::-1], fractions[::-1], color=colors[::-1])
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("measured / target (left of the dashed line: target met)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=HERE / "results.png")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: checks the plumbing"
    )
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for script, full, quick in BENCHMARKS:
            json_path = Path(scratch) / f"{script}.json"
            results.append(
                run_benchmark(script, quick if args.quick else full, json_path)
            )
    where = machine()
    print(f"## Summary ({where})\n")
    print(summary_table(results))
    plot(results, args.plot, where)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
