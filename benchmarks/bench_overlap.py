"""Does a collective overlap the computation of the same jitted call?

DiLoCo's sync could hide behind a step's computation on a slow link only
if the collective ran while the step computed. This measures, between two
processes over a shaped loopback (gloo CPU collectives, as
``bench_network.py``), one jitted call that all-gathers ``--kb`` kB per
process and runs independent arithmetic (a chain of 512 x 512 products),
the collective placed:

- ``compute`` / ``collective``: each alone;
- ``both``: at the top level of the call, independent of the arithmetic;
- ``both, collective in a loop``: inside a ``lax.while_loop`` of one trip
  (as `diloco` runs its sync: a loop of zero or one trip, so that a call
  that does not sync moves nothing);
- ``both, collective in a cond``: inside a ``lax.cond``;
- ``both, collective after``: reading the arithmetic's result (serial by
  construction: the reference for no overlap).

Each with XLA:CPU's default scheduler and with
``--xla_cpu_enable_concurrency_optimized_scheduler=false``. A call that
overlaps costs about the larger of the two alone, one that does not their
sum. Medians of ``--repeats`` calls after two warm-ups.

Run as root (a network namespace and ``tc``, removed afterwards):
``python benchmarks/bench_overlap.py [--rate 0.01] [--kb 100]
[--products 80] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import _network_worker
import bench_network as network

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
VARIANTS = (
    "compute",
    "collective",
    "both",
    "both, collective in a loop",
    "both, collective in a cond",
    "both, collective after",
)


def worker(args: argparse.Namespace) -> None:
    """One process: times every variant, process 0 prints their medians."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _network_worker.join(
        args.coordinator, network.NUM_PROCESSES, args.process_id, int(args.timeout)
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    devices = len(jax.devices())

    def compute(w):
        for _ in range(args.products):
            w = jnp.tanh(w @ w)
        return w

    def gather(x):
        return jax.lax.all_gather(x, "d")

    def in_loop(x):
        def body(carry):
            trips, y = carry
            return trips - 1, gather(y[0])

        # The carry holds the gathered shape; one trip gathers this row.
        start = jnp.broadcast_to(x, (devices, x.size))
        return jax.lax.while_loop(lambda c: c[0] > 0, body, (1, start))[1]

    def in_cond(x):
        return jax.lax.cond(
            x[0] > -jnp.inf, gather, lambda y: jnp.broadcast_to(y, (devices, y.size)), x
        )

    calls = {
        "compute": lambda x, w: (jnp.broadcast_to(x, (devices, x.size)), compute(w)),
        "collective": lambda x, w: (gather(x), w),
        "both": lambda x, w: (gather(x), compute(w)),
        "both, collective in a loop": lambda x, w: (in_loop(x), compute(w)),
        "both, collective in a cond": lambda x, w: (in_cond(x), compute(w)),
        "both, collective after": lambda x, w: (gather(x + compute(w)[0, 0]), w),
    }

    def jitted(call):
        def per_device(x, w):
            gathered, w = call(x[0], w[0])
            return gathered[None], w[None]

        return jax.jit(
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(P("d"), P("d")),
                out_specs=(P("d"), P("d")),
            )
        )

    split = NamedSharding(mesh, P("d"))
    size = args.kb * 1000 // 4
    x = jax.make_array_from_callback(
        (devices, size), split, lambda _: np.ones((1, size), np.float32)
    )
    w = jax.make_array_from_callback(
        (devices, 512, 512), split, lambda _: np.full((1, 512, 512), 1e-3, np.float32)
    )
    steps = {name: jitted(calls[name]) for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(2 + args.repeats):
        for name, step in steps.items():  # interleaved: load falls on all
            start = time.perf_counter()
            jax.block_until_ready(step(x, w))
            if repeat >= 2:
                times[name].append(1e3 * (time.perf_counter() - start))
    if jax.process_index() == 0:
        print(json.dumps({name: statistics.median(t) for name, t in times.items()}))
    jax.distributed.shutdown()


def measure(namespace: network.Namespace, args, flags: str) -> dict[str, float]:
    """Both processes with ``XLA_FLAGS=flags``; process 0's medians (ms)."""
    env = {**network.child_env(), "XLA_FLAGS": flags}
    coordinator = f"127.0.0.1:{namespace.free_port()}"
    command = [
        "ip", "netns", "exec", namespace.name, sys.executable, __file__,
        "--worker", f"--coordinator={coordinator}", f"--kb={args.kb}",
        f"--products={args.products}", f"--repeats={args.repeats}",
        f"--timeout={args.timeout}",
    ]  # fmt: skip
    processes = [
        subprocess.Popen(
            [*command, f"--process-id={i}"],
            env=env,
            cwd=network.REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        for i in range(network.NUM_PROCESSES)
    ]
    try:
        outputs = [p.communicate(timeout=args.timeout)[0] for p in processes]
    finally:
        network.kill(processes)
    if any(p.returncode for p in processes):
        raise RuntimeError(f"workers failed: {[p.returncode for p in processes]}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=network.parse_rate, default=0.01, help="Gbit/s")
    parser.add_argument("--kb", type=network.positive_int, default=100)
    parser.add_argument("--products", type=network.positive_int, default=80)
    parser.add_argument("--repeats", type=network.positive_int, default=7)
    parser.add_argument("--timeout", type=float, default=600, help="seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    network.preflight()
    # SIGTERM unwinds like Ctrl-C, through `finally`: the namespace goes.
    signal.signal(signal.SIGTERM, network.interrupt)
    namespace = network.Namespace(f"gaj-overlap-{os.getpid()}")
    try:
        qdisc = namespace.shape(args.rate)
        schedulers = {"default scheduler": "", "scheduler flag": SCHEDULER_FLAG}
        results = {name: measure(namespace, args, f) for name, f in schedulers.items()}
    finally:
        namespace.delete()
    print(
        f"{args.kb} kB all-gathered per process, {args.products} products of "
        f"512 x 512, {network.rate_label(args.rate)} ({qdisc}); medians of "
        f"{args.repeats} calls, ms; flag: {SCHEDULER_FLAG}\n"
    )
    print("| call | " + " | ".join(schedulers) + " |")
    print("|---|" + "---:|" * len(schedulers))
    for name in VARIANTS:
        cells = " | ".join(f"{results[s][name]:.1f}" for s in schedulers)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
