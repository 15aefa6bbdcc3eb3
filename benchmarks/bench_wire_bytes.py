"""Bytes on the wire of a float32 mean and a ternary mean, per device count.

For each device count (2, 4, 8 emulated CPU devices: XLA fixes the count
when jax starts, so each count runs in its own child process), one pmapped
averaging step over a 4M-parameter model (4 float32 leaves of 1024 x 1024)
is compiled for ``average_across_devices`` (float32 mean) and
``ternary_average_across_devices`` (ternary codes summed in packed integer
fields, whose width grows with the device count), and the bytes its
all-reduces carry are read from the compiled HLO with
``gradaccum_jax.measure.all_reduce_nbytes``. Nothing runs: the figures are those of
the compiled programs. The float32 column is checked against 4 bytes per
parameter, the count of the fused tuple all-reduce included.

Run: ``python benchmarks/bench_wire_bytes.py [--devices 2,4,8]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import _devices
import _headline

LEAVES, SIDE = 4, 1024  # 4 x 1024 x 1024 float32 parameters
VARIANTS = ("float32 mean", "ternary mean")


def child(num_devices: int) -> dict[str, int]:
    """Wire bytes of each variant; runs where jax sees ``num_devices``."""
    import jax
    import jax.numpy as jnp

    import gradaccum_jax as ga

    assert jax.device_count() == num_devices, jax.devices()
    params = {
        f"w{i}": jax.ShapeDtypeStruct((SIDE, SIDE), jnp.float32) for i in range(LEAVES)
    }
    averaging = {
        "float32 mean": ga.average_across_devices("i"),
        "ternary mean": ga.ternary_average_across_devices("i", 0),
    }

    def per_device(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((num_devices, *a.shape), a.dtype), tree
        )

    out = {}
    for name, tx in averaging.items():
        state = jax.eval_shape(tx.init, params)
        step = jax.pmap(tx.update, axis_name="i")
        compiled = step.lower(per_device(params), per_device(state)).compile()
        out[name] = ga.measure.all_reduce_nbytes(compiled)
    return out


def measure(num_devices: int) -> dict[str, int]:
    """``child(num_devices)`` in a fresh process with that many devices."""
    env = _devices.child_env(num_devices)
    result = subprocess.run(
        [sys.executable, __file__, "--child", str(num_devices)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8", help="device counts")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    _headline.add_argument(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return

    num_params = LEAVES * SIDE * SIDE
    counts = [int(n) for n in args.devices.split(",") if n]
    rows = {n: measure(n) for n in counts}
    print(
        f"# wire bytes: one pmapped averaging step, {num_params / 1e6:.1f}M float32 "
        "params, all-reduce bytes read from the compiled HLO\n"
    )
    print("| devices | float32 mean (MiB) | / 4 B per param | ternary mean (MiB) "
          "| ternary / float32 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for n, row in rows.items():
        f32, ternary = row["float32 mean"], row["ternary mean"]
        print(
            f"| {n} | {f32 / 2**20:.2f} | {f32 / (4 * num_params):.3f} "
            f"| {ternary / 2**20:.3f} | {ternary / f32:.3f} |"
        )
    # No headline figure: bench_ternary.py holds the wire-bytes target.
    _headline.write(
        args.json,
        "wire bytes",
        {},
        data={
            "num_params": num_params,
            "devices": counts,
            "bytes": {name: [rows[n][name] for n in counts] for name in VARIANTS},
        },
    )


if __name__ == "__main__":
    main()
