"""One of the two processes of ``benchmarks/bench_network.py``.

``bench_network.py`` launches two copies of this file inside its own network
namespace (``ip netns exec``), joined by ``jax.distributed.initialize`` on
127.0.0.1 with gloo CPU collectives: one CPU device per process, one mesh of
2 devices over both, so every all-reduce crosses the namespace's loopback,
whose bandwidth the orchestrator limits with ``tc``.

Two tasks:

- ``timing``: the jitted data-parallel step (``jax.shard_map`` over the
  2-device mesh, a copy of the parameters on each device, the batch split)
  of a 4.7M-parameter MLP, once per variant: ``f32``
  (`average_across_devices`, a float32 mean),
  ``ternary`` (`ternary_average_across_devices`) and ``accum8`` (`MultiSteps`
  with k=8 around the float32 mean: one all-reduce per 8 micro-steps) and
  ``diloco32`` (`diloco` with the same sgd as inner optimizer, H=32: each
  process steps its own params, and every 32 steps one float32 all-reduce
  of the outer gradient; the params are per device, ``P(AXIS)``) and
  ``diloco32t`` (the same with the outer gradient sent as ternary codes,
  ``outer_reduction=ternary_average_across_devices``) and
  ``diloco32_e2m1``, ``diloco32_topk3``, ``diloco32_topk1`` (the same with
  ``compressed_average_across_devices`` and a codec: `codecs.quantized`
  with bits=4, E2M1 codes; `codecs.topk` at 3 % of each chunk in 4 bits;
  `codecs.topk` at 1 % in 2 bits, SparseLoCo's setting) and
  ``diloco32_topk125k`` (`codecs.topk` at 1.25 % in 2 bits, each process
  keeping half of what it did not send, ``diloco(keep_unsent=0.5)``) and
  ``diloco32_topk50b1k`` (`codecs.topk` at 50 % in one bit through the
  shards' owners, every leaf of 32 elements or more coded, keeping half:
  the setting that kept the transformer within 2 % at 1/500). The
  loss is cheap (4 examples per device) so that communication shows. Each
  repeat runs one step (one window of 8 micro-steps for ``accum8``, one
  cycle of 32 steps, its sync included, for DiLoCo) and waits for it
  with ``jax.block_until_ready``; the median over repeats is reported.
  Within a window or cycle each call waits for the one before and is
  timed alone: the median of the calls that reduce (the window's last,
  the cycle's sync) and of the others are reported too, measured under the
  same load of other programs.
  ``--budget`` bounds a variant's time after its first call (which
  compiles): the warmup ends once it is spent (or is skipped when the
  first call alone took longer), and the repeats stop after the first
  timed one past it; on a slow link a float32 sync takes tens of seconds,
  and one repeat of it is what the budget allows. Process 0 decides, for
  both: each process stopping by its own clock could run one repeat more
  than the other.
- ``accuracy``: the same optimizers training a small MLP on
  scikit-learn's ``load_digits`` for a fixed number of updates, per seed;
  the test accuracy shows what compression costs in accuracy (for
  DiLoCo, that of the anchor: the model the workers agreed on at the
  last sync).

Process 0 writes the results as JSON to ``--out``. Every wait is bounded:
``--timeout`` bounds the coordinator, heartbeats and shutdown, and the
orchestrator kills the process if it outlives its own deadline.

Run by ``bench_network.py``; by hand (two shells, any network)::

    python benchmarks/_network_worker.py --process-id 0 \\
        --coordinator 127.0.0.1:12345 --task timing --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import _digits

AXIS = "data"
# DiLoCo's workers hold their own params (``P(AXIS)``) and run cycles of
# SYNC_EVERY steps; the codec variants send the outer gradients through
# `compressed_average_across_devices` with the codec named by
# `diloco_codec`.
DILOCO_VARIANTS = (
    "diloco32", "diloco32t", "diloco32_e2m1", "diloco32_topk3", "diloco32_topk1",
    "diloco32_topk125k", "diloco32_topk50b1k",
)  # fmt: skip
# `diloco(keep_unsent=)` per codec variant: the ``...k`` variants'
# processes keep half of what their codec did not send (the setting of
# bench_low_communication.py's ``keep 0.5`` rows); the others keep nothing.
KEEP_UNSENT = {"diloco32_topk125k": 0.5, "diloco32_topk50b1k": 0.5}
VARIANTS = ("f32", "ternary", "accum8", *DILOCO_VARIANTS)
EVERY_K = 8
SYNC_EVERY = 32
LEARNING_RATE = 1e-3

# Timing model: 256 -> 2048 -> 2048 -> 10, 4,740,106 float32 parameters
# (18.1 MiB of gradients per all-reduce), 4 examples per device unless
# ``--batch`` says otherwise (more arithmetic per synced byte).
TIMING_LAYERS = (256, 2048, 2048, 10)
TIMING_PER_DEVICE_BATCH = 4

# Accuracy model on load_digits: 64 -> 128 -> 10, 16 examples per device.
DIGITS_LAYERS = _digits.LAYERS
DIGITS_PER_DEVICE_BATCH = 16
DIGITS_LEARNING_RATE = 0.1


def make_optimizer(variant: str, learning_rate: float, seed: int = 0):
    import optax

    import gradaccum_jax as ga

    if variant == "f32":
        return optax.chain(ga.average_across_devices(AXIS), optax.sgd(learning_rate))
    if variant == "ternary":
        return optax.chain(
            ga.ternary_average_across_devices(AXIS, seed=seed),
            optax.sgd(learning_rate),
        )
    if variant == "accum8":
        return ga.MultiSteps(
            optax.chain(ga.average_across_devices(AXIS), optax.sgd(learning_rate)),
            EVERY_K,
            count_skipped=True,
        )
    if variant == "diloco32":
        return ga.diloco(optax.sgd(learning_rate), SYNC_EVERY, axis_name=AXIS)
    if variant == "diloco32t":
        return ga.diloco(
            optax.sgd(learning_rate),
            SYNC_EVERY,
            axis_name=AXIS,
            outer_reduction=ga.ternary_average_across_devices(AXIS, seed=seed),
        )
    if variant in DILOCO_VARIANTS:
        return ga.diloco(
            optax.sgd(learning_rate),
            SYNC_EVERY,
            axis_name=AXIS,
            outer_reduction=ga.compressed_average_across_devices(
                AXIS, diloco_codec(variant), seed=seed
            ),
            keep_unsent=KEEP_UNSENT.get(variant, 0.0),
        )
    raise ValueError(f"unknown variant {variant!r}, expected one of {VARIANTS}")


def diloco_codec(variant: str):
    """The codec of a ``diloco32_<codec>`` variant's outer gradients: the
    settings that met (E2M1, top-k 3 % in 4 bits on seeds 0-3; top-k 1.25 %
    in 2 bits with ``keep_unsent=0.5``) or missed (top-k 1 % in 2 bits, the
    fewest bytes) the loss of data parallel float32 in
    ``bench_low_communication.py``'s digits task, and the one that met it
    on both tasks (top-k 50 % in one bit through the owners, keeping
    half)."""
    from gradaccum_jax import codecs

    return {
        "diloco32_e2m1": codecs.quantized(bits=4),
        "diloco32_topk3": codecs.topk(0.03, bits=4),
        "diloco32_topk1": codecs.topk(0.01),
        "diloco32_topk125k": codecs.topk(0.0125),
        "diloco32_topk50b1k": codecs.topk(
            0.5, bits=1, collective="reduce_scatter", min_size=32
        ),
    }[variant]


class DataParallel:
    """A jitted data-parallel train step over a 1-D mesh of ``devices``.

    Each device holds its own copy of the parameters, a block of one on a
    leading axis (``P(AXIS)``): the same on every device for data
    parallelism, apart between syncs for DiLoCo's workers
    (``per_device_params``). The batch is split over the mesh axis; the
    optimizer state is per device too (the ternary residuals and the
    accumulator differ from device to device). Every value is typed as
    varying over the axis, so ``jax.shard_map`` checks the step as it is
    (its default ``check_vma=True``) and ``jax.grad`` gives each device the
    gradient of its own examples.
    """

    def __init__(self, devices: list[Any], tx: Any, per_device_params: bool = False):
        import jax
        import optax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.split = NamedSharding(self.mesh, P(AXIS))
        self.per_device_params = per_device_params

        def local(tree):  # this device's block (leading axis 1) -> its value
            return jax.tree.map(lambda leaf: leaf[0], tree)

        def stacked(tree):
            return jax.tree.map(lambda leaf: leaf[None], tree)

        def step(params, state, x, y):
            # Each device differentiates the loss of its own examples; the
            # transformation averages the gradients (or DiLoCo's outer
            # gradients, at a sync) across devices.
            params = local(params)
            grads = jax.grad(_digits.loss)(params, x, y)
            updates, state = tx.update(grads, local(state), params)
            return stacked(optax.apply_updates(params, updates)), stacked(state)

        def shard_map(f, in_specs, out_specs):
            return jax.shard_map(
                f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs
            )

        self._init = jax.jit(
            shard_map(lambda p: stacked(tx.init(local(p))), P(AXIS), P(AXIS))
        )
        self.step = jax.jit(
            shard_map(step, (P(AXIS),) * 4, (P(AXIS), P(AXIS))),
            donate_argnums=(0, 1),
        )

    def put(self, host: np.ndarray, sharding) -> Any:
        import jax

        host = np.asarray(host)
        return jax.make_array_from_callback(
            host.shape, sharding, lambda index: host[index]
        )

    def init(self, params: dict[str, np.ndarray]) -> tuple[Any, Any]:
        import jax

        copies = len(self.mesh.devices)
        params = jax.tree.map(
            lambda p: self.put(np.broadcast_to(p, (copies, *p.shape)), self.split),
            params,
        )
        return params, self._init(params)


def received_bytes(compiled: Any) -> dict[str, float]:
    """Bytes each device receives per call of ``compiled``, by place:
    ``"entry"`` on every call, ``"loop"`` once per trip of a loop (DiLoCo's
    sync, accumulation's emission). Every collective, by the ring estimate
    (`gradaccum_jax.measure.Collective.received_nbytes`)."""
    import gradaccum_jax as ga

    received: dict[str, float] = {}
    for c in ga.measure.collectives(compiled):
        received[c.place] = received.get(c.place, 0.0) + c.received_nbytes
    return received


def over_budget(mine: bool) -> bool:
    """Process 0's answer, on every process: each decides alone from its own
    clock, and a process that times one more repeat than the other waits
    for collectives the other never joins."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(mine)))


def time_variant(
    devices: list[Any],
    variant: str,
    warmup: int,
    repeats: int,
    budget_s: float,
    count_bytes: bool = False,
    per_device_batch: int = TIMING_PER_DEVICE_BATCH,
) -> dict[str, Any]:
    """Milliseconds per step (per window of EVERY_K micro-steps for accum8).

    Warmup and repeats stop early once ``budget_s`` seconds have passed
    since the first call (compilation) ended, at least one repeat timed,
    and there is no warmup when the first call alone took longer: on a
    slow link one float32 sync takes longer than the budget. With
    ``count_bytes``, also the bytes the compiled step's collectives move
    (`received_bytes`; one more compilation).
    """
    import jax

    n = len(devices)
    trainer = DataParallel(
        devices,
        make_optimizer(variant, LEARNING_RATE),
        per_device_params=variant in DILOCO_VARIANTS,
    )
    params, state = trainer.init(_digits.init_mlp(TIMING_LAYERS, seed=0))
    num_params = sum(int(p.size) for p in jax.tree.leaves(params)) // n
    rng = np.random.default_rng(1)
    batch = n * per_device_batch
    x = rng.normal(size=(batch, TIMING_LAYERS[0])).astype(np.float32)
    y = rng.integers(0, TIMING_LAYERS[-1], size=(batch,)).astype(np.int32)
    x, y = trainer.put(x, trainer.split), trainer.put(y, trainer.split)
    steps = EVERY_K if variant == "accum8" else 1
    if variant in DILOCO_VARIANTS:
        steps = SYNC_EVERY

    start = time.perf_counter()
    params, state = trainer.step(params, state, x, y)
    jax.block_until_ready((params, state))
    began = time.perf_counter()
    compile_s = began - start
    if over_budget(compile_s > budget_s):
        warmup = 0  # that call was warmup enough: it ran a whole slow sync
    calls = 1
    times: list[float] = []
    # Each call of a window (accum8) or cycle (DiLoCo) timed alone: the one
    # that reduces (the window's last, the cycle's sync) apart from the
    # others, both under the same load of other programs.
    local_ms: list[float] = []
    sync_ms: list[float] = []
    for i in range(warmup + repeats):
        if over_budget(time.perf_counter() - began > budget_s):
            if times:
                break  # at least one repeat timed
            if i < warmup:
                continue  # skip the rest of the warmup, time one repeat
        start = time.perf_counter()
        for _ in range(steps):
            call_start = time.perf_counter()
            params, state = trainer.step(params, state, x, y)
            if steps > 1:
                jax.block_until_ready((params, state))
            calls += 1
            if i >= warmup and steps > 1:
                ms = 1e3 * (time.perf_counter() - call_start)
                (sync_ms if calls % steps == 0 else local_ms).append(ms)
        jax.block_until_ready((params, state))
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    median = statistics.median(times)
    result = {
        "variant": variant,
        "num_params": num_params,
        "per_device_batch": per_device_batch,
        "ms_per_step": median / steps,
        "ms_all": times,
        "repeats": len(times),
        "first_call_s": compile_s,
    }
    if steps > 1:
        result["ms_per_window"] = median
        result["ms_local_call"] = statistics.median(local_ms)
        result["ms_sync_call"] = statistics.median(sync_ms)
    if count_bytes:
        compiled = trainer.step.lower(params, state, x, y).compile()
        result["received_bytes"] = received_bytes(compiled)
    return result


def train_digits(
    devices: list[Any], variant: str, seed: int, updates: int
) -> dict[str, Any]:
    """Test accuracy after ``updates`` optimizer updates on load_digits.

    Every variant applies the same number of updates of the same global
    batch size per micro-step (``accum8`` averages 8 micro-batches per
    update, so it sees 8 times more examples).
    """
    import jax

    x_train, x_test, y_train, y_test = _digits.split()
    n = len(devices)
    batch = n * DIGITS_PER_DEVICE_BATCH
    steps = updates * (EVERY_K if variant == "accum8" else 1)
    trainer = DataParallel(
        devices,
        make_optimizer(variant, DIGITS_LEARNING_RATE, seed=seed),
        per_device_params=variant in DILOCO_VARIANTS,
    )
    params, state = trainer.init(_digits.init_mlp(DIGITS_LAYERS, seed=seed))
    rng = np.random.default_rng(seed)
    order = np.concatenate(
        [
            rng.permutation(len(x_train))
            for _ in range(steps * batch // len(x_train) + 1)
        ]
    )
    start = time.perf_counter()
    for i in range(steps):
        idx = order[i * batch : (i + 1) * batch]
        x = trainer.put(x_train[idx], trainer.split)
        y = trainer.put(y_train[idx], trainer.split)
        params, state = trainer.step(params, state, x, y)
    # The params (DiLoCo: the anchor), the same on every device: this
    # process' own row.
    trained = state.anchor if trainer.per_device_params else params
    host = jax.tree.map(lambda leaf: np.asarray(leaf.addressable_data(0))[0], trained)
    seconds = time.perf_counter() - start
    predictions = np.argmax(np.asarray(_digits.logits(host, x_test)), axis=-1)
    return {
        "variant": variant,
        "seed": seed,
        "updates": updates,
        "micro_steps": steps,
        "accuracy": float(np.mean(predictions == y_test)),
        "train_s": seconds,
    }


def join(coordinator: str, num_processes: int, process_id: int, timeout: int) -> None:
    """This process joins the others: one CPU device each, gloo collectives
    (``timeout`` seconds to start, and to miss a heartbeat or shut down)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=[0],
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
        shutdown_timeout_seconds=timeout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--coordinator", required=True, help="host:port")
    parser.add_argument("--task", choices=("timing", "accuracy"), required=True)
    parser.add_argument("--out", required=True, help="JSON file (process 0)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument(
        "--budget", type=float, default=60, help="seconds of timing per variant"
    )
    parser.add_argument(
        "--count-bytes",
        action="store_true",
        help="also read each variant's collective bytes from its compiled step",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=TIMING_PER_DEVICE_BATCH,
        help="examples per device per step of the timing model",
    )
    parser.add_argument("--timeout", type=int, default=60, help="seconds")
    args = parser.parse_args()

    import jax

    join(args.coordinator, args.num_processes, args.process_id, args.timeout)
    devices = jax.devices()
    print(
        f"process {jax.process_index()}/{jax.process_count()}: "
        f"{jax.local_device_count()} local of {len(devices)} devices",
        file=sys.stderr,
        flush=True,
    )
    variants = [v for v in args.variants.split(",") if v]
    results = []
    for variant in variants:
        if args.task == "timing":
            results.append(
                time_variant(
                    devices,
                    variant,
                    args.warmup,
                    args.repeats,
                    args.budget,
                    args.count_bytes,
                    args.batch,
                )
            )
        else:
            for seed in range(args.seeds):
                results.append(train_digits(devices, variant, seed, args.updates))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
