"""What each codec of `gradaccum_jax.codecs` sends, and why E2M1 for 4 bits.

``bytes``: for every codec, one pmapped `compressed_average_across_devices`
step over 8 emulated CPU devices and a 4.2M-parameter model (4 float32
matrices of 1024 x 1024 and a 1024 bias) is compiled, and the bytes each
device receives are read from its HLO with
``gradaccum_jax.measure.collectives``, every collective counted by its
ring estimate (``Collective.received_nbytes``: an all-reduce of S bytes
over n devices 2 (n - 1) / n S, an all-gather or all-to-all of S
(n - 1) / n S, a reduce-scatter (n - 1) / n of its operand); the float32 mean
(``average_across_devices``) is the reference. Nothing runs.

``formats``: the relative squared error (``|Q(x) - x|^2 / |x|^2``) of
unbiased stochastic rounding of blocks of 32 values against a shared
power-of-two scale, onto the int4 grid ([-7, 7]) and onto E2M1's ({0, 0.5,
1, 1.5, 2, 3, 4, 6} and negatives), on Gaussian blocks and on heavy-tailed
ones (Student t, 3 degrees of freedom); 20,000 blocks each, seed 0. Both
formats take the same bytes on the wire (4 codes per uint32 word with 8
devices), so the smaller error decides.

``steps``: what a DiLoCo call that does not sync costs with each codec
(`diloco`, H=32, ``outer_reduction=compressed_average_across_devices(...)``,
or the float32 mean), against a local step: the inner optimizer alone (sgd),
no DiLoCo. Each is a whole jitted train step (the gradient of each worker's
own 4 examples (``--batch``), the update, the params stepped; params and
state donated) of a 4,740,106-parameter MLP (bench_network.py's timing
model) on 8 emulated CPU devices, one worker each, each call waited for (one
step in flight). The cycle step is set before each call: 0 (a call that does
not sync) or 31 (the sync). Every round calls each step once (the calls that
do not sync ``--off-sync`` times), in an order turned each round, so that
the load of other programs falls on all alike; the medians over ``--rounds``
rounds are reported, wall time and the process's CPU time (less sensitive to
other programs on a shared machine), as ratios to the local step's, and the
minor page faults of a call that does not sync: XLA:CPU allocates a call's
temporaries afresh, and glibc maps a block of more than 32 MiB from the
kernel each time, so every page the call touches faults once (with
``MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=8000000000
MALLOC_TOP_PAD_=1000000000`` in the environment glibc keeps freed memory
and no call faults). Two
layouts: ``shard_map`` (each device's params and state inside
``jax.shard_map``, as in pmap / shard_map chains and bench_network.py) and
``stacked`` (the workers stacked under ``jax.jit``: `stack_workers`,
`worker_value_and_grad`). ``--workers 1`` with ``JAX_PLATFORMS=cuda`` times
one worker on a GPU: its collectives move nothing, so a sync's time there is
the codec's arithmetic (encoding, decoding, error feedback) and the outer
step's.

``select``: how `codecs.topk` finds which entries of a chunk go at a high
density, on the chunks of bench_network.py's timing model (4,740,106
float32 values, 1,158 chunks of 4096, seed 0), half of each chunk: the
map's k-th magnitude by bisection (what `codecs.topk` does where a chunk
goes as a map) against ``jax.lax.top_k`` of the magnitudes (the entries'
search), each jitted, the median of 5 calls after one; their results
compared.

``residual``: what a bfloat16 error-feedback residual
(``residual_dtype=jnp.bfloat16``, rounded stochastically) costs the
running mean, against the float32 residual: each device feeds a pmapped
`compressed_average_across_devices` the same input at every step (a
64 x 128 matrix and a 3 x 32 x 48 stack of layers, of three kinds: a
constant 0.3, 0.3 with random signs, Gaussian; seed 11), and the relative
error of the running mean of the returned means, ``|sum_t m_t / T -
mean| / |mean|``, is read at T = 50 and T = 800 (the larger over the two
leaves), for each codec of `gradaccum_jax.codecs` (``--steps T ...`` reads
it at other T, the ratios at the last; ``--codecs`` takes some of them).
Each figure is the largest error of the `RESIDUAL_WINDOW` steps up to T: a
steady input's residual can repeat with a short period (0.3 on 8 devices
is 76.8 of int8's grid steps, so its float32 residual runs 0.8, 0.6, 0.4,
0.2, 0 of a step and is zero every fifth step), and an error read at one T
alone may catch one residual at a zero of its cycle and the other not.
The last column is the ratio at T alone.

Run: ``python benchmarks/bench_codecs.py [bytes|formats|steps|select|residual]``
(all by default; ``steps`` takes minutes: ``--layouts``, ``--rounds``,
``--off-sync``, ``--workers``, ``--batch``)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import numpy as np

import _devices
import _digits

DEVICES = 8
SIDE = 1024


def wire_bytes() -> dict[str, float]:
    """Received bytes per device of one mean, by codec."""
    _devices.emulate(DEVICES)
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
        'topk(0.01, collective="reduce_scatter")': (
            ga.compressed_average_across_devices(
                "i", codecs.topk(0.01, collective="reduce_scatter")
            )
        ),
        'topk(0.5, bits=1, collective="reduce_scatter")': (
            ga.compressed_average_across_devices(
                "i", codecs.topk(0.5, bits=1, collective="reduce_scatter")
            )
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
        received[name] = sum(
            op.received_nbytes for op in ga.measure.collectives(compiled)
        )
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


# ``steps``: DiLoCo's workers run a 256 -> 2048 -> 2048 -> 10 MLP (4,740,106
# float32 params, bench_network.py's timing model) on 4 examples each, with
# sgd inside; a sync every SYNC_EVERY calls.
STEP_LAYERS = (256, 2048, 2048, 10)
STEP_BATCH = 4
SYNC_EVERY = 32
LEARNING_RATE = 1e-3
LAYOUTS = ("shard_map", "stacked")


def step_codecs() -> dict[str, Any]:
    """The outer reductions timed by ``steps``: None is the float32 mean."""
    from gradaccum_jax import codecs

    return {
        "float32": None,
        "ternary": codecs.ternary(),
        "quantized(bits=8)": codecs.quantized(bits=8),
        "quantized(bits=4)": codecs.quantized(bits=4),
        "topk(0.01)": codecs.topk(0.01),
        "topk(0.03, bits=4)": codecs.topk(0.03, bits=4),
        "powersgd(4)": codecs.powersgd(4),
    }


def train_step(tx, layout: str, mesh):
    """A jitted, donated train step of every worker: the gradient of its own
    examples, ``tx``'s update, the params stepped; and its initial state.

    ``shard_map``: each device's params and state are its block of a
    leading device axis, and ``tx`` runs inside ``jax.shard_map`` (the
    pmap / shard_map path, as ``bench_network.py``). ``stacked``: the
    workers stacked under ``jax.jit`` (`stack_workers`,
    `worker_value_and_grad`; an Explicit mesh axis).
    """
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import gradaccum_jax as ga

    host = _digits.init_mlp(STEP_LAYERS, seed=0)
    if layout == "stacked":
        with jax.set_mesh(mesh):
            params = ga.stack_workers(host, "i")
            state = ga.stack_workers(jax.jit(tx.init)(host), "i")
        worker_grad = ga.worker_value_and_grad(_digits.loss, "i")

        def stacked_step(params, state, x, y):
            _, grads = worker_grad(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return jax.jit(stacked_step, donate_argnums=(0, 1)), params, state

    def local(tree):
        return jax.tree.map(lambda leaf: leaf[0], tree)

    def stacked(tree):
        return jax.tree.map(lambda leaf: leaf[None], tree)

    def device_step(params, state, x, y):
        params = local(params)
        grads = jax.grad(_digits.loss)(params, x, y)
        updates, state = tx.update(grads, local(state), params)
        return stacked(optax.apply_updates(params, updates)), stacked(state)

    def mapped(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    split = jax.sharding.NamedSharding(mesh, P("i"))
    params = jax.device_put(
        jax.tree.map(lambda p: np.broadcast_to(p, (mesh.size, *p.shape)), host), split
    )
    state = jax.jit(mapped(lambda p: stacked(tx.init(local(p))), P("i"), P("i")))(
        params
    )
    step = mapped(device_step, (P("i"),) * 4, (P("i"), P("i")))
    return jax.jit(step, donate_argnums=(0, 1)), params, state


def step_times(
    layout: str, rounds: int, off_sync: int, workers: int, batch: int
) -> dict[str, dict]:
    """Median ms (wall and CPU) of a local step, and per codec of a DiLoCo
    call that does not sync and of one that does (see the docstring), with
    one worker of ``batch`` examples on each of ``workers`` devices of the
    default backend."""
    _devices.emulate(DEVICES)
    import jax
    import optax
    from jax.sharding import AxisType

    import gradaccum_jax as ga

    axis_type = AxisType.Explicit if layout == "stacked" else AxisType.Auto
    mesh = jax.make_mesh((workers,), ("i",), axis_types=(axis_type,))
    rng = np.random.default_rng(1)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
    x = rng.normal(size=(workers * batch, STEP_LAYERS[0])).astype(np.float32)
    y = rng.integers(0, STEP_LAYERS[-1], workers * batch).astype(np.int32)
    examples = jax.device_put((x, y), split)

    transformations = {"local": optax.sgd(LEARNING_RATE)}
    for name, codec in step_codecs().items():
        transformations[name] = ga.diloco(
            optax.sgd(LEARNING_RATE),
            SYNC_EVERY,
            axis_name="i",
            outer_reduction=None
            if codec is None
            else ga.compressed_average_across_devices("i", codec),
        )
    runs = {name: train_step(tx, layout, mesh) for name, tx in transformations.items()}
    carries = {name: (params, state) for name, (_, params, state) in runs.items()}

    def call(name: str, sync: bool) -> tuple[float, float, int]:
        params, state = carries[name]
        if name != "local":
            # The cycle's last step syncs (one fragment); its first does not.
            cycle_step = jax.device_put(
                np.full(workers, SYNC_EVERY - 1 if sync else 0, np.int32),
                state.cycle_step.sharding,
            )
            state = state._replace(cycle_step=cycle_step)
        with jax.set_mesh(mesh):
            faults = _minor_faults()
            wall, cpu = time.perf_counter(), time.process_time()
            carries[name] = jax.block_until_ready(
                runs[name][0](params, state, *examples)
            )
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            return wall, cpu, _minor_faults() - faults

    calls = [(name, False) for name in transformations] * off_sync
    calls += [(name, True) for name in step_codecs()]
    times: dict[tuple[str, bool], list[tuple[float, float, int]]] = {
        key: [] for key in calls
    }
    for repeat in range(rounds + 1):  # the first compiles and warms up
        # Every call once a round (the calls that do not sync `off_sync`
        # times), the order turned each round: a change in the load of
        # the machine falls on every kind of call alike.
        shift = repeat * len(calls) // (rounds + 1)
        for key in calls[shift:] + calls[:shift]:
            elapsed = call(*key)
            if repeat:
                times[key].append(elapsed)

    def median_ms(key: tuple[str, bool], which: int) -> float:
        return 1e3 * statistics.median(t[which] for t in times[key])

    table = {}
    for name in transformations:
        table[name] = {
            "off-sync": median_ms((name, False), 0),
            "off-sync cpu": median_ms((name, False), 1),
            "off-sync faults": statistics.median(t[2] for t in times[name, False]),
        }
        if name != "local":
            table[name]["sync"] = median_ms((name, True), 0)
    return table


def _minor_faults() -> int:
    """The process's minor page faults so far: a page it touched for the
    first time since the kernel mapped it (see the module's docstring)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def steps_table(table: dict[str, dict]) -> str:
    """`step_times`' medians and their ratios to the local step, markdown."""
    local = table["local"]
    lines = [
        "| outer reduction | call that does not sync (ms) | / local step "
        "| CPU time / local step's | page faults a call | call that syncs (ms) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| local step (sgd alone) | {local['off-sync']:.2f} | 1 | 1 "
        f"| {local['off-sync faults']:,.0f} | |",
    ]
    for name, row in table.items():
        if name == "local":
            continue
        lines.append(
            f"| {name} | {row['off-sync']:.2f} "
            f"| {row['off-sync'] / local['off-sync']:.3f} "
            f"| {row['off-sync cpu'] / local['off-sync cpu']:.3f} "
            f"| {row['off-sync faults']:,.0f} | {row['sync']:.2f} |"
        )
    return "\n".join(lines)


def selection_times(repeats: int = 5) -> dict[str, float]:
    """``select``: milliseconds to find half of each chunk's entries, by
    the map's bisection and by a TopK (see the module's docstring)."""
    import jax
    import jax.numpy as jnp

    from gradaccum_jax._codecs import _chunks

    size = 4_740_106
    values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    chunks = -(-size // _chunks.CHUNK)
    rows = jnp.asarray(np.pad(values, (0, chunks * _chunks.CHUNK - size)))
    rows = rows.reshape(chunks, _chunks.CHUNK)
    k = _chunks.entries_per_chunk(_chunks.CHUNK, 0.5)
    searches = {
        "bisection (k-th magnitude)": jax.jit(lambda r: _chunks.selection(r, k, 1)),
        "lax.top_k (k-th magnitude)": jax.jit(
            lambda r: jax.lax.top_k(jnp.abs(r), k)[0][:, k - 1 :]
        ),
    }
    found = {name: np.asarray(search(rows)) for name, search in searches.items()}
    bisection, top_k = found.values()
    if not np.array_equal(bisection, top_k):
        raise AssertionError("the bisection and the TopK disagree")
    times = {}
    for name, search in searches.items():
        laps = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(search(rows))
            laps.append(time.perf_counter() - start)
        times[name] = 1e3 * statistics.median(laps)
    return times


RESIDUAL_STEPS = (50, 800)
# The steps up to each T over which the running mean's error is read (the
# largest): whole periods of a steady input's residual cycle (see above).
RESIDUAL_WINDOW = 10
STEADY_SHAPES = {"w": (64, 128), "s": (3, 32, 48)}


def residual_errors(
    steps: tuple[int, ...] = RESIDUAL_STEPS, only: tuple[str, ...] = ()
) -> dict[str, dict[str, dict[str, tuple[float, ...]]]]:
    """Per codec (those named in ``only``, else all), per residual dtype,
    per kind of input: the running mean's relative error at ``steps``, each
    the largest over the `RESIDUAL_WINDOW` steps up to it, then the error
    at the last step alone."""
    _devices.emulate(DEVICES)
    import jax
    import jax.numpy as jnp

    import gradaccum_jax as ga
    from gradaccum_jax import codecs

    rng = np.random.default_rng(11)
    inputs = {}
    for name, shape in STEADY_SHAPES.items():
        signs = rng.choice([-1.0, 1.0], (DEVICES, *shape))
        inputs[f"constant {name}"] = np.full((DEVICES, *shape), 0.3, np.float32)
        inputs[f"signs {name}"] = (0.3 * signs).astype(np.float32)
        inputs[f"gaussian {name}"] = rng.standard_normal((DEVICES, *shape)).astype(
            np.float32
        )
    target = {name: x.astype(np.float64).mean(0) for name, x in inputs.items()}
    steady = {
        "topk(0.03, bits=4)": codecs.topk(0.03, bits=4),
        "quantized(bits=4)": codecs.quantized(bits=4),
        "quantized(bits=8)": codecs.quantized(bits=8),
        "powersgd(2)": codecs.powersgd(2),
        "ternary": codecs.ternary(),
    }
    table = {}
    for codec_name, codec in steady.items():
        if only and codec_name not in only:
            continue
        table[codec_name] = {}
        for dtype in (jnp.float32, jnp.bfloat16):
            tx = ga.compressed_average_across_devices(
                "i", codec, seed=1, residual_dtype=dtype
            )

            def run(x, state, tx=tx):
                def step(state, _):
                    mean, state = tx.update(x, state)
                    return state, mean

                return jax.lax.scan(step, state, None, length=max(steps))[1]

            state = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (DEVICES, *x.shape)),
                tx.init(jax.tree.map(lambda x: x[0], inputs)),
            )
            means = jax.pmap(run, axis_name="i")(inputs, state)
            errors = {}
            for name, series in means.items():
                running = np.cumsum(np.asarray(series[0], np.float64), axis=0)
                counts = np.arange(1, len(running) + 1)
                averages = running / counts.reshape(-1, *[1] * target[name].ndim)
                along = tuple(range(1, running.ndim))
                error = np.sqrt(np.sum((averages - target[name]) ** 2, along))
                error /= np.linalg.norm(target[name])
                errors[name] = [
                    *(error[max(t - RESIDUAL_WINDOW, 0) : t].max() for t in steps),
                    error[steps[-1] - 1],
                ]
            kinds = dict.fromkeys(name.split()[0] for name in inputs)
            table[codec_name][jnp.dtype(dtype).name] = {
                kind: tuple(
                    max(errors[f"{kind} {leaf}"][i] for leaf in STEADY_SHAPES)
                    for i in range(len(steps) + 1)
                )
                for kind in kinds
            }
    return table


def residual_table(table: dict, steps: tuple[int, ...] = RESIDUAL_STEPS) -> str:
    """`residual_errors` as a markdown table: the errors over the steps up
    to each T, the bfloat16 / float32 ratio of those at the last T, then
    the ratio at that step alone."""
    at = [f"T={t}" for t in steps]
    lines = [
        f"| codec | input | float32 residual, {' | '.join(at)} "
        f"| bfloat16 residual, {' | '.join(at)} | bfloat16 / float32 at {at[-1]} "
        f"| at step {steps[-1]} alone |",
        "|---|---|" + "---:|" * (2 * len(steps) + 2),
    ]
    for codec, by_dtype in table.items():
        for kind, single in by_dtype["float32"].items():
            half = by_dtype["bfloat16"][kind]
            ratios = [
                f"{h / s:.2f}" if s else "-"
                for h, s in zip(half[-2:], single[-2:], strict=True)
            ]
            errors = " | ".join(f"{e:.2e}" for e in (*single[:-1], *half[:-1]))
            lines.append(f"| {codec} | {kind} | {errors} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part",
        nargs="?",
        choices=("bytes", "formats", "steps", "select", "residual", "all"),
        default="all",
    )
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="steps: of " + ",".join(LAYOUTS)
    )
    parser.add_argument("--rounds", type=int, default=8, help="steps: timed rounds")
    parser.add_argument(
        "--workers",
        type=int,
        default=DEVICES,
        help="steps: DiLoCo workers, one a device of the default backend",
    )
    parser.add_argument(
        "--batch", type=int, default=STEP_BATCH, help="steps: examples a worker"
    )
    parser.add_argument(
        "--off-sync", type=int, default=3, help="steps: calls without sync a round"
    )
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=list(RESIDUAL_STEPS),
        help="residual: the T at which the running mean's error is read",
    )
    parser.add_argument(
        "--codecs", nargs="*", default=[], help="residual: some codecs (default: all)"
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
            print(f"  {name:48s} {total:10.0f}  1/{reference / total:.1f}")
    if args.part in ("steps", "all"):
        _devices.emulate(DEVICES)  # before jax.devices() starts the CPU backend
        import jax

        if not 1 <= args.workers <= len(jax.devices()):
            parser.error(
                f"--workers must be in [1, {len(jax.devices())}] (the "
                f"{jax.devices()[0].platform} devices), got {args.workers}"
            )
        if args.batch < 1:
            parser.error(f"--batch must be at least 1, got {args.batch}")
        for layout in args.layouts.split(","):
            if layout not in LAYOUTS:
                parser.error(f"--layouts: {layout!r} is not one of {LAYOUTS}")
            table = step_times(
                layout, args.rounds, args.off_sync, args.workers, args.batch
            )
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(
                f"\n{layout}: DiLoCo H={SYNC_EVERY}, sgd inside, "
                f"{args.workers} workers of {args.batch} examples "
                f"on {jax.devices()[0].platform}, "
                f"medians of {args.rounds} rounds (load average after: {load}):"
            )
            print(steps_table(table))

    if args.part in ("residual", "all"):
        print(
            "running mean's relative error, float32 and bfloat16 residuals "
            f"(the largest over the {RESIDUAL_WINDOW} steps up to T):"
        )
        steps = tuple(sorted(args.steps))
        if steps[0] < 1:
            parser.error(f"--steps must be at least 1, got {steps[0]}")
        print(residual_table(residual_errors(steps, tuple(args.codecs)), steps))
    if args.part in ("select", "all"):
        print("half of each of 1,158 chunks of 4096 (4.7M float32), median ms:")
        for name, ms in selection_times().items():
            print(f"  {name:28s} {ms:8.1f}")


if __name__ == "__main__":
    main()
