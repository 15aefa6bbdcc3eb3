"""Runs every benchmark, prints their tables and targets, draws the plots.

Each benchmark runs in its own process (those on several emulated devices,
bench_ternary.py and bench_sharded.py among them,
need their own XLA flags) and prints its full table (a full run also runs
the benchmarks that only print tables, and ends with the commands of the
figures it does not reproduce, and why); this script then
prints the headline figures against their targets, as text, and draws, for
users, how much faster and lighter gradaccum_jax is than what it replaces
and how that grows, into ``benchmarks/plots/``:

- ``accumulation_params.png``: micro-step time and compiled temporary
  memory against parameter count, ours, ``optax.MultiSteps`` and the floor;
- ``accumulation_k.png``: window time against k, ours and optax;
- ``microbatch_memory.png``: temporary memory against micro-batches;
- ``wire_bytes.png``: all-reduce bytes of a float32 and a ternary mean
  against device count;
- ``ternary_accuracy.png``: test accuracy against steps, ternary and
  float32;
- ``low_communication.png`` (and its figures, ``low_communication.json``):
  validation loss against examples seen and against bytes all-reduced,
  data parallel (float32, ternary) and DiLoCo;
- ``low_communication_loss_bytes.png``: every method's final loss against
  its bytes, a panel per task whose figures are in the plot directory;
- ``scale.png`` (and its figures, ``scale.json``): compiled temporaries and
  collective bytes per window of every training path on 64 and 256
  emulated devices (``--quick``: the reference configuration only).

Run: ``python benchmarks/run_all.py [--quick] [--plots DIR]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _devices

HERE = Path(__file__).resolve().parent

# (script, arguments for a full run, arguments for a quick check)
BENCHMARKS = (
    (
        "bench_accumulation.py",
        ["--sweep-params", "1e6,4e6,16e6,64e6", "--sweep-k", "2,4,8,16,32"],
        ["--params", "1e6", "--windows", "2"]
        + ["--sweep-params", "1e6,4e6", "--sweep-k", "2,4,8"],
    ),
    ("bench_microbatch.py", [], ["--batch", "2048", "--repeats", "3"]),
    ("bench_ternary.py", [], ["--seeds", "1", "--epochs", "5"]),
    ("bench_sharded.py", [], ["--repeats", "2"]),
    ("bench_wire_bytes.py", [], []),
    ("bench_ternary_curve.py", [], ["--seeds", "1", "--epochs", "1,2,5"]),
    # Its plot is drawn below, into --plots, like the others.
    (
        "bench_low_communication.py",
        ["--plot-dir", ""],
        ["--plot-dir", "", "--steps", "128", "--seeds", "1"],
    ),
    ("bench_scale.py", ["--plots", ""], ["--plots", "", "--only", "reference"]),
)

# Benchmarks whose tables the docs quote but that hand no headline figures
# to this script: run as they are in a full run, their output printed.
TABLES = (
    ("bench_codecs.py", ["bytes"]),
    ("bench_codecs.py", ["formats"]),
    ("bench_codecs.py", ["select"]),
    ("bench_codecs.py", ["residual"]),
    ("bench_codecs.py", ["steps", "--rounds", "12"]),
    ("bench_ternary_tp_bytes.py", []),
    ("bench_noise_scale.py", ["--skip-spread"]),
    ("bench_noise_scale.py", ["--skip-timing"]),
    ("bench_long_window.py", []),
    ("bench_low_precision.py", []),
)

# What the docs quote that this script does not run, and why: each command
# reproduces its figures (a saved JSON records the arguments that made it).
ELSEWHERE = (
    (
        "python benchmarks/bench_low_communication.py --task transformer",
        "about 40 minutes on 2 CPU cores; low_communication_transformer.json",
    ),
    (
        "PYTHONPATH=. python benchmarks/bench_overlap.py",
        "root (a network namespace, tc)",
    ),
    (
        "python benchmarks/bench_codecs.py steps --workers 2 --rounds 8 "
        "--layouts shard_map --batch 2048",
        "the larger-batch variant of the codecs' step times",
    ),
    (
        "python benchmarks/compare_revisions.py --before 94401cb",
        "checks out an earlier revision",
    ),
)


def network_commands(plots: Path) -> list[tuple[str, str]]:
    """The ``bench_network.py`` command of each saved ``network*.json``,
    from the arguments it records: it runs as root (a network namespace,
    ``tc``), so this script does not."""
    commands = []
    for path in sorted(plots.glob("network*.json")):
        recorded = dict(json.loads(path.read_text())["args"])
        recorded.update(out_dir="benchmarks/plots", stem=path.stem)
        words = ["--rates", *(r.replace(" Gbit/s", "") for r in recorded.pop("rates"))]
        for name, value in recorded.items():
            words += [f"--{name.replace('_', '-')}", str(value)]
        command = "PYTHONPATH=. python benchmarks/bench_network.py " + " ".join(words)
        commands.append((command, f"root; {path.name}"))
    return commands


def run_benchmark(script: str, arguments: list[str], json_path: Path) -> dict:
    command = [sys.executable, str(HERE / script), *arguments, "--json", str(json_path)]
    print(f"$ {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    subprocess.run(command, check=True)
    print(f"({script}: {time.monotonic() - start:.0f} s)\n", flush=True)
    return json.loads(json_path.read_text())


def targets_table(results: dict[str, dict]) -> str:
    lines = [
        "| benchmark | figure | measured | target | met |",
        "|---|---|---:|---:|:---:|",
    ]
    for result in results.values():
        for figure in result["figures"]:
            met = "yes" if figure["measured"] <= figure["target"] else "**no**"
            lines.append(
                f"| {result['benchmark']} | {figure['name']} "
                f"| {figure['measured']:.2f} | <= {figure['target']:.2f} | {met} |"
            )
    return "\n".join(lines)


def ratios_table(sweep: list[dict], key: str) -> str:
    """Ours / optax at each point of a sweep: micro-step, window, temporaries."""
    lines = [
        f"| {key} | micro-step ours / optax | window ours / optax "
        "| temporaries ours / optax | micro-step ours / floor |",
        "|---:|---:|---:|---:|---:|",
    ]
    for point in sweep:
        ours, ref = point["gradaccum_jax.MultiSteps"], point["optax.MultiSteps"]
        size = f"{point[key] / 1e6:g}M" if key == "params" else str(point[key])
        lines.append(
            f"| {size} | {ours['micro_s'] / ref['micro_s']:.2f} "
            f"| {ours['window_s'] / ref['window_s']:.2f} "
            f"| {ours['temp_bytes'] / max(ref['temp_bytes'], 1):.3f} "
            f"| {ours['micro_s'] / point['floor']['micro_s']:.2f} |"
        )
    return "\n".join(lines)


def draw(results: dict[str, dict], out: Path, where: str) -> list[Path]:
    import _plots

    accumulation = results["bench_accumulation.py"]["data"]
    # The figures behind the low-communication plot go next to it.
    low_communication = results["bench_low_communication.py"]["data"]
    figures_path = out / "low_communication.json"
    out.mkdir(parents=True, exist_ok=True)
    figures_path.write_text(json.dumps(low_communication, indent=1) + "\n")
    # Loss against bytes: this run's digits task, and a panel per other task
    # whose figures `bench_low_communication.py --task ...` wrote into `out`.
    other_tasks = sorted(out.glob("low_communication_*.json"))
    records = [low_communication, *(json.loads(p.read_text()) for p in other_tasks)]
    records = [record for record in records if "DP float32" in record["curves"]]
    scale = results["bench_scale.py"]["data"]["results"]
    scale_path = out / "scale.json"
    scale_path.write_text(json.dumps(scale, indent=1) + "\n")
    return [
        _plots.accumulation_vs_params(
            accumulation["sweep_params"], out / "accumulation_params.png", where
        ),
        _plots.window_vs_k(accumulation["sweep_k"], out / "accumulation_k.png", where),
        _plots.microbatch_memory(
            results["bench_microbatch.py"]["data"],
            out / "microbatch_memory.png",
            where,
        ),
        _plots.wire_bytes(
            results["bench_wire_bytes.py"]["data"], out / "wire_bytes.png", where
        ),
        _plots.ternary_accuracy(
            results["bench_ternary_curve.py"]["data"],
            out / "ternary_accuracy.png",
            where,
        ),
        _plots.low_communication(
            low_communication, out / "low_communication.png", where
        ),
        figures_path,
        _plots.loss_against_bytes(
            records, out / "low_communication_loss_bytes.png", where
        ),
        _plots.scale(scale, out / "scale.png", where),
        scale_path,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plots", type=Path, default=HERE / "plots")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: checks the plumbing"
    )
    args = parser.parse_args()

    start = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for script, full, quick in BENCHMARKS:
            json_path = Path(scratch) / f"{script}.json"
            results[script] = run_benchmark(
                script, quick if args.quick else full, json_path
            )
    if not args.quick:
        for script, arguments in TABLES:
            print(f"$ {script} {' '.join(arguments)}", flush=True)
            subprocess.run([sys.executable, str(HERE / script), *arguments], check=True)
    where = _devices.machine()
    accumulation = results["bench_accumulation.py"]["data"]
    print(f"## Accumulation, ours / optax.MultiSteps by model size ({where})\n")
    print(ratios_table(accumulation["sweep_params"], "params"))
    print(f"\n## Accumulation, ours / optax.MultiSteps by k ({where})\n")
    print(ratios_table(accumulation["sweep_k"], "k"))
    print(f"\n## Targets ({where})\n")
    print(targets_table(results))
    print()
    for path in draw(results, args.plots, where):
        print(f"plot: {path}")
    print("\n## Not run here\n")
    for command, why in (*ELSEWHERE, *network_commands(HERE / "plots")):
        print(f"- `{command}`: {why}")
    print(f"total: {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
