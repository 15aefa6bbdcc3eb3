"""Step time of float32, ternary, accumulated and DiLoCo training against bandwidth.

Ternary compression (`ternary_average_across_devices`) sends about a tenth
of the bytes of a float32 mean between 2 devices but costs compute (random
draws, clipping, packing); gradient accumulation (`MultiSteps`, k=8) sends
float32 once per 8 micro-steps; DiLoCo (`diloco`, H=32) sends the float32
outer gradient once per 32 steps, each process training alone in between,
or sends it through a codec of `gradaccum_jax.codecs`.
Which is fastest depends on the network.
This benchmark measures it, on one machine, by limiting the bandwidth of a
loopback:

- it creates its own network namespace (``gaj-bench-<pid>``), brings up its
  loopback with an Ethernet MTU of 1500 bytes and, for each ``--rates``
  value in Gbit/s, shapes that loopback with ``tc qdisc replace dev lo root
  tbf rate <R>gbit burst <B> ...`` (no qdisc for ``unlimited``). The burst
  (the bytes that may pass at line rate) is 4 ms of traffic at the rate,
  at least 4 packets: a sync of a few hundred KiB (top-k codes) is shaped
  like one of tens of MiB, at 10 Mbit/s as at 1 Gbit/s; a fixed burst of
  the loopback's 64 KiB packets would let a third of such a sync through
  unshaped at 10 Mbit/s;
- it launches 2 worker processes (``benchmarks/_network_worker.py``) inside
  the namespace with ``ip netns exec``, joined by ``jax.distributed`` on
  127.0.0.1 with gloo CPU collectives, one CPU device each, one mesh over
  both; all their traffic stays in the namespace;
- the workers time the jitted data-parallel step (``jax.shard_map``,
  a copy of the parameters on each device, batch split) of a
  4.7M-parameter MLP, 4 examples
  per process per step unless ``--batch`` says otherwise (little
  arithmetic, so that communication shows; more examples give a step more
  arithmetic per synced byte, as a real model's has), with each
  variant: ``f32`` (`average_across_devices` + sgd), ``ternary``
  (`ternary_average_across_devices` + sgd), ``accum8`` (`MultiSteps` with
  k=8, count_skipped=True, around the float32 mean + sgd; per micro-step
  and per window of 8) and ``diloco32`` (`diloco` with sgd as the inner
  optimizer and its default outer Nesterov step, H=32, params per
  process; per step and per cycle of 32, its sync included),
  ``diloco32t`` (the same, its outer gradient sent as ternary codes with
  ``ternary_average_across_devices``) and ``diloco32_e2m1``,
  ``diloco32_topk3``, ``diloco32_topk1`` (sent with
  `compressed_average_across_devices` and `codecs.quantized` (bits=4),
  `codecs.topk` (3 %, 4 bits), `codecs.topk` (1 %, 2 bits)) and
  ``diloco32_topk125k`` (`codecs.topk` (1.25 %, 2 bits), each process
  keeping half of what it did not send: ``diloco(keep_unsent=0.5)``) and
  ``diloco32_topk50b1k`` (`codecs.topk` (50 %, one bit, through the
  shards' owners), keeping half). Median of
  ``--repeats`` after ``--warmup``, within ``--budget`` seconds per
  variant: at 10 Mbit/s one float32 sync takes about 30 s, and such a
  variant is timed from one repeat (the JSON lists each variant's count);
- once (unshaped: bandwidth does not change the arithmetic), the workers
  train a small MLP on scikit-learn's ``load_digits`` with each variant for
  a fixed number of updates and ``--seeds`` seeds, for the test accuracy.

It prints a table (rate x variant: ms per step, ratio to f32 in the same
run, step time and speed against the variant's own unlimited-link time,
accuracy), writes the figures to ``<out-dir>/<stem>.json`` and a plot of
step time against bandwidth, with the interpolated crossover below which
ternary beats float32, to ``<out-dir>/<stem>.png``.

The ``tbf`` shaper sits on the namespace's ``lo``, which both directions
cross: the rate is the two processes' aggregate bandwidth.

Why root: creating a network namespace (``ip netns add``) and changing its
queueing discipline (``tc``) need CAP_NET_ADMIN (and CAP_SYS_ADMIN to mount
the namespace). A namespace keeps the shaping away from the machine's own
loopback, which other programs use. Needs iproute2 (``ip``, ``tc``). The
namespace is deleted, and the workers killed, on exit, error or Ctrl-C.

Run (as root)::

    PYTHONPATH=. python benchmarks/bench_network.py --rates unlimited 1 0.1 0.01
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

from _network_worker import DILOCO_VARIANTS, EVERY_K, SYNC_EVERY, VARIANTS

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WORKER = HERE / "_network_worker.py"
NUM_PROCESSES = 2
# The namespace's loopback gets an Ethernet MTU: TCP then sends segments of
# about 1.5 KB, which tbf splits GSO packets into, so that the burst can be
# a few packets. With loopback's default 64 KiB MTU the burst must hold a
# 64 KiB packet (tbf drops a packet larger than its burst), 52 ms of
# traffic at 10 Mbit/s: a small sync would pass largely unshaped.
MTU = 1500
# tbf: 4 ms of traffic per burst, at least 4 packets (the Ethernet header
# included), and up to 100 ms of queue before drops.
BURST_SECONDS = 0.004
MIN_BURST_BYTES = 4 * (MTU + 14)
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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1: {text}")
    return value


def burst_bytes(rate: float) -> int:
    """tbf's burst at ``rate`` Gbit/s: BURST_SECONDS of traffic, at least
    MIN_BURST_BYTES (10 Mbit/s: 6,056 bytes; 1 Gbit/s: 500,000)."""
    return max(MIN_BURST_BYTES, int(rate * 1e9 / 8 * BURST_SECONDS))


def rate_label(rate: float) -> str:
    return "unlimited" if math.isinf(rate) else f"{rate:g} Gbit/s"


class Namespace:
    """A network namespace with its loopback up; deleted by `delete`."""

    def __init__(self, name: str):
        self.name = name
        run("ip", "netns", "add", name)
        self.created = True
        run("ip", "-n", name, "link", "set", "lo", "mtu", str(MTU), "up")

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
            burst = burst_bytes(rate)
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


PLOT_STYLES = {
    "f32": ("float32 mean", "o-", "C0"),
    "ternary": ("ternary mean", "s-", "C1"),
    "accum8": ("accum k=8, per micro-step", "^-", "C2"),
    "accum8_window": ("accum k=8, per window of 8", "^:", "C2"),
    "diloco32": ("DiLoCo H=32, per step", "D-", "C3"),
    "diloco32_window": ("DiLoCo H=32, per cycle of 32", "D:", "C3"),
    "diloco32t": ("DiLoCo H=32 ternary outer, per step", "v-", "C4"),
    "diloco32_e2m1": ("DiLoCo H=32 E2M1 outer, per step", "P-", "C5"),
    "diloco32_topk3": ("DiLoCo H=32 top-k 3 % 4-bit outer, per step", "X-", "C6"),
    "diloco32_topk1": ("DiLoCo H=32 top-k 1 % 2-bit outer, per step", "*-", "C7"),
    "diloco32_topk125k": (
        "DiLoCo H=32 top-k 1.25 % 2-bit outer, keep 0.5, per step",
        "h-",
        "C8",
    ),
    "diloco32_topk50b1k": (
        "DiLoCo H=32 top-k 50 % 1-bit owners outer, keep 0.5, per step",
        "p-",
        "C9",
    ),
}


def plot(points: list[dict], cross: dict, path: Path, title: str) -> None:
    """Step time against bandwidth (left) and each variant's speed as a
    fraction of its own on the unlimited link (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    finite = [p["rate"] for p in points if math.isfinite(p["rate"])]
    unlimited_x = 10 * max(finite) if finite else 100.0

    def x_of(rate: float) -> float:
        return unlimited_x if math.isinf(rate) else rate

    fig, (time_ax, speed_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    ordered = sorted(points, key=lambda p: x_of(p["rate"]))
    slowdown = versus_unlimited(points)
    for key, (label, style, color) in PLOT_STYLES.items():
        xs = [x_of(p["rate"]) for p in ordered if key in p["ms"]]
        ys = [p["ms"][key] for p in ordered if key in p["ms"]]
        if xs:
            time_ax.plot(xs, ys, style, color=color, label=label)
        own = slowdown.get(key, {})
        rates = [p for p in ordered if p["label"] in own]
        if rates:
            speed_ax.plot(
                [p["rate"] for p in rates],
                [100 / own[p["label"]] for p in rates],
                style, color=color, label=label,
            )  # fmt: skip
    if cross["gbit"] is not None:
        time_ax.axvline(cross["gbit"], color="grey", linestyle="--")
        time_ax.annotate(
            f"ternary faster below\n~{cross['gbit']:.2g} Gbit/s",
            (cross["gbit"], 0.95), xycoords=("data", "axes fraction"),
            ha="right", va="top", fontsize=8, color="dimgrey",
        )  # fmt: skip
    time_ax.set_yscale("log")
    time_ax.set_ylabel("ms per step (median)")
    speed_ax.axhline(85, color="grey", linestyle="--", linewidth=0.8)
    speed_ax.set_ylabel("speed, % of the same variant on the unlimited link")
    speed_ax.set_ylim(0, 110)
    for ax in (time_ax, speed_ax):
        ax.set_xscale("log")
        ticks = sorted({x_of(p["rate"]) for p in points})
        if ax is speed_ax:
            ticks = sorted(finite)
        ax.set_xticks(ticks)
        ax.set_xticklabels(
            ["unlimited" if t == unlimited_x and ax is time_ax else f"{t:g}"
             for t in ticks]
        )  # fmt: skip
        # Only the rates on the x axis; a log y axis within one decade
        # (the codec runs) shows its values on its minor ticks.
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("loopback bandwidth (Gbit/s, both directions together)")
        ax.grid(True, which="major", alpha=0.3)
    time_ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def versus_unlimited(points: list[dict]) -> dict[str, dict[str, float]]:
    """Each variant's step time at each finite rate over its own time on the
    unlimited link: 1.0 is as fast as with no limit, 1 / 0.85 = 1.18 is
    85 % of that speed."""
    unlimited = next((p["ms"] for p in points if math.isinf(p["rate"])), {})
    return {
        variant: {
            p["label"]: p["ms"][variant] / unlimited[variant]
            for p in points
            if math.isfinite(p["rate"]) and variant in p["ms"]
        }
        for variant in VARIANTS
        if variant in unlimited
    }


def load_matched_speed(points: list[dict]) -> dict[str, dict[str, float]]:
    """Speed of each windowed variant (accum8, DiLoCo) at each finite rate as
    a fraction of its unlimited-link speed, from one launch's own local calls.

    A window of W calls costs ``W * local + extra``, where ``local`` is the
    median call that does not reduce and ``extra`` what the reducing call
    costs beyond one. Other programs' load changes ``local`` from launch to
    launch (2x on the shared development machine); this takes ``local``
    from the rate's own launch for both the unlimited and the limited
    window, and ``extra`` from each: the speed the link alone leaves.
    """
    runs = {
        p["label"]: {r["variant"]: r for r in p["runs"] if "ms_sync_call" in r}
        for p in points
    }
    unlimited = next((runs[p["label"]] for p in points if math.isinf(p["rate"])), {})
    speeds: dict[str, dict[str, float]] = {}
    for p in points:
        if math.isinf(p["rate"]):
            continue
        for variant, run_ in runs[p["label"]].items():
            if variant not in unlimited:
                continue
            calls = EVERY_K if variant == "accum8" else SYNC_EVERY
            base = unlimited[variant]
            local = run_["ms_local_call"]
            extra = run_["ms_sync_call"] - local
            extra_unlimited = base["ms_sync_call"] - base["ms_local_call"]
            speeds.setdefault(variant, {})[p["label"]] = (
                calls * local + extra_unlimited
            ) / (calls * local + extra)
    return speeds


def table(points: list[dict], accuracy: dict[str, list[float]]) -> str:
    def acc_text(variant: str) -> str:
        values = accuracy.get(variant)
        if not values:
            return "-"
        mean = 100 * sum(values) / len(values)
        return f"{mean:.1f} % ({100 * min(values):.1f}..{100 * max(values):.1f})"

    slowdown = versus_unlimited(points)
    matched = load_matched_speed(points)
    rows = [
        "| bandwidth | variant | ms / step | ms / window | repeats | vs f32 "
        "| vs own unlimited | speed | speed, load-matched | test accuracy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in points:
        for variant in VARIANTS:
            if variant not in p["ms"]:
                if variant in p.get("errors", {}):
                    rows.append(f"| {p['label']} | {variant} | failed |" + " |" * 7)
                continue
            ms = p["ms"][variant]
            window = p["ms"].get(f"{variant}_window")
            base = p["ms"].get("f32")
            ratio = f"{ms / base:.3f}" if base else "-"
            repeats = next(
                (r.get("repeats", "") for r in p["runs"] if r["variant"] == variant),
                "",
            )
            own = slowdown.get(variant, {}).get(p["label"])
            own_text = "-" if own is None else f"{own:.2f}x"
            speed = "-" if own is None else f"{100 / own:.0f} %"
            same_load = matched.get(variant, {}).get(p["label"])
            same_load_text = "-" if same_load is None else f"{100 * same_load:.0f} %"
            rows.append(
                f"| {p['label']} | {variant} | {ms:.1f} | "
                f"{'' if window is None else f'{window:.1f}'} | {repeats} | {ratio} | "
                f"{own_text} | {speed} | {same_load_text} | {acc_text(variant)} |"
            )
    return "\n".join(rows)


def bytes_table(points: list[dict]) -> str:
    """What each device receives, per step and per sync or window, from the
    compiled steps of the first rate's run (`_network_worker.received_bytes`)."""
    rows = [
        "| variant | kB received per step | kB per sync / window |",
        "|---|---:|---:|",
    ]
    for run_ in next((p["runs"] for p in points if p["runs"]), []):
        received = run_.get("received_bytes", {})
        rows.append(
            f"| {run_['variant']} | {received.get('entry', 0) / 1e3:.1f} "
            f"| {received.get('loop', 0) / 1e3:.1f} |"
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
        default=[math.inf, 1.0, 0.1, 0.01],
        help="Gbit/s, or 'unlimited' (default: unlimited 1 0.1 0.01)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--budget",
        type=float,
        default=20,
        help="seconds of warmup and repeats per variant and rate (at least one "
        "repeat is timed)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=4,
        help="examples per process per step of the timed MLP (default 4: "
        "little arithmetic, so that communication shows)",
    )
    parser.add_argument("--seeds", type=int, default=3, help="0 skips accuracy")
    parser.add_argument(
        "--updates", type=int, default=300, help="optimizer updates per accuracy run"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per launch of the 2 workers"
    )
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument(
        "--stem", default="network", help="the figures go to <stem>.json and .png"
    )
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
                    f"--budget={args.budget}", f"--batch={args.batch}",
                    # Bytes do not depend on the rate: read once.
                    *(["--count-bytes"] if not points else []),
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
                # Other programs' load skews the timings: kept with them.
                point["load_average"] = os.getloadavg()
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
        f"2 processes x 1 CPU device, gloo, {num_params or '?'} params, "
        f"{args.batch} examples per process; "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    print()
    print(table(points, accuracy))
    print()
    print(bytes_table(points))
    print()
    where = "none" if cross["gbit"] is None else f"{cross['gbit']:.3g} Gbit/s"
    print(f"crossover: {where} ({cross['note']})")
    for variant, ratios in versus_f32.items():
        for label, ratio in ratios.items():
            print(f"{variant} / f32 step time at {label}: {ratio:.3f}")
    own_unlimited = versus_unlimited(points)
    for variant, ratios in own_unlimited.items():
        for label, ratio in ratios.items():
            print(
                f"{variant} at {label}: {ratio:.3f}x its unlimited step time "
                f"({100 / ratio:.0f} % of its speed)"
            )
    for p in points:
        print(f"load average (1, 5, 15 min) after {p['label']}: {p['load_average']}")
    print(f"total: {time.monotonic() - started:.0f} s")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.stem}.json"
    png_path = args.out_dir / f"{args.stem}.png"
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
        "mtu": MTU,
        "burst_bytes": {
            rate_label(rate): burst_bytes(rate)
            for rate in args.rates
            if math.isfinite(rate)
        },
        "diloco_vs_f32": versus_f32,
        "vs_own_unlimited": own_unlimited,
        "load_matched_speed": load_matched_speed(points),
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
