"""gradaccum_jax.MultiSteps against optax.MultiSteps, side by side in one run.

A jitted train step (``update`` + ``optax.apply_updates``, params and state
donated) on float32 params with adam inside, k micro-batches per update.
Reported per implementation: median time of a non-emitting micro-step, of the
emitting step and of a whole window, and the compiled temporary bytes
(``memory_analysis().temp_size_in_bytes``). The floor is a donated
``acc += g`` over the same params: the least any accumulator can do. The
same wrapper with ``track_noise_scale=True`` runs alongside, with each
estimator: ``sampled`` (the default: one micro-batch's squared norm per
window, under a conditional, so the other micro-steps do not read the
gradients for it) and ``all`` (one squared norm of the gradients per
micro-step: XLA:CPU does not fuse it into the add's pass and reads the
gradients twice); both take one norm of the window per emission. The
target is at most 5% of the micro-step.

A last table times ``update`` called eagerly, without ``jax.jit``, at a
small size: optax's MultiSteps traces and compiles its ``lax.cond`` anew on
every call; ours branches in Python when nothing is traced.

``--sweep-params`` repeats the measurement at several parameter counts and
``--sweep-k`` at several window lengths (same code path, one row per point);
``--json`` then also carries every point, for ``run_all.py``'s plots.

Run: ``python benchmarks/bench_accumulation.py [--params 16000000] [--k 8]
[--sweep-params 1e6,4e6,16e6,64e6] [--sweep-k 2,4,8,16]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import _headline
import gradaccum_jax


def make_params(num_params: int, num_leaves: int = 4) -> dict[str, jax.Array]:
    per_leaf = num_params // num_leaves
    return {f"w{i}": jnp.zeros((per_leaf,), jnp.float32) for i in range(num_leaves)}


def make_grads(params, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), len(params))
    return {
        name: jax.random.normal(key, leaf.shape, leaf.dtype)
        for key, (name, leaf) in zip(keys, sorted(params.items()), strict=True)
    }


def train_step_fn(tx):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def floor_fn():
    def step(acc, grads):
        return (jax.tree.map(lambda a, g: a + g, acc, grads),)

    return jax.jit(step, donate_argnums=(0,))


def temp_bytes(jitted, *args) -> int:
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


class Contender:
    """One jitted step and its donated buffers, timed call by call."""

    def __init__(self, step, buffers, grads):
        self.step, self.buffers, self.grads = step, buffers, grads
        self.times: list[float] = []

    def call(self) -> None:
        start = time.perf_counter()
        self.buffers = jax.block_until_ready(self.step(*self.buffers, self.grads))
        self.times.append(time.perf_counter() - start)


def measure(contenders: dict[str, Contender], k: int, windows: int) -> None:
    """Runs the contenders window by window, interleaved, so that load from
    elsewhere on a shared machine falls on all of them alike."""
    for _ in range(2):  # warm-up windows: compilation and first-touch faults
        for contender in contenders.values():
            for _ in range(k):
                contender.call()
    for contender in contenders.values():
        contender.times.clear()
    for _ in range(windows):
        for contender in contenders.values():
            for _ in range(k):
                contender.call()


def summarize(times: list[float], k: int) -> tuple[float, float, float]:
    """(median non-emitting call, median emitting call, median window)."""
    micro = [t for i, t in enumerate(times) if i % k != k - 1]
    emit = [t for i, t in enumerate(times) if i % k == k - 1]
    window = [sum(times[i : i + k]) for i in range(0, len(times), k)]
    return statistics.median(micro), statistics.median(emit), statistics.median(window)


TRACKED = "gradaccum_jax.MultiSteps, track_noise_scale (sampled)"
TRACKED_ALL = "gradaccum_jax.MultiSteps, track_noise_scale (all)"
# At k=2 five windows hold five non-emitting micro-steps: too few for a
# median on a shared machine.
MIN_MICRO_SAMPLES = 24
# Eager calls are dominated by dispatch and compilation, not by memory
# traffic: a small model shows that cost, a large one would hide it.
EAGER_PARAMS = 100_000
IMPLEMENTATIONS = (
    "optax.MultiSteps",
    "gradaccum_jax.MultiSteps",
    TRACKED,
    TRACKED_ALL,
)


def measure_point(num_params: int, k: int, windows: int) -> dict[str, dict]:
    """Times and compiled temporaries of every implementation at one size.

    Returns ``{name: {"micro_s", "emit_s", "window_s", "temp_bytes"}}`` for
    every implementation, and ``{"micro_s", "temp_bytes"}`` for "floor".
    Short windows get more of them, so that every median of non-emitting
    micro-steps has at least `MIN_MICRO_SAMPLES` samples.
    """
    if k < 2:
        raise ValueError(
            f"`k` must be at least 2 (a window with a micro-step), got {k}."
        )
    windows = max(windows, -(-MIN_MICRO_SAMPLES // (k - 1)))
    params = make_params(num_params)
    grads = make_grads(params)
    inner = optax.adam(1e-3)
    transformations = {
        "optax.MultiSteps": optax.MultiSteps(inner, k).gradient_transformation(),
        "gradaccum_jax.MultiSteps": gradaccum_jax.MultiSteps(
            inner, k
        ).gradient_transformation(),
        TRACKED: gradaccum_jax.MultiSteps(
            inner, k, track_noise_scale=True
        ).gradient_transformation(),
        TRACKED_ALL: gradaccum_jax.MultiSteps(
            inner, k, track_noise_scale=True, noise_scale_estimator="all"
        ).gradient_transformation(),
    }
    runners = {
        name: Contender(
            train_step_fn(tx), (make_params(num_params), tx.init(params)), grads
        )
        for name, tx in transformations.items()
    }
    runners["floor"] = Contender(floor_fn(), (make_params(num_params),), grads)
    measure(runners, k, windows)
    point = {}
    for name, tx in transformations.items():
        micro, emit, window = summarize(runners[name].times, k)
        point[name] = {
            "micro_s": micro,
            "emit_s": emit,
            "window_s": window,
            "temp_bytes": temp_bytes(train_step_fn(tx), params, tx.init(params), grads),
        }
    point["floor"] = {
        "micro_s": statistics.median(runners["floor"].times),
        "temp_bytes": temp_bytes(floor_fn(), params, grads),
    }
    return point


def print_point(num_params: int, k: int, point: dict[str, dict]) -> None:
    mib = 2**20
    print(f"\n## {num_params / 1e6:g}M float32 params, adam, k={k}\n")
    print(
        "| implementation | micro-step (ms) | emitting step (ms) | window (ms) "
        "| temporaries (MiB) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in IMPLEMENTATIONS:
        row = point[name]
        print(
            f"| {name} | {row['micro_s'] * 1e3:.1f} | {row['emit_s'] * 1e3:.1f} "
            f"| {row['window_s'] * 1e3:.1f} | {row['temp_bytes'] / mib:.1f} |"
        )
    floor = point["floor"]
    print(
        f"| floor: donated `acc += g` | {floor['micro_s'] * 1e3:.1f} | | "
        f"| {floor['temp_bytes'] / mib:.1f} |"
    )
    ours, ref = point["gradaccum_jax.MultiSteps"], point["optax.MultiSteps"]
    print(
        f"\nours / optax: micro-step {ours['micro_s'] / ref['micro_s']:.2f}, "
        f"window {ours['window_s'] / ref['window_s']:.2f}, temporaries "
        f"{ours['temp_bytes'] / max(ref['temp_bytes'], 1):.2f}; ours / floor: "
        f"micro-step {ours['micro_s'] / floor['micro_s']:.2f}"
    )
    for name, label in ((TRACKED, "sampled"), (TRACKED_ALL, "all")):
        tracked = point[name]
        print(
            f"noise scale tracked ({label}) / not: micro-step "
            f"{tracked['micro_s'] / ours['micro_s']:.3f}, window "
            f"{tracked['window_s'] / ours['window_s']:.3f} (target <= 1.05)"
        )


def measure_eager(num_params: int, k: int, windows: int) -> dict[str, float]:
    """Median seconds per ``update`` call without ``jax.jit``, as in an
    optax-style loop written eagerly (debugging, a notebook cell).

    Returns ``{name: seconds}`` for optax's and our MultiSteps (adam inside),
    timed by `measure` like the jitted steps (its warm-up windows compile
    each eager op once).
    """

    def eager_step(tx):
        def step(params, state, grads):
            return params, tx.update(grads, state, params)[1]

        return step

    params = make_params(num_params)
    grads = make_grads(params)
    contenders = {
        name: Contender(eager_step(tx), (params, tx.init(params)), grads)
        for name, tx in (
            ("optax.MultiSteps", optax.MultiSteps(optax.adam(1e-3), k)),
            ("gradaccum_jax.MultiSteps", gradaccum_jax.MultiSteps(optax.adam(1e-3), k)),
        )
    }
    measure(contenders, k, windows)
    return {name: statistics.median(c.times) for name, c in contenders.items()}


def print_eager(num_params: int, k: int, eager: dict[str, float]) -> None:
    print(f"\n## eager `update` (no jax.jit), {num_params / 1e6:g}M params, k={k}\n")
    print("| implementation | ms per call (median) |")
    print("|---|---:|")
    for name, seconds in eager.items():
        print(f"| {name} | {seconds * 1e3:.1f} |")
    ratio = eager["gradaccum_jax.MultiSteps"] / eager["optax.MultiSteps"]
    print(f"\nours / optax, eager: {ratio:.3f}")


def counts(text: str) -> list[int]:
    """``"1e6,4e6"`` -> ``[1000000, 4000000]``."""
    return [int(float(item)) for item in text.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params", type=lambda text: int(float(text)), default=16_000_000
    )
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument(
        "--sweep-params",
        type=counts,
        default=[],
        metavar="N,N,...",
        help="also measure at these parameter counts (window length --k)",
    )
    parser.add_argument(
        "--sweep-k",
        type=counts,
        default=[],
        metavar="K,K,...",
        help="also measure at these window lengths (--params parameters)",
    )
    _headline.add_argument(parser)
    args = parser.parse_args()
    print(
        f"# accumulation: {jax.devices()[0].platform} "
        f"({platform.processor() or platform.machine()}, "
        f"{jax.device_count()} device(s)), jax {jax.__version__}, "
        f"optax {optax.__version__}; medians of at least {args.windows} windows "
        f"and {MIN_MICRO_SAMPLES} non-emitting micro-steps"
    )

    points: dict[tuple[int, int], dict] = {}

    def point_at(num_params: int, k: int) -> dict:
        if (num_params, k) not in points:
            points[num_params, k] = measure_point(num_params, k, args.windows)
            print_point(num_params, k, points[num_params, k])
        return points[num_params, k]

    head = point_at(args.params, args.k)
    sweep_params = [
        {"params": n, "k": args.k, **point_at(n, args.k)} for n in args.sweep_params
    ]
    sweep_k = [
        {"params": args.params, "k": k, **point_at(args.params, k)}
        for k in args.sweep_k
    ]

    eager = measure_eager(EAGER_PARAMS, args.k, windows=2)
    print_eager(EAGER_PARAMS, args.k, eager)

    ours, ref = head["gradaccum_jax.MultiSteps"], head["optax.MultiSteps"]
    floor, tracked = head["floor"], head[TRACKED]
    _headline.write(
        args.json,
        "accumulation",
        {
            "micro-step, ours / optax.MultiSteps": (
                ours["micro_s"] / ref["micro_s"],
                0.3,
            ),
            "micro-step, ours / floor": (ours["micro_s"] / floor["micro_s"], 5.0),
            "window, ours / optax.MultiSteps": (
                ours["window_s"] / ref["window_s"],
                0.5,
            ),
            "temporaries, ours / optax.MultiSteps": (
                ours["temp_bytes"] / max(ref["temp_bytes"], 1),
                1.0,
            ),
            "micro-step, noise scale tracked (sampled) / not": (
                tracked["micro_s"] / ours["micro_s"],
                1.05,
            ),
            "eager update call, ours / optax.MultiSteps": (
                eager["gradaccum_jax.MultiSteps"] / eager["optax.MultiSteps"],
                1.0,
            ),
        },
        data={"sweep_params": sweep_params, "sweep_k": sweep_k},
    )


if __name__ == "__main__":
    main()
