"""gradaccum_jax.MultiSteps against optax.MultiSteps, side by side in one run.

A jitted train step (``update`` + ``optax.apply_updates``, params and state
donated) on float32 params with adam inside, k micro-batches per update.
Reported per implementation: median time of a non-emitting micro-step, of the
emitting step and of a whole window, and the compiled temporary bytes
(``memory_analysis().temp_size_in_bytes``). The floor is a donated
``acc += g`` over the same params: the least any accumulator can do. The
same wrapper with ``track_noise_scale=True`` runs alongside: the gradient
noise scale's statistics (one fused squared norm per micro-step, one per
emission) must cost at most 5% of the micro-step.

Run: ``python benchmarks/bench_accumulation.py [--params 16000000] [--k 8]``
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--windows", type=int, default=5)
    _headline.add_argument(parser)
    args = parser.parse_args()

    params = make_params(args.params)
    grads = make_grads(params)
    k = args.k
    inner = optax.adam(1e-3)
    contenders = {
        "optax.MultiSteps": optax.MultiSteps(inner, k).gradient_transformation(),
        "gradaccum_jax.MultiSteps": gradaccum_jax.MultiSteps(
            inner, k
        ).gradient_transformation(),
        "gradaccum_jax.MultiSteps, track_noise_scale": gradaccum_jax.MultiSteps(
            inner, k, track_noise_scale=True
        ).gradient_transformation(),
    }

    runners = {
        name: Contender(
            train_step_fn(tx), (make_params(args.params), tx.init(params)), grads
        )
        for name, tx in contenders.items()
    }
    runners["floor"] = Contender(floor_fn(), (make_params(args.params),), grads)
    measure(runners, k, args.windows)
    rows = {
        name: (
            *summarize(runners[name].times, k),
            temp_bytes(train_step_fn(tx), params, tx.init(params), grads),
        )
        for name, tx in contenders.items()
    }
    floor = statistics.median(runners["floor"].times)
    floor_temp = temp_bytes(floor_fn(), params, grads)

    ref = rows["optax.MultiSteps"]
    ours = rows["gradaccum_jax.MultiSteps"]
    tracked = rows["gradaccum_jax.MultiSteps, track_noise_scale"]
    mib = 2**20
    print(
        f"# accumulation: {args.params / 1e6:.0f}M float32 params, adam, k={k}, "
        f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()}, "
        f"{jax.device_count()} device(s)), jax {jax.__version__}, "
        f"optax {optax.__version__}"
    )
    print()
    print(
        "| implementation | micro-step (ms) | emitting step (ms) | window (ms) "
        "| temporaries (MiB) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, (micro, emit, window, temp) in rows.items():
        print(
            f"| {name} | {micro * 1e3:.1f} | {emit * 1e3:.1f} | {window * 1e3:.1f} "
            f"| {temp / mib:.1f} |"
        )
    print(
        f"| floor: donated `acc += g` | {floor * 1e3:.1f} | | "
        f"| {floor_temp / mib:.1f} |"
    )
    print()
    print("| ratio | measured | target |")
    print("|---|---:|---:|")
    print(f"| micro-step, ours / optax | {ours[0] / ref[0]:.2f} | <= 0.30 |")
    print(f"| micro-step, ours / floor | {ours[0] / floor:.2f} | <= 5.00 |")
    print(f"| window, ours / optax | {ours[2] / ref[2]:.2f} | <= 0.50 |")
    print(f"| temporaries, ours / optax | {ours[3] / max(ref[3], 1):.2f} | <= 1.00 |")
    print(
        f"| micro-step, noise scale tracked / not | {tracked[0] / ours[0]:.3f} "
        "| <= 1.05 |"
    )
    print(
        f"| window, noise scale tracked / not | {tracked[2] / ours[2]:.3f} | <= 1.05 |"
    )
    _headline.write(
        args.json,
        "accumulation",
        {
            "micro-step, ours / optax.MultiSteps": (ours[0] / ref[0], 0.3),
            "micro-step, ours / floor": (ours[0] / floor, 5.0),
            "window, ours / optax.MultiSteps": (ours[2] / ref[2], 0.5),
            "temporaries, ours / optax.MultiSteps": (ours[3] / max(ref[3], 1), 1.0),
            "micro-step, noise scale tracked / not": (tracked[0] / ours[0], 1.05),
        },
    )


if __name__ == "__main__":
    main()
