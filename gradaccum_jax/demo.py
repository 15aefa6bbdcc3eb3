"""Demo: accumulation trains like one big batch, in less memory.

Trains a small MLP classifier on scikit-learn's digits data set (8x8 images of
handwritten digits, shipped inside scikit-learn) three times from the same
start, on the same examples in the same order:

* big batch: one adam step per batch of ``k * micro_batch`` examples;
* accumulated: `gradaccum_jax.MultiSteps` fed the batch as k micro-batches,
  one call each (split over ``--devices`` devices, averaged across them once
  per window with `gradaccum_jax.average_across_devices`);
* ternary: the same with ternary compression: `ternary_accumulate` on one
  device, `ternary_average_across_devices` (int8 codes on the wire) on more.

It ends with a table: test accuracy, the largest parameter difference from
the big-batch run, the bytes of the optimizer state and the compiled
temporary memory of one gradient computation.

Run: ``python -m gradaccum_jax.demo [--k 8] [--micro-batch 32] [--steps 60]
[--clip 1.0] [--no-ternary] [--devices 4]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax


class RunResult(NamedTuple):
    """What one training run of the demo produced."""

    name: str
    examples_per_call: int
    devices: int
    params: Any
    state_bytes: int
    seconds: float


def load_digits(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Returns (x_train, y_train, x_test, y_test), features scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise SystemExit(
            "The demo trains on scikit-learn's digits data set. Install it with "
            "`pip install 'gradaccum-jax[examples]'` (or `pip install scikit-learn`)."
        ) from error
    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in),
            "b": jnp.zeros((n_out,)),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def logits_fn(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    logits = logits_fn(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(params, x, y) -> float:
    return float(jnp.mean(jnp.argmax(logits_fn(params, x), -1) == y))


def batches(x, y, batch_size: int, steps: int, seed: int) -> Iterator[tuple]:
    """``steps`` batches drawn without replacement, reshuffled every epoch."""
    rng = np.random.default_rng(seed)
    per_epoch = len(x) // batch_size
    order = rng.permutation(len(x))
    for step in range(steps):
        if step and step % per_epoch == 0:
            order = rng.permutation(len(x))
        start = (step % per_epoch) * batch_size
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]


def grad_temp_bytes(params, batch_size: int, features: int) -> int:
    """Compiled temporary bytes of one gradient computation on a batch."""
    x = jax.ShapeDtypeStruct((batch_size, features), jnp.float32)
    y = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    compiled = jax.jit(jax.grad(loss_fn)).lower(params, x, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes  # type: ignore[union-attr]


def single_device_step(tx: optax.GradientTransformation) -> Callable:
    @jax.jit
    def train_step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step


def data_parallel_step(tx: optax.GradientTransformation) -> Callable:
    """A pmapped step: each device's gradient weighs by its examples."""

    @functools.partial(jax.pmap, axis_name="devices")
    def train_step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params, weight=x.shape[0])
        return optax.apply_updates(params, updates), opt_state

    return train_step


def train(
    name: str,
    tx: optax.GradientTransformation,
    init_params,
    data: Iterator[tuple],
    *,
    k: int,
    devices: int,
    progress: Callable[[Iterator], Iterator],
) -> RunResult:
    """Runs ``tx`` over ``data``, feeding each batch as ``k`` calls."""
    start = time.perf_counter()
    parallel = devices > 1
    step = data_parallel_step(tx) if parallel else single_device_step(tx)
    params = init_params
    if parallel:
        params = jax.tree.map(lambda leaf: jnp.stack([leaf] * devices), params)
        opt_state = jax.pmap(tx.init)(params)
    else:
        opt_state = tx.init(params)
    per_call = 0
    for x, y in progress(data):
        for xs, ys in zip(np.split(x, k), np.split(y, k), strict=True):
            per_call = len(xs)
            if parallel:
                xs = xs.reshape(devices, -1, *xs.shape[1:])
                ys = ys.reshape(devices, -1)
            params, opt_state = step(params, opt_state, xs, ys)
    if parallel:
        params = jax.tree.map(lambda leaf: leaf[0], params)
        opt_state = jax.tree.map(lambda leaf: leaf[0], opt_state)
    return RunResult(
        name,
        per_call,
        devices,
        jax.block_until_ready(params),
        gradaccum_jax.measure.state_nbytes(opt_state),
        time.perf_counter() - start,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gradaccum_jax.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--k", type=int, default=8, help="micro-batches per update")
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="examples per micro-batch"
    )
    parser.add_argument("--steps", type=int, default=60, help="optimizer updates")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width")
    parser.add_argument("--lr", type=float, default=3e-3, help="adam learning rate")
    parser.add_argument(
        "--clip", type=float, default=None, help="clip the update's global norm"
    )
    parser.add_argument(
        "--ternary",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train with ternary compression",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="split each micro-batch over this many (emulated CPU) devices",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("k", "micro_batch", "steps", "hidden", "devices"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.micro_batch % args.devices:
        parser.error("--micro-batch must be a multiple of --devices")
    return args


def use_devices(count: int) -> None:
    """Makes ``count`` CPU devices available, before JAX starts its backend."""
    if count <= 1:
        return
    # Fails once the backend runs (e.g. under pytest): then use what it has.
    with contextlib.suppress(RuntimeError):
        jax.config.update(
            "jax_num_cpu_devices",
            max(count, jax.config.jax_num_cpu_devices),  # type: ignore[attr-defined]
        )
    if jax.local_device_count() < count:
        raise SystemExit(
            f"--devices {count}: only {jax.local_device_count()} devices are "
            "available (start a fresh process, or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={count})."
        )


def progress_bar(enabled: bool, total: int) -> Callable[[Iterator], Iterator]:
    if not enabled:
        return lambda it: it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return lambda it: it
    return lambda it: tqdm(it, total=total, unit="update", leave=False)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    use_devices(args.devices)
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    sizes = (x_train.shape[1], args.hidden, args.hidden, 10)
    init_params = init_mlp(jax.random.key(args.seed), sizes)
    results = run_all(args, init_params, x_train, y_train)
    summary = summarize(results, init_params, sizes[0], x_test, y_test)
    print_table(args, sizes, results, summary)
    return summary


def run_all(
    args: argparse.Namespace, init_params: Any, x_train: Any, y_train: Any
) -> list[RunResult]:
    """The big-batch run, then the accumulated one, then the ternary one (if
    asked for), all from ``init_params`` on the same examples."""
    big_batch = args.k * args.micro_batch

    def optimizer() -> optax.GradientTransformation:
        adam = optax.adam(args.lr)
        if args.clip is None:
            return adam
        return optax.chain(gradaccum_jax.clip_by_global_norm(args.clip), adam)

    def data():
        return batches(x_train, y_train, big_batch, args.steps, args.seed)

    progress = progress_bar(not args.no_progress, args.steps)
    run = functools.partial(train, init_params=init_params, progress=progress)
    parallel = args.devices > 1
    results = [run("big batch", optimizer(), data=data(), k=1, devices=1)]
    average = [gradaccum_jax.average_across_devices("devices")] if parallel else []
    results.append(
        run(
            f"MultiSteps, k={args.k}"
            + (f", {args.devices} devices" if parallel else ""),
            gradaccum_jax.MultiSteps(optax.chain(*average, optimizer()), args.k),
            data=data(),
            k=args.k,
            devices=args.devices,
        )
    )
    if args.ternary and parallel:
        ternary_mean = gradaccum_jax.ternary_average_across_devices(
            "devices", args.seed
        )
        results.append(
            run(
                f"ternary mean, k={args.k}, {args.devices} devices",
                gradaccum_jax.MultiSteps(
                    optax.chain(ternary_mean, optimizer()), args.k
                ),
                data=data(),
                k=args.k,
                devices=args.devices,
            )
        )
    elif args.ternary:
        results.append(
            run(
                f"ternary_accumulate, k={args.k}",
                gradaccum_jax.ternary_accumulate(optimizer(), args.k, seed=args.seed),
                data=data(),
                k=args.k,
                devices=1,
            )
        )
    return results


def summarize(
    results: list[RunResult],
    init_params: Any,
    num_features: int,
    x_test: Any,
    y_test: Any,
) -> dict[str, dict[str, float]]:
    """Per run, by name: test accuracy, largest parameter difference from the
    first (big-batch) run, optimizer state bytes, gradient temporary bytes
    and seconds."""
    reference = results[0].params
    return {
        result.name: {
            "accuracy": accuracy(result.params, x_test, y_test),
            "max_param_diff": max(
                float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(
                    jax.tree.leaves(reference),
                    jax.tree.leaves(result.params),
                    strict=True,
                )
            ),
            "state_bytes": result.state_bytes,
            "grad_temp_bytes": grad_temp_bytes(
                init_params, result.examples_per_call // result.devices, num_features
            ),
            "seconds": result.seconds,
        }
        for result in results
    }


def print_table(
    args: argparse.Namespace,
    sizes: tuple[int, ...],
    results: list[RunResult],
    summary: dict[str, dict[str, float]],
) -> None:
    """Prints the setup, then the summary as a markdown table."""
    print(
        f"digits MLP {sizes}, adam lr={args.lr}"
        + (f", clip {args.clip}" if args.clip is not None else "")
        + f", {args.steps} updates of {args.k * args.micro_batch} examples, "
        f"{jax.devices()[0].platform}"
    )
    print()
    print(
        "| run | examples per call | test accuracy | max param diff vs big batch "
        "| optimizer state (KiB) | gradient temporaries (KiB) | seconds |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for result in results:
        row = summary[result.name]
        print(
            f"| {result.name} | {result.examples_per_call} | {row['accuracy']:.2%} "
            f"| {row['max_param_diff']:.1e} | {row['state_bytes'] / 1024:.0f} "
            f"| {row['grad_temp_bytes'] / 1024:.0f} | {row['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
