"""Accuracy of a float16 / bfloat16 window against a float64 reference.

For each accumulator dtype and window length k, micro-batch gradients (in the
accumulator dtype) of magnitude 1e-4 .. 6e4 are fed to each candidate under
``lax.scan`` and the emitted mean is compared with the float64 weighted mean
of the same (already rounded) gradients. Gradients are constant, positive
(magnitude times U(0.5, 1)) or random-sign; weights are all 1 or integers in
[1, 70000]. The error is ``max |emitted - reference| / mean |g|`` over the
elements and magnitudes, so a random-sign window (mean near 0) is measured
against the size of its terms; ``inf`` means an overflow.

Candidates:
  sum (before): ``acc += w g`` in the dtype, divided by the weight at the end
    (gradaccum_jax before the running mean);
  gradaccum_jax: `gradaccum_jax.MultiSteps` (a running mean ``m += w/W (g-m)``
    in float32, stored in the dtype, W in float32);
  kahan mean: the same running mean plus a compensation term in the dtype
    (twice the state);
  stochastic mean: the same running mean, stochastically rounded to the dtype;
  optax.MultiSteps: ``optax.MultiSteps(accumulator_dtype=dtype)`` (no weights).

Run: ``python benchmarks/bench_low_precision.py [--width 64]``
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax

KS = (1, 8, 64, 512, 4096)
MAGNITUDES = (1e-4, 1e-2, 1.0, 1e2, 1e4, 6e4)
KINDS = ("constant", "positive", "random-sign")
DTYPES = (jnp.float16, jnp.bfloat16)


def make_window(k, width, dtype, kind, weighted, seed=0):
    """Gradients [k, magnitudes, width] in ``dtype`` and float32 weights [k]."""
    rng = np.random.default_rng(seed)
    shape = (k, len(MAGNITUDES), width)
    scale = np.asarray(MAGNITUDES)[:, None]
    if kind == "constant":
        grads = np.broadcast_to(scale, shape)
    elif kind == "positive":
        grads = scale * rng.uniform(0.5, 1.0, shape)
    else:
        grads = scale * rng.uniform(0.5, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
    weights = rng.integers(1, 70_001, k) if weighted else np.ones(k)
    return jnp.asarray(grads, dtype), jnp.asarray(weights, jnp.float32)


def error(emitted, grads, weights):
    """max |emitted - reference| / mean |g|, the reference in float64."""
    g = np.asarray(grads, np.float64)
    w = np.asarray(weights, np.float64)
    reference = np.tensordot(w, g, axes=1) / w.sum()
    magnitude = np.tensordot(w, np.abs(g), axes=1) / w.sum()
    with np.errstate(invalid="ignore"):
        err = np.abs(np.asarray(emitted, np.float64) - reference) / magnitude
    return float(np.max(np.where(np.isnan(err), np.inf, err)))


def scan_accumulator(init, step, finish):
    """Runs ``step`` over the window under jit, returns ``finish(state)``."""

    @jax.jit
    def run(grads, weights):
        state = init(grads[0])
        state, _ = jax.lax.scan(
            lambda s, gw: (step(s, *gw), None), state, (grads, weights)
        )
        return finish(state, grads.dtype)

    return run


def _running_step(m, weight_total, g, w):
    total = weight_total + w
    m32 = m.astype(jnp.float32)
    return m32 + (w / total) * (g.astype(jnp.float32) - m32), total


def sum_before():
    return scan_accumulator(
        lambda g: (jnp.zeros_like(g), jnp.zeros([], jnp.float32)),
        lambda s, g, w: (s[0] + w.astype(g.dtype) * g, s[1] + w),
        lambda s, dtype: (s[0] * (1.0 / s[1]).astype(dtype)).astype(dtype),
    )


def kahan_mean():
    def step(s, g, w):
        m, c, weight_total = s
        new, total = _running_step(m, weight_total, g, w)
        # Kahan: the increment minus what the last rounding added too much.
        y = (new - m.astype(jnp.float32)) - c.astype(jnp.float32)
        t = (m.astype(jnp.float32) + y).astype(m.dtype)
        c = ((t.astype(jnp.float32) - m.astype(jnp.float32)) - y).astype(m.dtype)
        return t, c, total

    return scan_accumulator(
        lambda g: (jnp.zeros_like(g), jnp.zeros_like(g), jnp.zeros([], jnp.float32)),
        step,
        lambda s, dtype: (s[0].astype(jnp.float32) - s[1].astype(jnp.float32)).astype(
            dtype
        ),
    )


def _round_stochastically(x, dtype, key):
    """float32 ``x`` to ``dtype``, up or down with probability by distance."""
    nearest = x.astype(dtype)
    above = nearest.astype(jnp.float32) >= x
    other = jnp.nextafter(nearest, jnp.where(above, -jnp.inf, jnp.inf).astype(dtype))
    lo = jnp.where(above, other, nearest).astype(jnp.float32)
    hi = jnp.where(above, nearest, other).astype(jnp.float32)
    gap = hi - lo
    p_hi = jnp.where(gap > 0, (x - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    up = jax.random.uniform(key, x.shape) < p_hi
    return jnp.where(up, hi, lo).astype(dtype)


def stochastic_mean():
    def step(s, g, w):
        m, weight_total, key = s
        key, sub = jax.random.split(key)
        new, total = _running_step(m, weight_total, g, w)
        return _round_stochastically(new, m.dtype, sub), total, key

    return scan_accumulator(
        lambda g: (jnp.zeros_like(g), jnp.zeros([], jnp.float32), jax.random.key(0)),
        step,
        lambda s, dtype: s[0].astype(dtype),
    )


def multisteps(tx, weighted):
    @jax.jit
    def run(grads, weights):
        state = tx.init(grads[0])

        def step(state, gw):
            g, w = gw
            kwargs = {"weight": w} if weighted else {}
            updates, state = tx.update(g, state, **kwargs)
            return state, None

        state, _ = jax.lax.scan(step, state, (grads[:-1], weights[:-1]))
        kwargs = {"weight": weights[-1]} if weighted else {}
        updates, _ = tx.update(grads[-1], state, **kwargs)
        return updates

    return run


def candidates(k, dtype, weighted):
    ours = gradaccum_jax.MultiSteps(optax.identity(), k, accumulator_dtype=dtype)
    theirs = optax.MultiSteps(optax.identity(), k, accumulator_dtype=dtype)
    table = {
        "sum (before)": sum_before(),
        "gradaccum_jax": multisteps(ours, weighted),
        "kahan mean": kahan_mean(),
        "stochastic mean": stochastic_mean(),
    }
    if not weighted:
        table["optax.MultiSteps"] = multisteps(theirs, False)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, "
        f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()})"
    )
    print(f"max |emitted - float64 mean| / mean |g| over magnitudes {MAGNITUDES}")
    header = f"{'dtype':9} {'weights':8} {'gradients':12} {'candidate':17}" + "".join(
        f"{'k=' + str(k):>10}" for k in KS
    )
    for dtype in DTYPES:
        print()
        print(header)
        for weighted in (False, True):
            for kind in KINDS:
                rows: dict[str, list[float]] = {}
                for k in KS:
                    grads, weights = make_window(k, args.width, dtype, kind, weighted)
                    for name, run in candidates(k, dtype, weighted).items():
                        emitted = run(grads, weights)
                        if isinstance(emitted, jax.Array):
                            out = emitted
                        else:
                            out = jax.tree.leaves(emitted)[0]
                        rows.setdefault(name, []).append(error(out, grads, weights))
                for name, errors in rows.items():
                    print(
                        f"{jnp.dtype(dtype).name:9} "
                        f"{'integers' if weighted else 'ones':8} {kind:12} "
                        f"{name:17}" + "".join(f"{e:10.2g}" for e in errors)
                    )


if __name__ == "__main__":
    main()
