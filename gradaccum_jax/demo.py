"""Demo: accumulating k micro-batches trains exactly like one big batch.

Trains a small MLP classifier on scikit-learn's digits data set (8x8 images of
handwritten digits, shipped inside scikit-learn) twice from the same start:

* big batch: one adam step per batch of ``k * micro_batch`` examples;
* accumulated: `gradaccum_jax.MultiSteps(adam, k)` fed the same examples
  as k micro-batches of ``micro_batch``, one call per micro-batch.

It prints the largest difference between the two runs' parameters, both
test accuracies, and the compiled temporary memory of a gradient step on the
big batch against one on a micro-batch: what accumulation saves.

Run: ``python -m gradaccum_jax.demo [--k 8] [--micro-batch 32] [--steps 60]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax


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
        idx = order[
            (step % per_epoch) * batch_size : (step % per_epoch + 1) * batch_size
        ]
        yield x[idx], y[idx]


def make_train_step(tx: optax.GradientTransformation):
    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def grad_temp_bytes(params, batch_size: int, features: int) -> int:
    """Compiled temporary bytes of one gradient computation on a batch."""
    x = jax.ShapeDtypeStruct((batch_size, features), jnp.float32)
    y = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    compiled = jax.jit(jax.grad(loss_fn)).lower(params, x, y).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        prog="python -m gradaccum_jax.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--k", type=int, default=8, help="micro-batches per update")
    parser.add_argument("--micro-batch", type=int, default=32, help="examples each")
    parser.add_argument("--steps", type=int, default=60, help="optimizer updates")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    sizes = (x_train.shape[1], args.hidden, args.hidden, 10)
    init_params = init_mlp(jax.random.key(args.seed), sizes)
    big_batch = args.k * args.micro_batch

    big_step = make_train_step(optax.adam(args.lr))
    big_params = init_params
    big_state = optax.adam(args.lr).init(big_params)

    accumulator = gradaccum_jax.MultiSteps(optax.adam(args.lr), args.k)
    micro_step = make_train_step(accumulator.gradient_transformation())
    acc_params = init_params
    acc_state = accumulator.init(acc_params)

    for x, y in batches(x_train, y_train, big_batch, args.steps, args.seed):
        big_params, big_state, _ = big_step(big_params, big_state, x, y)
        for i in range(args.k):
            piece = slice(i * args.micro_batch, (i + 1) * args.micro_batch)
            acc_params, acc_state, _ = micro_step(
                acc_params, acc_state, x[piece], y[piece]
            )
    assert bool(accumulator.has_updated(acc_state))

    max_diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(big_params), jax.tree.leaves(acc_params), strict=True
        )
    )
    big_temp = grad_temp_bytes(init_params, big_batch, sizes[0])
    micro_temp = grad_temp_bytes(init_params, args.micro_batch, sizes[0])
    results = {
        "max_param_diff": max_diff,
        "big_batch_accuracy": accuracy(big_params, x_test, y_test),
        "accumulated_accuracy": accuracy(acc_params, x_test, y_test),
        "big_batch_temp_bytes": big_temp,
        "micro_batch_temp_bytes": micro_temp,
        "seconds": time.perf_counter() - start,
    }

    print(
        f"digits MLP {sizes}, adam lr={args.lr}, {args.steps} updates of "
        f"{big_batch} examples, on {jax.devices()[0].platform}"
    )
    print()
    print("| run | examples per call | test accuracy |")
    print("|---|---:|---:|")
    print(
        f"| big batch | {big_batch} | {results['big_batch_accuracy']:.2%} |\n"
        f"| MultiSteps, k={args.k} | {args.micro_batch} "
        f"| {results['accumulated_accuracy']:.2%} |"
    )
    print()
    print(f"largest parameter difference between the runs: {max_diff:.2e}")
    print(
        "compiled temporary memory of one gradient step: "
        f"{big_temp / 1024:.0f} KiB on the big batch, "
        f"{micro_temp / 1024:.0f} KiB on a micro-batch "
        f"({micro_temp / big_temp:.2f}x)"
    )
    print(f"done in {results['seconds']:.1f} s")
    return results


if __name__ == "__main__":
    main()
