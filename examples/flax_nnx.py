"""Gradient accumulation with flax.nnx: `nnx.Optimizer` over `MultiSteps`.

`nnx.Optimizer` takes any optax transformation as ``tx``, so accumulation is
one line: ``tx = gradaccum_jax.MultiSteps(adam, k).gradient_transformation()``
(or ``gradaccum_jax.accumulate(adam, k)`` inside an ``optax.chain``). Each
``optimizer.update(model, grads)`` adds one micro-batch; every k-th call runs
adam on the window's mean gradient and changes the model, the others leave
the parameters as they are. Keyword arguments of ``optimizer.update`` reach
``tx.update``, so ``weight=`` (examples in the micro-batch) works as well.

The script trains a small MLP on scikit-learn's digits twice from the same
initialization, with batches of ``k * micro_batch`` examples and with k
micro-batches of the same examples, ends the accumulated run's epoch with a
partial window emitted by `MultiSteps.flush` (read through `nnx.Optimizer`,
see `end_of_epoch`), and shows that both runs end with the same parameters
(up to float32 rounding).

Run: ``python examples/flax_nnx.py``
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import gradaccum_jax

K = 4  # micro-batches per optimizer update
MICRO_BATCH = 32
UPDATES = 40
LEARNING_RATE = 1e-2


class MLP(nnx.Module):
    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def digits(seed: int = 0) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test) of sklearn's digits, x in [0, 1]."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def batches(x, y, batch_size: int, steps: int, seed: int = 0) -> Iterator[tuple]:
    """``steps`` batches without replacement, reshuffled every epoch."""
    rng = np.random.default_rng(seed)
    per_epoch = len(x) // batch_size
    for step in range(steps):
        if step % per_epoch == 0:
            order = rng.permutation(len(x))
        idx = order[(step % per_epoch) * batch_size :][:batch_size]
        yield x[idx], y[idx]


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x, y) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    # `weight=` is optional here (equal micro-batches); it is passed on to
    # `MultiSteps.update` and makes unequal micro-batches exact.
    optimizer.update(model, grads, weight=x.shape[0])
    return loss


def end_of_epoch(
    model: MLP, optimizer: nnx.Optimizer, multi_steps: gradaccum_jax.MultiSteps
) -> gradaccum_jax.AccumulationStats:
    """Emits a partial window (`flush`) through ``optimizer``; returns its stats.

    `nnx.Optimizer` keeps the wrapped state inside nnx variables: the window
    methods take the plain arrays (``nnx.as_pure``), and their results go
    back into the model and the optimizer with ``nnx.update``.
    """
    state = nnx.as_pure(optimizer.opt_state)
    stats = multi_steps.stats(state)  # window_fill: micro-batches waiting
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    updates, state = multi_steps.flush(state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    nnx.update(optimizer.opt_state, nnx.state(state))
    return stats


@nnx.jit
def accuracy(model: MLP, x, y) -> jax.Array:
    return jnp.mean(jnp.argmax(model(x), -1) == y)


def max_param_diff(a: nnx.Module, b: nnx.Module) -> float:
    leaves_a = jax.tree.leaves(nnx.state(a, nnx.Param))
    leaves_b = jax.tree.leaves(nnx.state(b, nnx.Param))
    return max(
        float(jnp.max(jnp.abs(u - v))) for u, v in zip(leaves_a, leaves_b, strict=True)
    )


def main(
    k: int = K, micro_batch: int = MICRO_BATCH, updates: int = UPDATES
) -> dict[str, float | list[float]]:
    """Trains both runs; returns their losses per update and final numbers."""
    start = time.perf_counter()
    x_train, y_train, x_test, y_test = digits()

    # Same seed, same initial parameters.
    big_model = MLP(64, rngs=nnx.Rngs(0))
    acc_model = MLP(64, rngs=nnx.Rngs(0))
    big_optimizer = nnx.Optimizer(big_model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    multi_steps = gradaccum_jax.MultiSteps(optax.adam(LEARNING_RATE), k)
    acc_optimizer = nnx.Optimizer(
        acc_model, multi_steps.gradient_transformation(), wrt=nnx.Param
    )

    big_losses, acc_losses = [], []
    for x, y in batches(x_train, y_train, k * micro_batch, updates):
        big_losses.append(float(train_step(big_model, big_optimizer, x, y)))
        window = [
            train_step(acc_model, acc_optimizer, x[i::k], y[i::k]) for i in range(k)
        ]
        acc_losses.append(float(jnp.mean(jnp.stack(window))))

    # The end of an epoch: a window of 2 of k micro-batches, flushed, equals
    # one big-batch step on their examples.
    x, y = next(batches(x_train, y_train, 2 * micro_batch, 1, seed=1))
    train_step(big_model, big_optimizer, x, y)
    for i in range(2):
        train_step(acc_model, acc_optimizer, x[i::2], y[i::2])
    flushed = end_of_epoch(acc_model, acc_optimizer, multi_steps)

    results = {
        "big_batch_losses": big_losses,
        "flushed_window_fill": int(flushed.window_fill),
        "accumulated_losses": acc_losses,
        "max_param_diff": max_param_diff(big_model, acc_model),
        "big_batch_accuracy": float(accuracy(big_model, x_test, y_test)),
        "accumulated_accuracy": float(accuracy(acc_model, x_test, y_test)),
        # nnx counts every call; the wrapped state counts optimizer updates.
        "optimizer_calls": int(acc_optimizer.step[...]),
        "gradient_steps": int(acc_optimizer.opt_state.gradient_step[...]),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"flax.nnx, adam over MultiSteps(k={k}): {updates} updates of "
        f"{k * micro_batch} examples\n"
        f"final loss: big batch {big_losses[-1]:.4f}, "
        f"accumulated {acc_losses[-1]:.4f}\n"
        f"test accuracy: big batch {results['big_batch_accuracy']:.2%}, "
        f"accumulated {results['accumulated_accuracy']:.2%}\n"
        f"largest parameter difference: {results['max_param_diff']:.2e}\n"
        f"done in {results['seconds']:.1f} s"
    )
    return results


if __name__ == "__main__":
    main()
