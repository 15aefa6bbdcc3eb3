"""Bytes a device all-reduces in a ternary DiLoCo sync, tensor-parallel or not.

DiLoCo under ``jax.jit`` on a ``data`` x ``model`` Explicit mesh, workers
stacked over ``data``, outer gradients sent as ternary codes
(``ternary_average_across_devices``). Two 1024 x 1024 float32 leaves, split
over ``model`` by columns and by rows (Megatron's split), against the same
leaves replicated over ``model``: with the codes kept split, each device
packs and sends about 1/m of the words with tensor parallelism over m
devices. The figures are read from the compiled HLO
(``gradaccum_jax.measure.all_reduces``, every all-reduce of the sync); nothing runs.
Each mesh shape needs its own device count, which XLA fixes when jax
starts, so each runs in a child process. Also counted: the all-gathers of
integer arrays (codes, packed words or their sums), which must be none.

Run: ``python benchmarks/bench_ternary_tp_bytes.py [--meshes 4x2,8x8]``
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import _devices

SIDE = 1024


def child(data: int, model: int) -> dict[str, float]:
    """Bytes all-reduced per device, replicated and tensor-parallel."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import gradaccum_jax as ga

    assert jax.device_count() == data * model, jax.devices()
    mesh = jax.make_mesh(
        (data, model), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    opt = ga.diloco(
        optax.sgd(0.1),
        8,
        axis_name="data",
        outer_reduction=ga.ternary_average_across_devices("data", seed=0),
    )
    layouts = {
        "replicated": {"u": P(), "v": P()},
        "tensor-parallel": {"u": P(None, "model"), "v": P("model", None)},
    }
    out = {}
    with jax.set_mesh(mesh):
        for name, specs in layouts.items():
            params = {
                key: jax.device_put(jnp.zeros((SIDE, SIDE)), spec)
                for key, spec in specs.items()
            }
            stacked = ga.stack_workers(params, "data")
            state = ga.stack_workers(jax.jit(opt.init)(params), "data")

            def step(params, state, grads):
                return opt.update(grads, state, params)

            compiled = jax.jit(step).lower(stacked, state, stacked).compile()
            out[name] = sum(r.nbytes for r in ga.measure.all_reduces(compiled))
            out[f"{name} integer all-gathers"] = len(
                re.findall(r"= [su]\d+\[[\d,]*\]\S* all-gather\(", compiled.as_text())
            )
    out["ratio"] = out["tensor-parallel"] / out["replicated"]
    return out


def measure(data: int, model: int) -> dict[str, float]:
    """``child(data, model)`` in a fresh process with that many devices."""
    env = _devices.child_env(data * model)
    result = subprocess.run(
        [sys.executable, __file__, "--child", f"{data}x{model}"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="4x2,8x8", help="data x model shapes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        data, model = map(int, args.child.split("x"))
        print(json.dumps(child(data, model)))
        return
    print("mesh (data x model) | replicated (bytes) | tensor-parallel | ratio")
    for shape in args.meshes.split(","):
        data, model = map(int, shape.split("x"))
        figures = measure(data, model)
        assert figures["tensor-parallel integer all-gathers"] == 0, figures
        print(
            f"{data} x {model} | {figures['replicated']:.0f} | "
            f"{figures['tensor-parallel']:.0f} | {figures['ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
