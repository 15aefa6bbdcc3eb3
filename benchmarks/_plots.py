"""The plots of ``run_all.py``: how much faster and lighter, and how it grows.

Each function takes the ``data`` a benchmark wrote with ``_headline.write``
and draws one PNG with matplotlib's Agg backend (no display needed); the
machine goes in the title, since absolute figures depend on it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OURS, OPTAX, FLOOR = "gradaccum_jax.MultiSteps", "optax.MultiSteps", "floor"
STYLE = {
    OURS: {"color": "tab:blue", "marker": "o", "label": "gradaccum_jax.MultiSteps"},
    OPTAX: {"color": "tab:orange", "marker": "s", "label": "optax.MultiSteps"},
    FLOOR: {
        "color": "gray",
        "marker": "^",
        "linestyle": "--",
        "label": "floor: jitted, donated acc += g",
    },
}
MIB = 2**20
GIB = 2**30


def _save(fig, path: Path, rect: tuple | None = None) -> Path:
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accumulation_vs_params(sweep: list[dict], path: Path, where: str) -> Path:
    """Micro-step time and compiled temporaries against parameter count."""
    params = [point["params"] for point in sweep]
    k = sweep[0]["k"]
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in (OURS, OPTAX, FLOOR):
        time_ax.plot(params, [p[name]["micro_s"] * 1e3 for p in sweep], **STYLE[name])
        memory_ax.plot(
            params, [p[name]["temp_bytes"] / MIB for p in sweep], **STYLE[name]
        )
    time_ax.set_yscale("log")
    time_ax.set_ylabel("non-emitting micro-step (ms, median)")
    time_ax.set_title(f"Micro-step time, adam, k={k}")
    memory_ax.set_ylabel("compiled temporary memory (MiB)")
    memory_ax.set_title("Temporary memory of one jitted train step")
    for ax in (time_ax, memory_ax):
        ax.set_xscale("log")
        ax.set_xlabel("float32 parameters")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Gradient accumulation against model size ({where})", fontsize=10)
    return _save(fig, path)


def window_vs_k(sweep: list[dict], path: Path, where: str) -> Path:
    """Time of a whole window (k micro-steps, one update) against k."""
    ks = [point["k"] for point in sweep]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in (OURS, OPTAX):
        ax.plot(ks, [p[name]["window_s"] * 1e3 for p in sweep], **STYLE[name])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (micro-steps per update)")
    ax.set_ylabel("window time (ms, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"Window time, {sweep[0]['params'] / 1e6:g}M params, adam\n({where})",
        fontsize=10,
    )
    return _save(fig, path)


def microbatch_memory(data: dict, path: Path, where: str) -> Path:
    """Compiled temporary memory against the number of micro-batches."""
    counts = data["microbatches"][1:]
    memory = [b / MIB for b in data["temp_bytes"]]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(
        counts,
        memory[1:],
        marker="o",
        color="tab:blue",
        label="microbatched_value_and_grad",
    )
    ax.axhline(
        memory[0], color="tab:orange", linestyle="--", label="jax.value_and_grad"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("micro-batches per step")
    ax.set_ylabel("compiled temporary memory (MiB)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"Micro-batching, batch {data['batch']}, {data['model']}\n({where})",
        fontsize=9,
    )
    return _save(fig, path)


def wire_bytes(data: dict, path: Path, where: str) -> Path:
    """All-reduce bytes of one averaging step against device count."""
    devices = data["devices"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    width = 0.38
    for offset, (name, color) in zip(
        (-width / 2, width / 2),
        (("float32 mean", "tab:orange"), ("ternary mean", "tab:blue")),
        strict=True,
    ):
        values = [b / MIB for b in data["bytes"][name]]
        bars = ax.bar(
            [i + offset for i in range(len(devices))],
            values,
            width,
            color=color,
            label={"float32 mean": "average_across_devices (float32)",
                   "ternary mean": "ternary_average_across_devices"}[name],
        )  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(devices)), [str(n) for n in devices])
    ax.set_xlabel("devices (emulated CPU devices)")
    ax.set_ylabel("all-reduce bytes per step (MiB, compiled HLO)")
    ax.legend(fontsize=8)
    ax.set_title(
        f"Bytes on the wire, {data['num_params'] / 1e6:.1f}M float32 params\n({where})",
        fontsize=10,
    )
    return _save(fig, path)


def ternary_accuracy(data: dict, path: Path, where: str) -> Path:
    """Test accuracy (mean, min..max band over seeds) against steps."""
    steps = data["steps"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, color in (("float32 mean", "tab:orange"), ("ternary mean", "tab:blue")):
        runs = data["accuracy"][name]
        ax.plot(
            steps, [sum(r) / len(r) for r in runs], marker="o", color=color, label=name
        )
        ax.fill_between(
            steps, [min(r) for r in runs], [max(r) for r in runs], color=color,
            alpha=0.2,
        )  # fmt: skip
    ax.set_xlabel("training steps (8 devices x 16 examples)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"Digits MLP, adam, {data['seeds']} seed(s): mean, band min..max\n({where})",
        fontsize=10,
    )
    return _save(fig, path)


# bench_low_communication's methods: the marker says the codec, the line
# the kind of method, the color tells the methods apart (every method of a
# figure its own, the same in each panel).
_CODEC_MARKERS = (
    ("PowerSGD", "*"),
    ("topk", "X"),
    ("ternary", "v"),
    ("int8", "P"),
    ("e2m1", "p"),
    ("F=4", "D"),
)
# tab20's dark shades, then its light ones, then tab20b's: neighbors in a
# legend differ in hue.
_COLORS = [
    *plt.get_cmap("tab20").colors[::2],
    *plt.get_cmap("tab20").colors[1::2],
    *plt.get_cmap("tab20b").colors,
]


def _plain_log_ticks(ax) -> None:
    """Tick labels of a log y axis as plain numbers (2, 3, 0.5), not 2 x
    10^0; its minor ticks labelled too where it spans less than a decade
    (else they crowd)."""
    low, high = ax.get_ylim()
    plain = matplotlib.ticker.FormatStrFormatter("%g")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(
        plain if high < 10 * low else matplotlib.ticker.NullFormatter()
    )


def low_communication_styles(names: list[str]) -> dict[str, dict]:
    """A line style per method of ``bench_low_communication.py``."""
    styles = {}
    colors = itertools.cycle(_COLORS)
    for name in names:
        marker = next((m for key, m in _CODEC_MARKERS if key in name), "o")
        if name.startswith("DiLoCo"):
            linestyle = "-."
        elif "window" in name:
            linestyle = "--"
        else:
            linestyle = "-"
        color = "black" if name == "DP float32" else next(colors)
        styles[name] = {"color": color, "marker": marker, "linestyle": linestyle}
    return styles


def low_communication(data: dict, path: Path, where: str) -> Path:
    """Validation loss against examples seen and against bytes received."""
    examples = data["examples"]
    fig, (examples_ax, bytes_ax) = plt.subplots(1, 2, figsize=(15, 5.2))
    styles = low_communication_styles(list(data["curves"]))
    for name, curve in data["curves"].items():
        style = {"markersize": 3, "linewidth": 1.2, **styles[name]}
        examples_ax.plot(examples, curve["loss"], label=name, **style)
        # Before its first sync a method has sent nothing: no place on a log axis.
        sent = [(b / MIB, loss) for b, loss in zip(curve["bytes"], curve["loss"],
                strict=True) if b > 0]  # fmt: skip
        bytes_ax.plot(*zip(*sent, strict=True), label=name, **style)
    unit = data.get("unit", "examples")
    examples_ax.set_xlabel(f"{unit} seen (all devices)")
    bytes_ax.set_xscale("log")
    bytes_ax.set_xlabel(
        "bytes received so far (MiB: every collective, compiled HLO x runs)"
    )
    for ax in (examples_ax, bytes_ax):
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        ax.set_ylabel(f"validation loss (mean of {data['seeds']} seeds)")
        ax.grid(True, which="both", alpha=0.3)
    # One legend beside the panels: inside, it would hide the curves.
    fig.legend(*examples_ax.get_legend_handles_labels(), loc="center right", fontsize=7)
    fig.suptitle(
        f"{data['model']}, {data['devices']} devices x {data['per_device_batch']} "
        f"{unit} per step, inner {data['inner']}\n({where})",
        fontsize=10,
    )
    return _save(fig, path, rect=(0, 0, 1 - 2.9 / 15, 1))


def loss_against_bytes(records: list[dict], path: Path, where: str) -> Path:
    """Final validation loss against total bytes, one point per method and a
    panel per task (record of ``bench_low_communication.py``), both as
    ratios to data parallel float32's in the same record, on log axes (a
    diverged method sits far above the rest)."""
    names = list(dict.fromkeys(name for data in records for name in data["curves"]))
    # Tall enough for the legend: a line of 8 points per method and the band.
    height = max(4.6, 0.16 * (len(names) + 1) + 0.6)
    # Wide enough for the longest name: about 0.07 in a character at size 8.
    legend_width = 0.6 + 0.07 * max(len(name) for name in names)
    width = 5 * len(records) + legend_width
    fig, axes = plt.subplots(1, len(records), figsize=(width, height), squeeze=False)
    styles = low_communication_styles(names)
    legend = {}
    for ax, data in zip(axes[0], records, strict=True):
        base = data["curves"]["DP float32"]
        for name, curve in data["curves"].items():
            (legend[name],) = ax.plot(
                curve["bytes"][-1] / base["bytes"][-1],
                curve["loss"][-1] / base["loss"][-1],
                linestyle="none", markersize=8, label=name,
                color=styles[name]["color"], marker=styles[name]["marker"],
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        low, high = ax.get_ylim()
        legend["loss within 2 % of DP float32"] = ax.axhspan(
            low, 1.02, color="tab:green", alpha=0.08
        )
        ax.set_ylim(low, high)
        ax.axhline(1.0, color="black", linewidth=0.8, alpha=0.5)
        ax.set_xlabel("bytes received / DP float32's (compiled HLO x runs)")
        ax.set_ylabel(f"final validation loss / DP float32's ({data['seeds']} seeds)")
        ax.set_title(
            f"{data['model']},\n{data['steps']} steps x {data['devices']} devices",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
    # One legend for all panels, beside them: the points fill the corners.
    fig.legend(legend.values(), legend.keys(), loc="center right", fontsize=8)
    fig.suptitle(f"Loss against bytes, every method at the end of training ({where})",
                 fontsize=10)  # fmt: skip
    return _save(fig, path, rect=(0, 0, 1 - legend_width / width, 1))


def scale(results: list[dict], path: Path, where: str) -> Path:
    """What a device holds in its own memory (arguments + outputs +
    temporaries - aliased, less what is in host memory, plus what a DiLoCo
    sync brings from there) and collective bytes per window of each path,
    per config."""
    configs = list(dict.fromkeys(r["config"] for r in results))
    fig, (memory_ax, bytes_ax) = plt.subplots(1, 2, figsize=(13, 5.5))
    width = 0.8 / max(len(configs), 1)
    paths = list(dict.fromkeys(r["path"] for r in results))
    y = np.arange(len(paths))
    lowest = {memory_ax: np.inf, bytes_ax: np.inf}
    for i, config in enumerate(configs):
        by_path = {r["path"]: r for r in results if r["config"] == config}
        # A path that did not compile has no figures: no bar.
        temps = [
            r.get("device_bytes", np.nan) / GIB
            for r in (by_path.get(p, {}) for p in paths)
        ]
        sent = [by_path.get(p, {}).get("window_bytes", np.nan) / GIB for p in paths]
        offset = y + (i - (len(configs) - 1) / 2) * width
        memory_ax.barh(offset, temps, height=width, label=config)
        bytes_ax.barh(offset, sent, height=width, label=config)
        lowest[memory_ax] = np.nanmin([lowest[memory_ax], *temps])
        lowest[bytes_ax] = np.nanmin([lowest[bytes_ax], *sent])
    for ax, title in (
        (memory_ax, "device memory per device, whole step (GiB)"),
        (bytes_ax, "collective result bytes per device per window (GiB)"),
    ):
        ax.set_yticks(y, paths, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        # Bars start well left of the smallest, so that its length shows.
        ax.set_xlim(left=lowest[ax] / 4)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    fig.legend(
        *memory_ax.get_legend_handles_labels(),
        loc="lower center",
        ncol=len(configs),
        fontsize=8,
    )
    bytes_ax.set_yticklabels([])
    fig.suptitle(
        f"Training paths at scale, compiled, not run (a missing bar: did not "
        f"compile) ({where})",
        fontsize=10,
    )
    return _save(fig, path, rect=(0, 0.06, 1, 1))  # the legend below
