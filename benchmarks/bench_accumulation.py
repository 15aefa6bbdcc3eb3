"""gradaccum_jax.MultiSteps against optax.MultiSteps, side by side in one run.

A jitted train step (``update`` + ``optax.apply_updates``, params and state
donated) on float32 params with adam inside, k micro-batches per update.
Reported per implementation: median time of a non-emitting micro-step, of the
emitting step and of a whole window, and the compiled temporary bytes
(``memory_analysis().temp_size_in_bytes``). The floor is a donated
``acc += g`` over the same params: the least any accumulator can do.

Run: ``python benchmarks/bench_accumulation.py [--params 16000000] [--k 8]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import optax

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

    # The gradients are donated too: in a real train step they are a temporary
    # of the step, dead once the optimizer has consumed them.
    return jax.jit(step, donate_argnums=(0, 1, 2))


def floor_fn():
    def step(acc, grads):
        return jax.tree.map(lambda a, g: a + g, acc, grads)

    return jax.jit(step, donate_argnums=(0,))


def fresh_copy(tree):
    """A copy made outside the timed region, for an argument that is donated."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def temp_bytes(jitted, *args) -> int:
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def time_windows(tx, params, grads, k: int, windows: int):
    """Times each call; returns (non-emitting times, emitting times, window times)."""
    step = train_step_fn(tx)
    opt_state = tx.init(params)
    # Two warm-up windows: compilation, then first-touch page faults.
    for _ in range(2 * k):
        params, opt_state = step(params, opt_state, fresh_copy(grads))
    jax.block_until_ready((params, opt_state))
    non_emitting, emitting, window_times = [], [], []
    for _ in range(windows):
        window = 0.0
        for micro in range(k):
            micro_grads = fresh_copy(grads)
            start = time.perf_counter()
            params, opt_state = step(params, opt_state, micro_grads)
            jax.block_until_ready((params, opt_state))
            elapsed = time.perf_counter() - start
            window += elapsed
            (emitting if micro == k - 1 else non_emitting).append(elapsed)
        window_times.append(window)
    return non_emitting, emitting, window_times


def time_floor(params, grads, repeats: int) -> float:
    step = floor_fn()
    acc = jax.tree.map(jnp.zeros_like, params)
    for _ in range(3):
        acc = step(acc, grads)
    jax.block_until_ready(acc)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        acc = step(acc, grads)
        jax.block_until_ready(acc)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--windows", type=int, default=5)
    args = parser.parse_args()
    # optax.MultiSteps cannot reuse the donated gradients; jax warns about it.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

    params = make_params(args.params)
    grads = make_grads(params)
    k = args.k
    inner = optax.adam(1e-3)
    contenders = {
        "optax.MultiSteps": optax.MultiSteps(inner, k).gradient_transformation(),
        "gradaccum_jax.MultiSteps": gradaccum_jax.MultiSteps(
            inner, k
        ).gradient_transformation(),
    }

    floor = time_floor(params, grads, repeats=args.windows * k)
    floor_temp = temp_bytes(floor_fn(), params, grads)
    rows = {}
    for name, tx in contenders.items():
        temp = temp_bytes(train_step_fn(tx), params, tx.init(params), grads)
        non_emitting, emitting, windows = time_windows(
            tx, make_params(args.params), grads, k, args.windows
        )
        rows[name] = (
            statistics.median(non_emitting),
            statistics.median(emitting),
            statistics.median(windows),
            temp,
        )

    ref = rows["optax.MultiSteps"]
    ours = rows["gradaccum_jax.MultiSteps"]
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


if __name__ == "__main__":
    main()
