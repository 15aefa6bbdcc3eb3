"""A float32 window of 10,000 micro-batches: its error, and what an exact form costs.

A float32 window sum ``acc += w g`` rounds once per micro-step. With a
constant gradient (an L2 term, a bias that does not move) every step adds
the same value to a growing sum and rounds the same way, so the rounding
errors do not cancel: the error grows like k ulps of the mean, not like
sqrt(k). This script measures, side by side in one run:

- accuracy: ``max |emitted - reference| / |reference|`` (the float64
  weighted mean of the same float32 gradients) of one window of
  ``K = 10,000`` micro-batches, for constant gradients (0.1, 3.14159, 1.0),
  gradients with a common mean (``1 + 0.1 N(0, 1)``), both with weights in
  [0.5, 64), and zero-mean ones (measured against the mean magnitude
  ``mean |g|``, since their mean is near 0);
- the costs of an exact form, at ``--params`` parameters with an adam
  inner optimizer: the state's bytes, the compiled temporary bytes of a
  jitted train step with params and state donated
  (``memory_analysis().temp_size_in_bytes``) and the median time of a
  non-emitting micro-step.

Candidates, each a `gradaccum_jax.MultiSteps` (the last optax's own):

- ours: `gradaccum_jax.MultiSteps`, the float32 sum divided by the total
  weight when the window emits (a window that may be kept unreduced, as
  per-device terms);
- running mean: the same engine with a float32 running weighted mean
  ``m += w / W (g - m)`` as its ``window_accumulator`` (what a float16 or
  bfloat16 window keeps), exact for a constant; it cannot be split into
  per-device terms (``unreduced_axes``);
- kahan: the same engine with a compensated (Kahan) float32 sum: a
  second window-sized buffer for the compensation;
- optax.MultiSteps: a running mean (no weights: the weighted cases are
  skipped).

Run: ``python benchmarks/bench_long_window.py [--params 1048576] [--width 1024]``
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax
from gradaccum_jax.extend import WindowAccumulator
from gradaccum_jax.measure import state_nbytes

K = 10_000
CASES = (
    ("constant 0.1", "constant", 0.1),
    ("constant 3.14159", "constant", 3.14159),
    ("constant 1.0", "constant", 1.0),
    ("mean 1, sd 0.1", "common-mean", 1.0),
    ("zero mean", "zero-mean", 1.0),
)


def running_mean_accumulator() -> WindowAccumulator:
    """A float32 running weighted mean, in a params-shaped tree plus W."""

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return zeros, jnp.zeros([], jnp.float32)

    def add(acc, grads, weight):
        mean, total = acc
        new_total = total + weight
        share = jnp.where(new_total != 0, weight / new_total, 0.0)
        mean = jax.tree.map(
            lambda m, g: jnp.where(weight != 0, m + share * (g - m), m), mean, grads
        )
        return mean, new_total

    def total(acc):
        mean, weight = acc
        return jax.tree.map(lambda m: m * weight, mean)

    def reset(acc):
        return jax.tree.map(jnp.zeros_like, acc)

    return WindowAccumulator(init, add, total, reset)


def kahan_accumulator() -> WindowAccumulator:
    """A float32 sum with a Kahan compensation buffer of the same size."""

    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return zeros, zeros

    def add(acc, grads, weight):
        sums, compensation = acc

        def leaf(s, c, g):
            y = weight * g - c
            t = s + y
            new_c = (t - s) - y
            keep = weight != 0
            return jnp.where(keep, t, s), jnp.where(keep, new_c, c)

        pairs = jax.tree.map(leaf, sums, compensation, grads)
        is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
        return (
            jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
            jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
        )

    def total(acc):
        sums, compensation = acc
        return jax.tree.map(lambda s, c: s - c, sums, compensation)

    def reset(acc):
        return jax.tree.map(jnp.zeros_like, acc)

    return WindowAccumulator(init, add, total, reset)


def candidates(inner: optax.GradientTransformation, k: int) -> dict:
    return {
        "ours (float32 sum)": gradaccum_jax.MultiSteps(inner, k),
        "running mean": gradaccum_jax.MultiSteps(
            inner, k, window_accumulator=running_mean_accumulator()
        ),
        "kahan": gradaccum_jax.MultiSteps(
            inner, k, window_accumulator=kahan_accumulator()
        ),
        "optax.MultiSteps": optax.MultiSteps(inner, k),
    }


def make_window(kind: str, value: float, width: int, seed: int = 7):
    """Gradients [K, width] (float32) and weights [K] in [0.5, 64)."""
    rng = np.random.default_rng(seed)
    if kind == "constant":
        grads = np.full((K, width), value, np.float32)
    elif kind == "common-mean":
        grads = (value + 0.1 * rng.standard_normal((K, width))).astype(np.float32)
    else:
        grads = rng.standard_normal((K, width)).astype(np.float32)
    weights = rng.uniform(0.5, 64.0, K).astype(np.float32)
    return grads, weights


def window_mean(tx, grads: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """The update ``tx`` (k = K, identity inner) emits, under lax.scan."""
    weighted = weights is not None
    weight_array = jnp.asarray(weights if weighted else np.ones(K, np.float32))

    def weight_arg(weight):
        return {"weight": weight} if weighted else {}

    @jax.jit
    def run(grads, weights):
        state = tx.init(jnp.zeros(grads.shape[1:], jnp.float32))

        def micro_step(state, xs):
            grad, weight = xs
            updates, state = tx.update(grad, state, **weight_arg(weight))
            return state, updates[0]  # keep the scan's output small

        state, _ = jax.lax.scan(micro_step, state, (grads[:-1], weights[:-1]))
        updates, _ = tx.update(grads[-1], state, **weight_arg(weights[-1]))
        return updates

    return np.asarray(run(jnp.asarray(grads), weight_array))


def relative_error(kind, emitted, grads, weights) -> float:
    w = np.ones(K) if weights is None else weights.astype(np.float64)
    g = grads.astype(np.float64)
    reference = w @ g / w.sum()
    scale = w @ np.abs(g) / w.sum() if kind == "zero-mean" else np.abs(reference)
    return float(np.max(np.abs(emitted.astype(np.float64) - reference) / scale))


def accuracy_table(width: int) -> None:
    names = list(candidates(optax.identity(), K))
    print(f"relative error of the mean of k = {K} float32 micro-batches")
    print(f"{'gradients':<18} {'weights':<9}" + "".join(f"{n:>20}" for n in names))
    for label, kind, value in CASES:
        grads, weights = make_window(kind, value, width)
        for weighted in (False, True):
            row = f"{label:<18} {'random' if weighted else 'all 1':<9}"
            for name, tx in candidates(optax.identity(), K).items():
                if weighted and name == "optax.MultiSteps":
                    row += f"{'n/a':>20}"
                    continue
                emitted = window_mean(tx, grads, weights if weighted else None)
                err = relative_error(
                    kind, emitted, grads, weights if weighted else None
                )
                row += f"{err:>20.2e}"
            print(row)


def cost_table(num_params: int, repeats: int) -> None:
    params = {f"w{i}": jnp.zeros((num_params // 4,), jnp.float32) for i in range(4)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    print(
        f"\ncosts at {num_params:,} float32 params, adam inner, k = 8 "
        "(state, temporary bytes of a donated jitted train step, median "
        "non-emitting micro-step)"
    )
    print(f"{'candidate':<22}{'state MB':>10}{'temp MB':>10}{'micro-step ms':>15}")
    runs = {}
    for name, tx in candidates(optax.adam(1e-3), 8).items():

        def step(params, state, grads, tx=tx):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state = jax.tree.map(jnp.copy, tx.init(params))  # no aliased leaves
        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = jitted.lower(params, state, grads).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        runs[name] = [compiled, jax.tree.map(jnp.copy, params), state, temp, []]
    # Interleaved, call by call: a load on a shared machine slows all alike.
    for i in range(repeats):
        for run in runs.values():
            compiled, run_params, state = run[:3]
            start = time.perf_counter()
            run[1], run[2] = jax.block_until_ready(compiled(run_params, state, grads))
            if (i + 1) % 8 and i >= 8:  # non-emitting calls, after a warm-up
                run[4].append(time.perf_counter() - start)
    for name, (_, _, state, temp, times) in runs.items():
        print(
            f"{name:<22}{state_nbytes(state) / 2**20:>10.1f}{temp / 2**20:>10.1f}"
            f"{1e3 * float(np.median(times)):>15.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--params", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=80)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}, {platform.processor()}")
    accuracy_table(args.width)
    cost_table(args.params, args.repeats)


if __name__ == "__main__":
    main()
