"""What each codec of `gradaccum_jax.codecs` sends, and why E2M1 for 4 bits.

``bytes``: for every codec, one pmapped `compressed_average_across_devices`
step over 8 emulated CPU devices and a 4.2M-parameter model (4 float32
matrices of 1024 x 1024 and a 1024 bias) is compiled, and the bytes each
device receives are read from its HLO with
``gradaccum_jax.measure.collectives``, every collective counted by the ring
estimates (an all-reduce of S bytes over n devices 2 (n - 1) / n S, an
all-gather of output S (n - 1) / n S); the float32 mean
(``average_across_devices``) is the reference. Nothing runs.

``formats``: the relative squared error (``|Q(x) - x|^2 / |x|^2``) of
unbiased stochastic rounding of blocks of 32 values against a shared
power-of-two scale, onto the int4 grid ([-7, 7]) and onto E2M1's ({0, 0.5,
1, 1.5, 2, 3, 4, 6} and negatives), on Gaussian blocks and on heavy-tailed
ones (Student t, 3 degrees of freedom); 20,000 blocks each, seed 0. Both
formats take the same bytes on the wire (4 codes per uint32 word with 8
devices), so the smaller error decides.

Run: ``python benchmarks/bench_codecs.py [bytes|formats]`` (both by default)
"""

from __future__ import annotations

import argparse
import os

import numpy as np

DEVICES = 8
SIDE = 1024


def wire_bytes() -> dict[str, float]:
    """Received bytes per device of one mean, by codec."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={DEVICES}"
    )
    import jax
    import jax.numpy as jnp

    import gradaccum_jax as ga
    from gradaccum_jax import codecs

    params = {
        f"w{i}": jax.ShapeDtypeStruct((SIDE, SIDE), jnp.float32) for i in range(4)
    }
    params["b"] = jax.ShapeDtypeStruct((SIDE,), jnp.float32)
    averaging = {
        "float32 mean": ga.average_across_devices("i"),
        "ternary": ga.compressed_average_across_devices("i", codecs.ternary()),
        "quantized(bits=8)": ga.compressed_average_across_devices(
            "i", codecs.quantized(bits=8)
        ),
        "quantized(bits=4)": ga.compressed_average_across_devices(
            "i", codecs.quantized(bits=4)
        ),
        "topk(0.01)": ga.compressed_average_across_devices("i", codecs.topk(0.01)),
        "topk(0.01, bits=4)": ga.compressed_average_across_devices(
            "i", codecs.topk(0.01, bits=4)
        ),
        "powersgd(4)": ga.compressed_average_across_devices("i", codecs.powersgd(4)),
    }

    def per_device(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((DEVICES, *a.shape), a.dtype), tree
        )

    received = {}
    for name, tx in averaging.items():
        state = jax.eval_shape(tx.init, params)
        compiled = (
            jax.pmap(tx.update, axis_name="i")
            .lower(per_device(params), per_device(state))
            .compile()
        )
        total = 0.0
        for op in ga.measure.collectives(compiled):
            n = op.group_size
            share = 2 * (n - 1) / n if op.kind == "all-reduce" else (n - 1) / n
            total += share * op.nbytes
        received[name] = total
    return received


def _stochastic(values: np.ndarray, grid: np.ndarray, rng) -> np.ndarray:
    magnitude = np.abs(values)
    low = np.clip(np.searchsorted(grid, magnitude, side="right") - 1, 0, len(grid) - 2)
    below, above = grid[low], grid[low + 1]
    up = rng.random(values.shape) < (magnitude - below) / (above - below)
    return np.sign(values) * np.where(up, above, below)


def format_errors() -> dict[str, dict[str, float]]:
    """Relative squared rounding error of int4 and E2M1, by distribution."""
    rng = np.random.default_rng(0)
    grids = {
        "int4": (np.arange(8.0), 7.0),
        "e2m1": (np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]), 6.0),
    }
    blocks = {
        "gaussian": rng.standard_normal((20000, 32)),
        "student-t(3)": rng.standard_t(3, (20000, 32)),
    }
    errors: dict[str, dict[str, float]] = {}
    for kind, x in blocks.items():
        largest = np.abs(x).max(axis=1, keepdims=True)
        for name, (grid, top) in grids.items():
            scale = 2.0 ** np.ceil(np.log2(largest / top))
            rounded = _stochastic(x / scale, grid, rng) * scale
            error = float(((rounded - x) ** 2).sum() / (x**2).sum())
            errors.setdefault(kind, {})[name] = error
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part", nargs="?", choices=("bytes", "formats", "all"), default="all"
    )
    args = parser.parse_args()
    if args.part in ("formats", "all"):
        print("relative squared error of stochastic rounding, blocks of 32:")
        for kind, by_format in format_errors().items():
            row = ", ".join(f"{name} {error:.3f}" for name, error in by_format.items())
            print(f"  {kind}: {row}")
    if args.part in ("bytes", "all"):
        received = wire_bytes()
        reference = received["float32 mean"]
        print(f"bytes each of {DEVICES} devices receives per mean (4.2M params):")
        for name, total in received.items():
            print(f"  {name:20s} {total:12.0f}  1/{reference / total:.1f}")


if __name__ == "__main__":
    main()
