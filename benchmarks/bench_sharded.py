"""Data parallelism under jax.jit: all-reduces per window, ours vs optax.

Eight emulated CPU devices, one Explicit ``data`` mesh axis, replicated
params (>= 4M, float32), a batch sharded over the devices, k micro-batches
per update, adam inside, params and state donated. Both contenders run the
same model and loss in a jitted train step:

* optax: ``jax.grad`` of the mean loss (XLA all-reduces the gradients on
  every micro-step) fed to ``optax.MultiSteps``;
* ours: `gradaccum_jax.local_value_and_grad` (per-device gradients, left
  unreduced) fed to ``gradaccum_jax.MultiSteps(..., unreduced_axes="data")``,
  which reduces the window once, when it emits;
* ours, ternary: the same with ``window_reduction=ternary_window_reduction``
  (the window's sum sent as ternary codes, inside the emission's loop).

Reported: gradient bytes all-reduced per window, read from the compiled
step's HLO (all-reduces outside loops run on every micro-step and count k
times; those inside the emission loop run once per window), and the median
wall time of a whole window of k steps.

Run: ``python benchmarks/bench_sharded.py [--params 4200000] [--k 8]``
"""

from __future__ import annotations

import _devices

_devices.emulate(8)  # before jax is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import _headline  # noqa: E402
import gradaccum_jax  # noqa: E402
from gradaccum_jax.measure import all_reduces  # noqa: E402

N_DEVICES = 8


def make_params(num_params: int, width: int = 1024) -> dict[str, jax.Array]:
    """Two dense layers ``width -> hidden -> width`` with ~num_params weights."""
    hidden = max(1, num_params // (2 * width))
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (width, hidden)) / np.sqrt(width),
        "w2": jax.random.normal(k2, (hidden, width)) / np.sqrt(hidden),
    }
    return jax.device_put(params, P())


def loss_fn(params, x, y):
    # Cheap on purpose: a few examples per device, so that the gradient's
    # all-reduce, not the model, is what a micro-step costs.
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def optax_step(k):
    tx = optax.MultiSteps(optax.adam(1e-3), k)

    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx, step


def ours_step(k, window_reduction=None):
    tx = gradaccum_jax.MultiSteps(
        optax.adam(1e-3),
        k,
        unreduced_axes="data",
        window_reduction=window_reduction,
    )
    grad_fn = gradaccum_jax.local_value_and_grad(loss_fn, "data")

    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx, step


def bytes_per_window(compiled, k: int) -> int:
    """All-reduced bytes of k calls, one of which emits."""
    total = 0
    for op in all_reduces(compiled):
        total += op.nbytes * (k if op.place == "entry" else 1)
    return total


def measure(make_step, params, batches, k, repeats):
    tx, step = make_step(k)
    state = jax.jit(tx.init)(params)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled = jitted.lower(params, state, *batches[0]).compile()
    params = jax.tree.map(jnp.copy, params)
    times = []
    for repeat in range(repeats + 1):  # the first window warms up
        start = time.perf_counter()
        for x, y in batches:
            params, state = jitted(params, state, x, y)
        jax.block_until_ready((params, state))
        if repeat:
            times.append(time.perf_counter() - start)
    return bytes_per_window(compiled, k), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=4_200_000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="per micro-step")
    parser.add_argument("--repeats", type=int, default=5)
    _headline.add_argument(parser)
    args = parser.parse_args()

    mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
    jax.set_mesh(mesh)
    params = make_params(args.params)
    num_params = sum(p.size for p in jax.tree.leaves(params))
    width = params["w1"].shape[0]
    rs = np.random.RandomState(0)
    batches = [
        tuple(
            jax.device_put(rs.randn(args.batch, width).astype(np.float32), P("data"))
            for _ in range(2)
        )
        for _ in range(args.k)
    ]
    results = {
        "optax.MultiSteps + jax.grad": measure(
            optax_step, params, batches, args.k, args.repeats
        ),
        "ours + local_value_and_grad": measure(
            ours_step, params, batches, args.k, args.repeats
        ),
        "ours, ternary window": measure(
            lambda k: ours_step(k, gradaccum_jax.ternary_window_reduction(0)),
            params,
            batches,
            args.k,
            args.repeats,
        ),
    }
    ref_bytes, ref_time = results["optax.MultiSteps + jax.grad"]
    print(
        f"{N_DEVICES} CPU devices, {num_params:,} float32 params, k={args.k}, "
        f"batch {args.batch} per micro-step, median of {args.repeats} windows\n"
    )
    print(
        "| implementation | MB all-reduced / window | vs optax | window ms | vs optax |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, (nbytes, seconds) in results.items():
        print(
            f"| {name} | {nbytes / 1e6:.2f} | {nbytes / ref_bytes:.3f} "
            f"| {seconds * 1e3:.1f} | {seconds / ref_time:.2f} |"
        )
    ours_bytes, ours_time = results["ours + local_value_and_grad"]
    _headline.write(
        args.json,
        "bench_sharded",
        {
            # 1.0 = exactly 1/k of optax's bytes; the window weight's 4 bytes
            # ride along in the same fused all-reduce.
            "all-reduced bytes per window x k / optax's": (
                ours_bytes * args.k / ref_bytes,
                1.0 + 16 * args.k / ref_bytes,
            ),
            "window time / optax's": (ours_time / ref_time, 0.6),
        },
    )


if __name__ == "__main__":
    main()
