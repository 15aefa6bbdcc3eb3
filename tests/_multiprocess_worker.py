"""Data-parallel train steps with accumulation, one mesh of 8 devices.

Two ways to train: `train` (pmap style: a ``shard_map`` step, every device
holding its own copy of the parameters and state, averaging with
`average_across_devices`) and `train_jit` (the ``jax.jit`` path: replicated
parameters, a global batch sharded over the mesh, per-device gradients from
`local_value_and_grad` kept unreduced by ``MultiSteps(...,
unreduced_axes=...)``, with checkpoints of ``reduce_window(state)`` that a
restarted run resumes from).

Shared by `test_multiprocess.py` (one process with 8 CPU devices) and by the
processes it launches (``python tests/_multiprocess_worker.py ...``, 2
processes with 4 CPU devices each, joined by `jax.distributed.initialize` and
gloo collectives). Both run the same `train` over a 1-D mesh of 8 devices,
so their results must agree.

In `train` every device holds its own copy of the parameters and of the
optimizer state (leading axis of size 8, sharded over the mesh, as with
``jax.pmap``): the accumulator and the ternary residuals differ from device
to device, and the parameters must stay bitwise in sync, which the test
checks.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from typing import Any

import numpy as np

NUM_DEVICES = 8
AXIS = "d"
EVERY_K = 3
# Two full windows and a partial one: the final state is mid-window.
MICRO_STEPS = 7
PER_DEVICE_BATCH = 6
IN_FEATURES, OUT_FEATURES = 32, 16  # w has 512 elements: ternary-compressed.
KINDS = ("adam", "ternary", "topk", "topk-reduce-scatter")
# The jax.jit path: "jit" trains on an Explicit and on an Auto mesh.
JIT_AXIS = "data"
JIT_MESHES = ("explicit", "auto")
JIT_KINDS = ("jit", *(f"jit-{mesh}" for mesh in JIT_MESHES))
JIT_MICRO_STEPS = 10
# Checkpoints after micro-steps 4 and 8, both mid-window (EVERY_K = 3).
CHECKPOINT_EVERY = 4
# DiLoCo under jax.jit: 8 stacked workers on an Explicit mesh, two fragments
# synced at staggered steps of a 4-step cycle; the run ends mid-cycle.
# "diloco-topk-keep": the outer gradients sent as top-k, each worker keeping
# half of what it did not send.
DILOCO_KINDS = ("diloco", "diloco-topk-keep")
DILOCO_SYNC_EVERY = 4


def _global_array(host, sharding):
    """A global array of ``host``'s values, each process placing its shards."""
    import jax  # after the flags are set, as in every function here

    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def make_data(seed: int = 0, micro_steps: int = MICRO_STEPS) -> dict[str, np.ndarray]:
    """Micro-batches for all devices, shaped (micro_steps, NUM_DEVICES, ...).

    Devices see different numbers of valid examples (the weights), and one
    device sees none at one micro-step.
    """
    rng = np.random.default_rng(seed)
    shape = (micro_steps, NUM_DEVICES, PER_DEVICE_BATCH)
    x = rng.normal(size=(*shape, IN_FEATURES)).astype(np.float32)
    true_w = rng.normal(size=(IN_FEATURES, OUT_FEATURES)).astype(np.float32)
    noise = 0.1 * rng.normal(size=(*shape, OUT_FEATURES))
    y = (x @ true_w + noise).astype(np.float32)
    valid = rng.integers(1, PER_DEVICE_BATCH + 1, size=shape[:2])
    valid[1, 5] = 0
    mask = (np.arange(PER_DEVICE_BATCH) < valid[..., None]).astype(np.float32)
    return {"x": x, "y": y, "mask": mask}


def init_params(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "b": np.zeros((OUT_FEATURES,), np.float32),
        "w": (0.1 * rng.normal(size=(IN_FEATURES, OUT_FEATURES))).astype(np.float32),
    }


def loss_fn(params, x, y, mask):
    """Mean squared error over this device's valid examples (0 if none)."""
    import jax.numpy as jnp

    errors = jnp.sum(jnp.square(x @ params["w"] + params["b"] - y), axis=-1)
    return jnp.sum(mask * errors) / jnp.maximum(jnp.sum(mask), 1.0)


def weighted_loss(params, x, y, mask):
    """The device's mean loss and its weight, its number of valid examples."""
    return loss_fn(params, x, y, mask), mask.sum()


def make_optimizer(kind: str):
    import optax

    import gradaccum_jax as ga

    if kind == "adam":
        inner = optax.chain(ga.average_across_devices(AXIS), optax.adam(1e-2))
    elif kind == "ternary":
        inner = optax.chain(
            ga.ternary_average_across_devices(AXIS, seed=3), optax.sgd(0.05)
        )
    elif kind == "topk":
        # Each device's top 10 % of w in 4 bits, gathered and added up in
        # the devices' order on every device, error feedback per device.
        inner = optax.chain(
            ga.compressed_average_across_devices(AXIS, ga.codecs.topk(0.1, bits=4)),
            optax.sgd(0.05),
        )
    elif kind == "topk-reduce-scatter":
        # The same through the shards' owners: an all-to-all between the
        # processes, each owner's selection of its shard's sum gathered.
        codec = ga.codecs.topk(0.1, bits=4, collective="reduce_scatter")
        inner = optax.chain(
            ga.compressed_average_across_devices(AXIS, codec), optax.sgd(0.05)
        )
    else:
        raise ValueError(f"unknown kind {kind!r}, expected one of {KINDS}")
    return ga.MultiSteps(inner, every_k_schedule=EVERY_K)


def train(devices: list[Any], kind: str) -> dict[str, np.ndarray]:
    """Runs MICRO_STEPS data-parallel micro-steps over a mesh of ``devices``.

    Returns the final per-device parameters and optimizer state as NumPy
    arrays with a leading device axis, keyed by leaf path. In a
    multi-process run every process returns the same global arrays.
    """
    import jax
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(devices) == NUM_DEVICES, devices
    mesh = Mesh(np.array(devices), (AXIS,))
    per_device = NamedSharding(mesh, P(AXIS))
    tx = make_optimizer(kind)

    def local(tree):  # this device's block (leading axis 1) -> its value
        return jax.tree.map(lambda leaf: leaf[0], tree)

    def stacked(tree):
        return jax.tree.map(lambda leaf: leaf[None], tree)

    def global_array(host):
        return _global_array(host, per_device)

    def step(params, state, x, y, mask):
        params, state, x, y, mask = local((params, state, x, y, mask))
        grads = jax.grad(loss_fn)(params, x, y, mask)
        updates, state = tx.update(grads, state, params, weight=mask.sum())
        return stacked((optax.apply_updates(params, updates), state))

    spec = P(AXIS)
    init = jax.jit(
        jax.shard_map(
            lambda p: stacked(tx.init(local(p))),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec),
        donate_argnums=(0, 1),
    )

    replicas = {
        name: np.broadcast_to(leaf, (NUM_DEVICES, *leaf.shape))
        for name, leaf in init_params().items()
    }
    params = jax.tree.map(global_array, replicas)
    state = init(params)
    data = make_data()
    for i in range(MICRO_STEPS):
        batch = {name: global_array(value[i]) for name, value in data.items()}
        params, state = step(params, state, batch["x"], batch["y"], batch["mask"])

    gathered = multihost_utils.process_allgather((params, state), tiled=True)
    leaves = jax.tree_util.tree_flatten_with_path(gathered)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _flat(tree: Any) -> dict[str, np.ndarray]:
    """``tree``'s leaves gathered to every process, keyed by leaf path."""
    import jax
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(tree, tiled=True)
    leaves = jax.tree_util.tree_flatten_with_path(gathered)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def save_checkpoint(directory: str, micro_step: int, tree: Any) -> None:
    """Writes ``tree`` (host-fetchable arrays) as ``ckpt_<micro_step>.npz``.

    Process 0 writes, then renames, so a process killed mid-write never
    leaves a torn checkpoint; the barrier makes every process wait for it.
    """
    import jax
    from jax.experimental import multihost_utils

    arrays = _flat(tree)
    if jax.process_index() == 0:
        path = os.path.join(directory, f"ckpt_{micro_step}.npz")
        np.savez(path + ".tmp.npz", **arrays)
        os.replace(path + ".tmp.npz", path)
    multihost_utils.sync_global_devices(f"checkpoint {micro_step}")


def load_checkpoint(directory: str, micro_step: int) -> dict[str, np.ndarray]:
    """The arrays of the checkpoint saved after ``micro_step`` micro-steps."""
    with np.load(os.path.join(directory, f"ckpt_{micro_step}.npz")) as saved:
        return {key: saved[key] for key in saved.files}


def latest_checkpoint(directory: str) -> tuple[int, dict[str, np.ndarray]]:
    """The micro-step and arrays of the newest checkpoint in ``directory``."""
    paths = glob.glob(os.path.join(directory, "ckpt_*[0-9].npz"))
    if not paths:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    step = max(int(os.path.basename(p)[5:-4]) for p in paths)
    return step, load_checkpoint(directory, step)


def train_jit(
    devices: list[Any],
    mesh_kind: str,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    on_stop: Any = None,
) -> dict[str, np.ndarray]:
    """Trains JIT_MICRO_STEPS micro-steps on the ``jax.jit`` path.

    One mesh over ``devices`` (axis JIT_AXIS, Explicit or Auto as
    ``mesh_kind`` says), replicated parameters, each micro-batch a global
    array sharded over the mesh. Every CHECKPOINT_EVERY micro-steps the
    window is reduced (``reduce_window``, as a checkpoint needs) and the run
    goes on from the reduced state, saved to ``checkpoint_dir`` if given: a
    run resumed from it (``resume``) then repeats the uninterrupted run's
    arithmetic exactly. After ``stop_after`` micro-steps ``on_stop()`` is
    called (it waits there to be killed).

    Returns the final parameters and ``reduce_window`` of the final state,
    keyed by leaf path, the same arrays in every process.
    """
    import jax
    import optax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import gradaccum_jax as ga

    assert len(devices) == NUM_DEVICES, devices
    axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[mesh_kind]
    mesh = Mesh(np.array(devices), (JIT_AXIS,), axis_types=(axis_type,))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(JIT_AXIS))

    opt = ga.MultiSteps(optax.adam(1e-2), EVERY_K, unreduced_axes=JIT_AXIS)
    grad_fn = ga.local_value_and_grad(weighted_loss, JIT_AXIS, has_weight=True)

    def step(params, state, x, y, mask):
        (_, weight), grads = grad_fn(params, x, y, mask)  # no collective
        updates, state = opt.update(grads, state, params, weight=weight)
        return optax.apply_updates(params, updates), state

    data = make_data(micro_steps=JIT_MICRO_STEPS)
    with jax.set_mesh(mesh):
        step = jax.jit(step)
        reduce_window = jax.jit(opt.reduce_window)
        params = {
            name: _global_array(leaf, replicated)
            for name, leaf in init_params().items()
        }
        state = jax.jit(opt.init)(params)
        start = 0
        if resume:
            start, saved = latest_checkpoint(checkpoint_dir)
            print(f"resuming from micro-step {start}", file=sys.stderr, flush=True)
            leaves, treedef = jax.tree.flatten((params, state))
            keys = [
                jax.tree_util.keystr(path)
                for path, _ in jax.tree_util.tree_flatten_with_path((params, state))[0]
            ]
            assert len(keys) == len(leaves) and sorted(keys) == sorted(saved)
            params, state = jax.tree.unflatten(
                treedef, [_global_array(saved[key], replicated) for key in keys]
            )
        for i in range(start, JIT_MICRO_STEPS):
            batch = {
                # (devices, per-device batch, ...) -> one global batch.
                name: _global_array(
                    value[i].reshape(-1, *value.shape[3:]), batch_sharding
                )
                for name, value in data.items()
            }
            params, state = step(params, state, batch["x"], batch["y"], batch["mask"])
            done = i + 1
            if done % CHECKPOINT_EVERY == 0:
                state = reduce_window(state)  # unreduced arrays cannot be saved
                if checkpoint_dir is not None:
                    save_checkpoint(checkpoint_dir, done, (params, state))
            if done == stop_after:
                on_stop()
        return _flat((params, reduce_window(state)))


def train_diloco(devices: list[Any], kind: str = "diloco") -> dict[str, np.ndarray]:
    """MICRO_STEPS steps of `diloco` with workers stacked over a jit mesh.

    Adam inside, the default Nesterov outer step, two fragments, each
    worker's gradient from `worker_value_and_grad` on its rows of the
    global batch and weighted by its number of valid examples; for
    ``diloco-topk-keep`` the outer gradients go as each worker's top 10 %
    in 4 bits, each worker keeping half of what it did not send. Returns
    the stacked params and state keyed by leaf path, the same arrays in
    every process.
    """
    import jax
    import optax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import gradaccum_jax as ga

    assert len(devices) == NUM_DEVICES, devices
    mesh = Mesh(np.array(devices), (JIT_AXIS,), axis_types=(AxisType.Explicit,))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(JIT_AXIS))

    keeping = {}
    if kind == "diloco-topk-keep":
        keeping = {
            "outer_reduction": ga.compressed_average_across_devices(
                JIT_AXIS, ga.codecs.topk(0.1, bits=4)
            ),
            "keep_unsent": 0.5,
        }
    opt = ga.diloco(
        optax.adam(1e-2),
        DILOCO_SYNC_EVERY,
        axis_name=JIT_AXIS,
        fragments=2,
        **keeping,
    )
    grad_fn = ga.worker_value_and_grad(weighted_loss, JIT_AXIS, has_aux=True)

    def step(params, state, x, y, mask):
        (_, weight), grads = grad_fn(params, x, y, mask)  # no collective
        updates, state = opt.update(grads, state, params, weight=weight)
        return optax.apply_updates(params, updates), state

    data = make_data()
    with jax.set_mesh(mesh):
        step = jax.jit(step, donate_argnums=(0, 1))
        params = {
            name: _global_array(leaf, replicated)
            for name, leaf in init_params().items()
        }
        state = ga.stack_workers(jax.jit(opt.init)(params), JIT_AXIS)
        params = ga.stack_workers(params, JIT_AXIS)
        for i in range(MICRO_STEPS):
            batch = {
                name: _global_array(
                    value[i].reshape(-1, *value.shape[3:]), batch_sharding
                )
                for name, value in data.items()
            }
            params, state = step(params, state, batch["x"], batch["y"], batch["mask"])
        return _flat((params, state))


def big_batch_reference(kind: str) -> dict[str, np.ndarray]:
    """The parameters of plain big-batch training on one device.

    Each window's gradient is the mean loss gradient over all valid examples
    of all devices and micro-steps in the window. Exact for ``adam`` up to
    float32 rounding; the ternary mean only approximates it.
    """
    import jax
    import jax.numpy as jnp
    import optax

    inner = optax.adam(1e-2) if kind == "adam" else optax.sgd(0.05)
    params = jax.tree.map(jnp.asarray, init_params())
    state = inner.init(params)
    data = make_data()
    windows = MICRO_STEPS // EVERY_K
    for window in range(windows):
        steps = slice(window * EVERY_K, (window + 1) * EVERY_K)
        flat = {
            name: value[steps].reshape(-1, *value.shape[3:])
            for name, value in data.items()
        }
        grads = jax.grad(loss_fn)(params, flat["x"], flat["y"], flat["mask"])
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return {f"[0]['{name}']": np.asarray(leaf) for name, leaf in params.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--kind", choices=(*KINDS, *JIT_KINDS, *DILOCO_KINDS), required=True
    )
    parser.add_argument("--timeout", type=int, default=30)
    parser.add_argument("--checkpoint-dir", help="jit kinds: save checkpoints here")
    parser.add_argument("--resume", action="store_true", help="from the latest one")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="jit kinds: after this many micro-steps, write stopped<id> in --out "
        "and wait --timeout seconds to be killed (exit 3 if not)",
    )
    args = parser.parse_args()

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.timeout,
        heartbeat_timeout_seconds=args.timeout,
        shutdown_timeout_seconds=args.timeout,
    )
    print(
        f"process {jax.process_index()}/{jax.process_count()}: "
        f"{jax.local_device_count()} local of {jax.device_count()} devices",
        file=sys.stderr,
        flush=True,
    )

    def wait_to_be_killed():
        with open(os.path.join(args.out, f"stopped{args.process_id}"), "w") as f:
            f.write("waiting to be killed\n")
        time.sleep(args.timeout)
        print("not killed: giving up", file=sys.stderr, flush=True)
        os._exit(3)  # not sys.exit: that would wait for the peer at shutdown

    if args.kind in KINDS:
        results = train(jax.devices(), args.kind)
    elif args.kind in DILOCO_KINDS:
        results = train_diloco(jax.devices(), args.kind)
    else:
        meshes = JIT_MESHES if args.kind == "jit" else (args.kind[4:],)
        results = {}
        for mesh_kind in meshes:
            checkpoint_dir = args.checkpoint_dir
            if checkpoint_dir is not None:
                checkpoint_dir = os.path.join(checkpoint_dir, mesh_kind)
                os.makedirs(checkpoint_dir, exist_ok=True)
            trained = train_jit(
                jax.devices(),
                mesh_kind,
                checkpoint_dir=checkpoint_dir,
                resume=args.resume,
                stop_after=args.stop_after,
                on_stop=wait_to_be_killed,
            )
            results.update({f"{mesh_kind}:{k}": v for k, v in trained.items()})
    path = os.path.join(args.out, f"{args.kind}_process{args.process_id}.npz")
    np.savez(path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
