"""A data-parallel train step with accumulation and cross-device averaging.

Shared by `test_multiprocess.py` (one process with 8 CPU devices) and by the
processes it launches (``python tests/_multiprocess_worker.py ...``, 2
processes with 4 CPU devices each, joined by `jax.distributed.initialize` and
gloo collectives). Both run the same `train` over a 1-D mesh of 8 devices,
so their results must agree.

Every device holds its own copy of the parameters and of the optimizer state
(leading axis of size 8, sharded over the mesh, as with ``jax.pmap``): the
accumulator and the ternary residuals differ from device to device, and the
parameters must stay bitwise in sync, which the test checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

NUM_DEVICES = 8
AXIS = "d"
EVERY_K = 3
# Two full windows and a partial one: the final state is mid-window.
MICRO_STEPS = 7
PER_DEVICE_BATCH = 6
IN_FEATURES, OUT_FEATURES = 32, 16  # w has 512 elements: ternary-compressed.
KINDS = ("adam", "ternary")


def make_data(seed: int = 0) -> dict[str, np.ndarray]:
    """Micro-batches for all devices, shaped (MICRO_STEPS, NUM_DEVICES, ...).

    Devices see different numbers of valid examples (the weights), and one
    device sees none at one micro-step.
    """
    rng = np.random.default_rng(seed)
    shape = (MICRO_STEPS, NUM_DEVICES, PER_DEVICE_BATCH)
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


def make_optimizer(kind: str):
    import optax

    import gradaccum_jax as ga

    if kind == "adam":
        inner = optax.chain(ga.average_across_devices(AXIS), optax.adam(1e-2))
    elif kind == "ternary":
        inner = optax.chain(
            ga.ternary_average_across_devices(AXIS, seed=3), optax.sgd(0.05)
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
        host = np.asarray(host)
        return jax.make_array_from_callback(
            host.shape, per_device, lambda index: host[index]
        )

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
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--timeout", type=int, default=30)
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
    results = train(jax.devices(), args.kind)
    path = os.path.join(args.out, f"{args.kind}_process{args.process_id}.npz")
    np.savez(path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
