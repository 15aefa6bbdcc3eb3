"""The gradient noise scale's two estimators: their spread and their cost.

``noise_scale_estimator="sampled"`` (the default) measures one micro-batch's
squared norm per window (``A ~ m w_j |g_j|^2``, slot j drawn uniformly);
``"all"`` measures every micro-batch's (``A = sum_i w_i |g_i|^2``). Both are
unbiased; sampling costs variance and saves a read of the gradients on all
micro-steps but one per window.

Spread: on the closed-form problem of ``tests/test_noise_scale.py`` (linear
regression, per-example gradient ``(x.delta - eps) x`` with x ~ N(0, I),
eps ~ N(0, sigma^2): ``G = delta``, ``tr(S) = d (|delta|^2 + sigma^2) +
|delta|^2``), many runs of windows of k micro-batches, equal or ragged
weights. Per window (``noise_scale_decay=0``): the mean and the standard
deviation of the ``|G|^2`` and ``tr(S)`` estimates relative to the truth.
``B_simple`` as `stats` reports it (bias-corrected moving averages, decay
0.95) after a run of windows: mean and standard deviation over the runs,
relative to the truth. Every window has its own index (the draw's), across
runs too.

Cost: a jitted train step (``update`` + ``apply_updates``, params and state
donated, adam inside) at 16M float32 params, untracked, sampled and all,
interleaved window by window: the median non-emitting micro-step, the mean
non-emitting micro-step (the sampled one's measured step included) and the
median window, and their ratios to untracked. The target is 1.05 on the
micro-step.

Ternary (``--ternary``, alone, on 8 emulated CPU devices): the same
regression at 256 parameters, each device with its own 4 examples per
micro-batch, windows of 4 micro-batches (``"all"``) reduced by a float
all-reduce or by `ternary_window_reduction` (with and without clipping):
the mean and standard error of the windows' ``|G|^2`` and ``tr(S)``
estimates against the truth, and ``B_simple`` as their ratio; and the
same micro-batches on one device in a `ternary_accumulate` window (which
now refuses the noise scale). Run it on an older revision for the
estimates before the codes' rounding was subtracted.

Run: ``python benchmarks/bench_noise_scale.py [--runs 400] [--windows 100]
[--params 16e6] [--k 8] [--timing-windows 8] [--skip-timing]
[--ternary [--ternary-windows 1000]]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import _devices

if "--ternary" in sys.argv:  # before jax is imported: 8 devices to reduce over
    _devices.emulate(8)

import bench_accumulation
import jax
import jax.numpy as jnp
import numpy as np
import optax

import _headline
import gradaccum_jax as ga

DIM, SIGMA = 4, 1.0
DELTA = np.array([0.5, -0.3, 0.2, 0.1])  # w - w*
TRUE_G2 = float(DELTA @ DELTA)
TRUE_TRACE = DIM * (TRUE_G2 + SIGMA**2) + TRUE_G2
TRUE_B = TRUE_TRACE / TRUE_G2
ESTIMATORS = ("sampled", "all")
SIZES = {
    "equal (8 x 4)": [4] * 8,
    "ragged (1..7, 12)": [1, 2, 3, 4, 5, 6, 7, 12],
    "alternating (2, 14)": [2, 14] * 4,
}
SMOOTHING = 0.95  # MultiSteps' default noise_scale_decay


def window_estimates(sizes, estimator: str, runs: int, windows: int):
    """``(|G|^2, tr(S))`` of every window, shaped ``(runs, windows)``.

    Run r's windows are windows ``r * windows ...`` of one long run (their
    ``gradient_step``), so every window draws its own slot.
    """
    sizes = np.asarray(sizes)
    k, width = len(sizes), int(sizes.max())
    mask = jnp.asarray(np.arange(width)[None, :] < sizes[:, None], jnp.float32)
    w_star = jnp.ones(DIM)
    w = w_star + jnp.asarray(DELTA, jnp.float32)
    opt = ga.MultiSteps(
        optax.sgd(0.0),
        k,
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator=estimator,
    )

    def window(state, key):
        kx, ke = jax.random.split(key)
        x = jax.random.normal(kx, (k, width, DIM))
        y = x @ w_star + SIGMA * jax.random.normal(ke, (k, width))

        def micro_step(state, micro_batch):
            xi, yi, mi = micro_batch
            g = ((xi @ w - yi) * mi) @ xi / jnp.maximum(mi.sum(), 1.0)
            return opt.update(g, state, w, weight=mi.sum())[1], None

        state, _ = jax.lax.scan(micro_step, state, (x, y, mask))
        stats = opt.stats(state)
        return state, (stats.grad_sq_norm, stats.noise_trace)

    def run(key, first_window):
        state = opt.init(w)._replace(gradient_step=first_window)
        _, estimates = jax.lax.scan(window, state, jax.random.split(key, windows))
        return estimates

    keys = jax.random.split(jax.random.key(0), runs)
    first = jnp.arange(runs, dtype=jnp.int32) * windows
    g2, trace = jax.jit(jax.vmap(run))(keys, first)
    return np.asarray(g2, np.float64), np.asarray(trace, np.float64)


def smoothed_noise_scale(g2, trace, decay: float = SMOOTHING):
    """``B_simple`` of `stats` after each run: bias-corrected averages' ratio."""
    weights = (1 - decay) * decay ** np.arange(g2.shape[1])[::-1]
    correction = 1 - decay ** g2.shape[1]
    return (trace @ weights / correction) / (g2 @ weights / correction)


def spread(runs: int, windows: int) -> dict:
    rows = {}
    for name, sizes in SIZES.items():
        for estimator in ESTIMATORS:
            g2, trace = window_estimates(sizes, estimator, runs, windows)
            b = smoothed_noise_scale(g2, trace)
            rows[name, estimator] = {
                "g2": (g2.mean() / TRUE_G2, g2.std() / TRUE_G2),
                "trace": (trace.mean() / TRUE_TRACE, trace.std() / TRUE_TRACE),
                "b": (b.mean() / TRUE_B, b.std() / TRUE_B),
            }
    return rows


def print_spread(rows: dict, runs: int, windows: int) -> None:
    print(
        f"\n## spread: {runs} runs x {windows} windows, truth |G|^2 = {TRUE_G2:.3f}, "
        f"tr(S) = {TRUE_TRACE:.3f}, B_simple = {TRUE_B:.2f} examples\n"
    )
    print(
        "Per window: mean / std of the estimate over the truth. B_simple: "
        f"`stats` after {windows} windows (moving averages, decay {SMOOTHING}), "
        "mean / std over the runs, over the truth.\n"
    )
    print(
        "| micro-batches | estimator | \\|G\\|^2 mean | \\|G\\|^2 std "
        "| tr(S) mean | tr(S) std | B_simple mean | B_simple std |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, estimator), row in rows.items():
        cells = " | ".join(f"{row[q][0]:.3f} | {row[q][1]:.3f}" for q in row)
        print(f"| {name} | {estimator} | {cells} |")
    for name in SIZES:
        sampled, every = rows[name, "sampled"], rows[name, "all"]
        print(
            f"\n{name}: std sampled / all: |G|^2 "
            f"{sampled['g2'][1] / every['g2'][1]:.2f}, tr(S) "
            f"{sampled['trace'][1] / every['trace'][1]:.2f}, B_simple "
            f"{sampled['b'][1] / every['b'][1]:.2f}"
        )


TERNARY_DIM, TERNARY_K, TERNARY_EXAMPLES = 256, 4, 4
TERNARY_TRUE_TRACE = TERNARY_DIM * (1 + SIGMA**2) + 1  # |delta|^2 = 1


def ternary_window_estimates(reduction, windows: int):
    """``(|G|^2, tr(S))`` of each window reduced by ``reduction`` over 8 devices."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    opt = ga.MultiSteps(
        optax.sgd(0.0),
        TERNARY_K,
        unreduced_axes="data",
        window_reduction=reduction,
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator="all",
    )
    grad_fn = ga.local_value_and_grad(
        lambda w, x, y: (0.5 * jnp.mean((x @ w - y) ** 2), jnp.float32(len(y))),
        "data",
        has_weight=True,
    )
    rows = 8 * TERNARY_EXAMPLES
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.full(TERNARY_DIM, 1 / 16.0), P())  # w* = 0

        def micro_step(state, key):
            kx, ke = jax.random.split(key)
            x = jax.random.normal(kx, (rows, TERNARY_DIM), out_sharding=P("data"))
            y = SIGMA * jax.random.normal(ke, (rows,), out_sharding=P("data"))
            (_, weight), grads = grad_fn(w, x, y)
            _, state = opt.update(grads, state, w, weight=weight)
            stats = opt.stats(state)
            return state, (
                stats.grad_sq_norm,
                stats.noise_trace,
                opt.has_updated(state),
            )

        run = jax.jit(lambda state, keys: jax.lax.scan(micro_step, state, keys)[1])
        keys = jax.random.split(jax.random.key(0), windows * TERNARY_K)
        g2, trace, emitted = map(np.asarray, run(jax.jit(opt.init)(w), keys))
    return g2[emitted].astype(np.float64), trace[emitted].astype(np.float64)


def ternary_accumulate_estimates(windows: int):
    """The same micro-batches' 32 examples on one device, in a ternary window."""
    opt = ga.ternary_accumulate(
        optax.sgd(0.0),
        TERNARY_K,
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator="all",
    )
    w = jnp.full(TERNARY_DIM, 1 / 16.0)  # w* = 0
    rows = 8 * TERNARY_EXAMPLES

    def micro_step(state, key):
        kx, ke = jax.random.split(key)
        x = jax.random.normal(kx, (rows, TERNARY_DIM))
        y = SIGMA * jax.random.normal(ke, (rows,))
        grads = (x @ w - y) @ x / rows
        _, state = opt.update(grads, state, w, weight=jnp.float32(rows))
        stats = opt.stats(state)
        return state, (stats.grad_sq_norm, stats.noise_trace, opt.has_updated(state))

    run = jax.jit(lambda state, keys: jax.lax.scan(micro_step, state, keys)[1])
    keys = jax.random.split(jax.random.key(0), windows * TERNARY_K)
    g2, trace, emitted = map(np.asarray, run(opt.init(w), keys))
    return g2[emitted].astype(np.float64), trace[emitted].astype(np.float64)


def print_ternary(windows: int) -> None:
    print(
        f"\n## ternary window reduction: {windows} windows of {TERNARY_K} "
        f"micro-batches, 8 devices x {TERNARY_EXAMPLES} examples, "
        f"{TERNARY_DIM} params; truth |G|^2 = 1, tr(S) = B_simple = "
        f"{TERNARY_TRUE_TRACE:.0f}\n"
    )
    print("| window reduction | \\|G\\|^2 (+- s.e.) | tr(S) (+- s.e.) | B_simple |")
    print("|---|---:|---:|---:|")
    reductions = {
        "float all-reduce": None,
        "ternary, clip_sigma=None": ga.ternary_window_reduction(0, clip_sigma=None),
        "ternary, clip_sigma=2.5 (default)": ga.ternary_window_reduction(0),
    }
    runs = {
        name: (lambda reduction=reduction: ternary_window_estimates(reduction, windows))
        for name, reduction in reductions.items()
    }
    runs["ternary_accumulate, one device"] = lambda: ternary_accumulate_estimates(
        windows
    )
    for name, run in runs.items():
        try:
            g2, trace = run()
        except ValueError:  # a ternary window's noise scale is refused
            print(f"| {name} | refused | refused | refused |")
            continue
        g2_se, trace_se = (v.std() / np.sqrt(len(v)) for v in (g2, trace))
        print(
            f"| {name} | {g2.mean():.3f} +- {g2_se:.3f} | {trace.mean():.1f} +- "
            f"{trace_se:.1f} | {trace.mean() / g2.mean():.0f} |"
        )


def timing(num_params: int, k: int, windows: int) -> dict:
    """Per contender: median and mean non-emitting micro-step, median window."""
    params = bench_accumulation.make_params(num_params)
    grads = bench_accumulation.make_grads(params)
    inner = optax.adam(1e-3)
    transformations = {"untracked": ga.MultiSteps(inner, k)}
    for estimator in ESTIMATORS:
        transformations[estimator] = ga.MultiSteps(
            inner, k, track_noise_scale=True, noise_scale_estimator=estimator
        )
    runners = {
        name: bench_accumulation.Contender(
            bench_accumulation.train_step_fn(tx.gradient_transformation()),
            (bench_accumulation.make_params(num_params), tx.init(params)),
            grads,
        )
        for name, tx in transformations.items()
    }
    bench_accumulation.measure(runners, k, windows)
    result = {}
    for name, runner in runners.items():
        micro, _, window = bench_accumulation.summarize(runner.times, k)
        non_emitting = [t for i, t in enumerate(runner.times) if i % k != k - 1]
        result[name] = {
            "micro_s": micro,
            "mean_micro_s": statistics.mean(non_emitting),
            "window_s": window,
        }
    return result


def print_timing(result: dict, num_params: int, k: int, windows: int) -> None:
    print(
        f"\n## cost: {num_params / 1e6:g}M float32 params, adam, k={k}, "
        f"{windows} windows interleaved (indicative on a shared machine)\n"
    )
    print(
        "| noise scale | micro-step median (ms) | ratio | micro-step mean (ms) "
        "| ratio | window median (ms) | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = result["untracked"]
    for name, row in result.items():
        cells = " | ".join(
            f"{row[q] * 1e3:.2f} | {row[q] / base[q]:.3f}"
            for q in ("micro_s", "mean_micro_s", "window_s")
        )
        print(f"| {name} | {cells} |")
    print("\ntarget: sampled / untracked micro-step <= 1.05")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--windows", type=int, default=100)
    parser.add_argument(
        "--params", type=lambda text: int(float(text)), default=16_000_000
    )
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--timing-windows", type=int, default=8)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-spread", action="store_true")
    parser.add_argument("--ternary", action="store_true")
    parser.add_argument("--ternary-windows", type=int, default=1000)
    _headline.add_argument(parser)
    args = parser.parse_args()
    print(
        f"# noise scale estimators: {jax.devices()[0].platform} "
        f"({platform.processor() or platform.machine()}), jax {jax.__version__}"
    )
    if args.ternary:
        print_ternary(args.ternary_windows)
        return
    figures = {}
    if not args.skip_spread:
        rows = spread(args.runs, args.windows)
        print_spread(rows, args.runs, args.windows)
        for name in SIZES:
            sampled = rows[name, "sampled"]
            # Unbiased: the mean within 5% of the truth.
            figures[f"tr(S) mean / truth - 1, sampled, {name}"] = (
                abs(sampled["trace"][0] - 1),
                0.05,
            )
    if not args.skip_timing:
        result = timing(args.params, args.k, args.timing_windows)
        print_timing(result, args.params, args.k, args.timing_windows)
        figures["micro-step, noise scale sampled / untracked"] = (
            result["sampled"]["micro_s"] / result["untracked"]["micro_s"],
            1.05,
        )
    _headline.write(args.json, "noise_scale", figures)


if __name__ == "__main__":
    main()
