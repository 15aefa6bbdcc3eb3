"""Step time of float32, ternary, accumulated and DiLoCo training against bandwidth.

Ternary compression (`ternary_average_across_devices`) sends about a tenth
of the bytes of a float32 mean between 2 devices but costs compute (random
draws, clipping, packing); gradient accumulation (`MultiSteps`, k=8) sends
float32 once per 8 micro-steps; DiLoCo (`diloco`, H=32) sends the float32
outer gradient once per 32 steps, each process training alone in between.
Which is fastest depends on the network.
This benchmark measures it, on one machine, by limiting the bandwidth of a
loopback:

- it creates its own network namespace (``gaj-bench-<pid>``), brings up its
  loopback and, for each ``--rates`` value in Gbit/s, shapes that loopback
  with ``tc qdisc replace dev lo root tbf rate <R>gbit ...`` (no qdisc for
  ``unlimited``);
- it launches 2 worker processes (``benchmarks/_network_worker.py``) inside
  the namespace with ``ip netns exec``, joined by ``jax.distributed`` on
  127.0.0.1 with gloo CPU collectives, one CPU device each, one mesh over
  both; all their traffic stays in the namespace;
- the workers time the jitted data-parallel step (``jax.shard_map``,
  parameters replicated, batch split) of a 4.7M-parameter MLP with each
  variant: ``f32`` (`average_across_devices` + sgd), ``ternary``
  (`ternary_average_across_devices` + sgd), ``accum8`` (`MultiSteps` with
  k=8, count_skipped=True, around the float32 mean + sgd; per micro-step
  and per window of 8) and ``diloco32`` (`diloco` with sgd as the inner
  optimizer and its default outer Nesterov step, H=32, params per
  process; per step and per cycle of 32, its sync included) and
  ``diloco32t`` (the same, its outer gradient sent as ternary codes with
  ``ternary_average_across_devices``). Median of
  ``--repeats`` after ``--warmup``;
- once (unshaped: bandwidth does not change the arithmetic), the workers
  train a small MLP on scikit-learn's ``load_digits`` with each variant for
  a fixed number of updates and ``--seeds`` seeds, for the test accuracy.

It prints a table (rate x variant: ms per step, ratio to f32 in the same
run, accuracy), writes the figures to ``benchmarks/network.json`` and a plot
of step time against bandwidth, with the interpolated crossover below which
ternary beats float32, to ``benchmarks/network.png``.

The ``tbf`` shaper sits on the namespace's ``lo``, which both directions
cross: the rate is the two processes' aggregate bandwidth.

Why root: creating a network namespace (``ip netns add``) and changing its
queueing discipline (``tc``) need CAP_NET_ADMIN (and CAP_SYS_ADMIN to mount
the namespace). A namespace keeps the shaping away from the machine's own
loopback, which other programs use. Needs iproute2 (``ip``, ``tc``). The
namespace is deleted, and the workers killed, on exit, error or Ctrl-C.

Run (as root)::

    PYTHONPATH=. python benchmarks/bench_network.py --rates 0.1 1 10 unlimited
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WORKER = HERE / "_network_worker.py"
NUM_PROCESSES = 2
VARIANTS = ("f32", "ternary", "accum8", "diloco32", "diloco32t")
DILOCO_VARIANTS = ("diloco32", "diloco32t")
EVERY_K = 8
SYNC_EVERY = 32
# tbf: 4 ms of traffic per burst, at least 256 KiB (loopback's GSO packets
# reach 64 KiB, and a burst smaller than a packet would drop it), and up to
# 100 ms of queue before drops.
BURST_SECONDS = 0.004
MIN_BURST_BYTES = 256 * 1024
QUEUE_LATENCY = "100ms"


def fail(message: str) -> None:
    print(f"bench_network: {message}", file=sys.stderr)
    sys.exit(2)


def preflight() -> None:
    """Exits with status 2, saying what is missing, unless root with iproute2."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    problems = []
    if os.geteuid() != 0:
        problems.append(
            "must run as root (creating a network namespace and shaping its "
            "loopback need CAP_NET_ADMIN / CAP_SYS_ADMIN); try sudo"
        )
    if missing:
        problems.append(
            f"missing {' and '.join(missing)} from iproute2 on PATH "
            "(e.g. apt-get install iproute2)"
        )
    if problems:
        fail("; ".join(problems) + ".")


def run(*command: str, timeout: float = 30) -> str:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def parse_rate(text: str) -> float:
    """Gbit/s as a float; math.inf for 'unlimited'."""
    if text.lower() in ("unlimited", "inf", "none"):
        return math.inf
    rate = float(text)
    if not (rate > 0 and math.isfinite(rate)):
        raise argparse.ArgumentTypeError(f"rate must be > 0 or 'unlimited': {text}")
    return rate


def rate_label(rate: float) -> str:
    return "unlimited" if math.isinf(rate) else f"{rate:g} Gbit/s"


class Namespace:
    """A network namespace with its loopback up; deleted by `delete`."""

    def __init__(self, name: str):
        self.name = name
        run("ip", "netns", "add", name)
        self.created = True
        run("ip", "-n", name, "link", "set", "lo", "up")

    def shape(self, rate: float) -> str:
        """Limits the namespace's loopback to ``rate`` Gbit/s; returns the qdisc."""
        if math.isinf(rate):
            # `del` fails when there is no root qdisc yet: nothing to remove.
            subprocess.run(
                ["ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev",
                 "lo", "root"],
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
        else:
            burst = max(MIN_BURST_BYTES, int(rate * 1e9 / 8 * BURST_SECONDS))
            run(
                "ip", "netns", "exec", self.name, "tc", "qdisc", "replace", "dev",
                "lo", "root", "tbf", "rate", f"{rate:g}gbit", "burst", str(burst),
                "latency", QUEUE_LATENCY,
            )  # fmt: skip
        shown = run(
            "ip", "netns", "exec", self.name, "tc", "qdisc", "show", "dev", "lo"
        )
        return shown.strip()

    def free_port(self) -> int:
        """A TCP port free on 127.0.0.1 inside the namespace."""
        code = (
            "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
            "print(s.getsockname()[1])"
        )
        return int(run("ip", "netns", "exec", self.name, sys.executable, "-c", code))

    def delete(self) -> None:
        subprocess.run(
            ["ip", "netns", "delete", self.name],
            capture_output=True, timeout=30, check=False,
        )  # fmt: skip


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
    )
    return env


def tail(path: Path, chars: int = 2500) -> str:
    text = path.read_text(errors="replace")
    # gloo prints one "connected to N peer ranks" line per device.
    lines = [line for line in text.splitlines() if "[Gloo]" not in line]
    return "\n".join(lines)[-chars:]


def launch(
    namespace: Namespace,
    worker_args: list[str],
    work_dir: Path,
    tag: str,
    timeout_s: float,
    live: list[subprocess.Popen],
) -> list[dict]:
    """Runs the 2 workers in the namespace; returns process 0's JSON results.

    Kills both (by process group) if either is still running after
    ``timeout_s`` seconds; raises RuntimeError with their logs on failure.
    """
    coordinator = f"127.0.0.1:{namespace.free_port()}"
    out = work_dir / f"{tag}.json"
    worker_timeout = max(10, int(timeout_s) - 5)
    processes, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            log_path = work_dir / f"{tag}.process{i}.log"
            logs.append(log_path)
            with open(log_path, "w") as log:
                command = [
                    "ip", "netns", "exec", namespace.name, sys.executable,
                    str(WORKER), f"--process-id={i}",
                    f"--num-processes={NUM_PROCESSES}",
                    f"--coordinator={coordinator}", f"--out={out}",
                    f"--timeout={worker_timeout}", *worker_args,
                ]  # fmt: skip
                process = subprocess.Popen(
                    command,
                    cwd=REPO_ROOT,
                    env=child_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group, killed as one
                )
            processes.append(process)
            live.append(process)
        deadline = time.monotonic() + timeout_s
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        hung = [p.pid for p in processes if p.poll() is None]
        kill(processes)
        for process in processes:
            live.remove(process)
    codes = [p.returncode for p in processes]
    if hung or codes != [0] * NUM_PROCESSES or not out.exists():
        logs_text = "\n".join(
            f"----- process {i} -----\n{tail(path)}" for i, path in enumerate(logs)
        )
        raise RuntimeError(
            f"workers for {tag} failed: exit codes {codes}, killed after "
            f"{timeout_s:.0f} s: {hung or 'none'}\n{logs_text}"
        )
    return json.loads(out.read_text())


def kill(processes: list[subprocess.Popen]) -> None:
    """SIGKILLs the process group of each still-running worker (by its id)."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(
                    f"bench_network: pid {process.pid} survived SIGKILL",
                    file=sys.stderr,
                )


def fit_time(points: list[dict], variant: str) -> tuple[float, float] | None:
    """(c, b) of ms = c + b / rate: compute plus bytes over bandwidth.

    c is the unlimited run's time; b the least-squares slope over the
    finite rates (ms x Gbit/s, proportional to the bytes sent).
    """
    measured = [p for p in points if variant in p["ms"]]
    unlimited = [p["ms"][variant] for p in measured if math.isinf(p["rate"])]
    finite = [
        (p["rate"], p["ms"][variant]) for p in measured if math.isfinite(p["rate"])
    ]
    if not unlimited or not finite:
        return None
    c = unlimited[0]
    b = sum((t - c) / r for r, t in finite) / sum(1 / r**2 for r, _ in finite)
    return c, b


def crossover(points: list[dict]) -> dict:
    """The bandwidth below which ternary is faster than f32.

    Linear interpolation of (ternary - f32) ms in log10(rate) between the
    two neighbouring measured finite rates where its sign changes. When it
    changes only between the largest finite rate and the unlimited run,
    the crossover is where the fits ms = c + b / rate of the two variants
    (`fit_time`) meet.
    """
    finite = sorted(
        (p for p in points if math.isfinite(p["rate"])), key=lambda p: p["rate"]
    )
    diffs = [
        (p["rate"], p["ms"]["ternary"] - p["ms"]["f32"])
        for p in finite
        if "ternary" in p["ms"] and "f32" in p["ms"]
    ]
    for (r1, d1), (r2, d2) in zip(diffs[:-1], diffs[1:], strict=True):
        if d1 < 0 <= d2:
            x1, x2 = math.log10(r1), math.log10(r2)
            x = x1 + (x2 - x1) * (-d1) / (d2 - d1)
            return {"gbit": 10**x, "note": f"interpolated between {r1:g} and {r2:g}"}
    unlimited = [
        p["ms"]["ternary"] - p["ms"]["f32"]
        for p in points
        if math.isinf(p["rate"]) and {"ternary", "f32"} <= p["ms"].keys()
    ]
    if diffs and diffs[-1][1] < 0 and unlimited and unlimited[0] >= 0:
        f32, ternary = fit_time(points, "f32"), fit_time(points, "ternary")
        if f32 and ternary and f32[1] > ternary[1] and ternary[0] > f32[0]:
            gbit = (f32[1] - ternary[1]) / (ternary[0] - f32[0])
            return {
                "gbit": gbit,
                "note": f"between {diffs[-1][0]:g} Gbit/s and unlimited; "
                "where the fits ms = c + b / rate meet",
            }
        return {"gbit": None, "note": f"between {diffs[-1][0]:g} and unlimited"}
    if diffs and all(d < 0 for _, d in diffs):
        return {"gbit": None, "note": "ternary faster at every measured finite rate"}
    if diffs and all(d >= 0 for _, d in diffs):
        return {"gbit": None, "note": "f32 faster at every measured finite rate"}
    return {"gbit": None, "note": "no single crossover in the measured rates"}


def plot(points: list[dict], cross: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [p["rate"] for p in points if math.isfinite(p["rate"])]
    unlimited_x = 10 * max(finite) if finite else 100.0

    def x_of(rate: float) -> float:
        return unlimited_x if math.isinf(rate) else rate

    styles = {
        "f32": ("float32 mean", "o-", "C0"),
        "ternary": ("ternary mean", "s-", "C1"),
        "accum8": ("accum k=8, per micro-step", "^-", "C2"),
        "accum8_window": ("accum k=8, per window of 8", "^:", "C2"),
        "diloco32": ("DiLoCo H=32, per step", "D-", "C3"),
        "diloco32_window": ("DiLoCo H=32, per cycle of 32", "D:", "C3"),
        "diloco32t": ("DiLoCo H=32 ternary outer, per step", "v-", "C4"),
    }
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ordered = sorted(points, key=lambda p: x_of(p["rate"]))
    for key, (label, style, color) in styles.items():
        xs = [x_of(p["rate"]) for p in ordered if key in p["ms"]]
        ys = [p["ms"][key] for p in ordered if key in p["ms"]]
        if xs:
            ax.plot(xs, ys, style, color=color, label=label)
    if cross["gbit"] is not None:
        ax.axvline(cross["gbit"], color="grey", linestyle="--")
        ax.annotate(
            f"ternary faster below\n~{cross['gbit']:.2g} Gbit/s",
            (cross["gbit"], 0.95), xycoords=("data", "axes fraction"),
            ha="right", va="top", fontsize=8, color="dimgrey",
        )  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted({x_of(p["rate"]) for p in points})
    ax.set_xticks(ticks)
    ax.set_xticklabels(
        ["unlimited" if t == unlimited_x and any(math.isinf(p["rate"]) for p in points)
         else f"{t:g}" for t in ticks]
    )  # fmt: skip
    ax.minorticks_off()
    ax.set_xlabel("loopback bandwidth (Gbit/s, both directions together)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(points: list[dict], accuracy: dict[str, list[float]]) -> str:
    def acc_text(variant: str) -> str:
        values = accuracy.get(variant)
        if not values:
            return "-"
        mean = 100 * sum(values) / len(values)
        return f"{mean:.1f} % ({100 * min(values):.1f}..{100 * max(values):.1f})"

    rows = [
        "| bandwidth | variant | ms / step | ms / window | vs f32 | test accuracy |",
        "|---|---|---:|---:|---:|---|",
    ]
    for p in points:
        for variant in VARIANTS:
            if variant not in p["ms"]:
                if variant in p.get("errors", {}):
                    rows.append(f"| {p['label']} | {variant} | failed | | | |")
                continue
            ms = p["ms"][variant]
            window = p["ms"].get(f"{variant}_window")
            base = p["ms"].get("f32")
            ratio = f"{ms / base:.2f}" if base else "-"
            rows.append(
                f"| {p['label']} | {variant} | {ms:.1f} | "
                f"{'' if window is None else f'{window:.1f}'} | {ratio} | "
                f"{acc_text(variant)} |"
            )
    return "\n".join(rows)


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rates",
        nargs="+",
        type=parse_rate,
        default=[0.1, 1.0, 10.0, math.inf],
        help="Gbit/s, or 'unlimited' (default: 0.1 1 10 unlimited)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3, help="0 skips accuracy")
    parser.add_argument(
        "--updates", type=int, default=300, help="optimizer updates per accuracy run"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per launch of the 2 workers"
    )
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()
    preflight()

    # SIGTERM (e.g. from a CI runner) unwinds like Ctrl-C, through `finally`.
    signal.signal(signal.SIGTERM, interrupt)
    name = f"gaj-bench-{os.getpid()}"
    started = time.monotonic()
    points, accuracy_runs, live = [], [], []
    namespace = None
    try:
        with tempfile.TemporaryDirectory(prefix="gaj-bench-") as tmp:
            work_dir = Path(tmp)
            try:
                namespace = Namespace(name)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                fail(f"cannot create network namespace {name}: {error}")
            for rate in args.rates:
                qdisc = namespace.shape(rate)
                print(f"== {rate_label(rate)}: {qdisc}", file=sys.stderr, flush=True)
                point = {
                    "rate": rate,
                    "label": rate_label(rate),
                    "qdisc": qdisc,
                    "ms": {},
                    "runs": [],
                    "errors": {},
                }
                tag = "timing_" + ("unlimited" if math.isinf(rate) else f"{rate:g}")
                worker_args = [
                    "--task=timing", f"--variants={args.variants}",
                    f"--warmup={args.warmup}", f"--repeats={args.repeats}",
                ]  # fmt: skip
                t0 = time.monotonic()
                try:
                    runs = launch(
                        namespace, worker_args, work_dir, tag, args.timeout, live
                    )
                except RuntimeError as error:
                    print(error, file=sys.stderr)
                    point["errors"] = {v: str(error)[:500] for v in VARIANTS}
                    runs = []
                point["seconds"] = time.monotonic() - t0
                for run_ in runs:
                    point["ms"][run_["variant"]] = run_["ms_per_step"]
                    if "ms_per_window" in run_:
                        point["ms"][f"{run_['variant']}_window"] = run_["ms_per_window"]
                point["runs"] = runs
                points.append(point)
                print(json.dumps(point["ms"]), file=sys.stderr, flush=True)
            if args.seeds > 0:
                namespace.shape(math.inf)
                print("== accuracy on load_digits (unshaped)", file=sys.stderr)
                worker_args = [
                    "--task=accuracy", f"--variants={args.variants}",
                    f"--seeds={args.seeds}", f"--updates={args.updates}",
                ]  # fmt: skip
                try:
                    accuracy_runs = launch(
                        namespace, worker_args, work_dir, "accuracy", args.timeout, live
                    )
                except RuntimeError as error:
                    print(error, file=sys.stderr)
    finally:
        kill(live)
        if namespace is not None:
            namespace.delete()

    accuracy: dict[str, list[float]] = {}
    for run_ in accuracy_runs:
        accuracy.setdefault(run_["variant"], []).append(run_["accuracy"])
    cross = crossover(points)
    versus_f32 = {
        variant: {
            p["label"]: p["ms"][variant] / p["ms"]["f32"]
            for p in points
            if {variant, "f32"} <= p["ms"].keys()
        }
        for variant in DILOCO_VARIANTS
    }
    num_params = next((r["num_params"] for p in points for r in p["runs"]), None)
    title = (
        f"2 processes x 1 CPU device, gloo, {num_params or '?'} params; "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    print()
    print(table(points, accuracy))
    print()
    where = "none" if cross["gbit"] is None else f"{cross['gbit']:.3g} Gbit/s"
    print(f"crossover: {where} ({cross['note']})")
    for variant, ratios in versus_f32.items():
        for label, ratio in ratios.items():
            print(f"{variant} / f32 step time at {label}: {ratio:.3f}")
    print(f"total: {time.monotonic() - started:.0f} s")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "network.json"
    png_path = args.out_dir / "network.png"
    record = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "args": {
            **vars(args),
            "rates": [rate_label(rate) for rate in args.rates],
            "out_dir": str(args.out_dir),
        },
        "num_params": num_params,
        "every_k": EVERY_K,
        "sync_every": SYNC_EVERY,
        "diloco_vs_f32": versus_f32,
        # JSON has no infinity: the unlimited rate is written as null.
        "points": [
            {**p, "rate": None if math.isinf(p["rate"]) else p["rate"]} for p in points
        ],
        "accuracy": accuracy_runs,
        "crossover": cross,
        "total_s": time.monotonic() - started,
    }
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    if points:
        plot(points, cross, png_path, title)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("bench_network: interrupted; workers killed, namespace deleted.")
        sys.exit(130)
