"""Gradient accumulation with equinox, on micro-batches of unequal size.

An equinox model is a pytree that holds arrays and other things (here the
activation functions), so the optimizer sees ``eqx.filter(model,
eqx.is_array)``: `MultiSteps` is initialised and updated on that filtered
tree, and the gradients of ``eqx.filter_value_and_grad`` have the same
structure. The train step is one ``eqx.filter_jit`` function.

Each batch of 100 examples is fed as micro-batches of 40, 40 and 20
(the last one ragged). With ``update(..., weight=n_examples)`` the window's
gradient is ``sum(n_i g_i) / sum(n_i)``, exactly the big-batch gradient, so
the accumulated run ends with the big-batch run's parameters. Without
weights it would be the mean of the three micro-batch means, which counts
the 20 examples of the last micro-batch twice as much as the others; the
script trains that run too, to show the difference.

Run: ``python examples/equinox_mlp.py``
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import gradaccum_jax

BATCH = 100
MICRO_BATCHES = (40, 40, 20)  # one window: the sizes sum to BATCH
UPDATES = 40
LEARNING_RATE = 1e-2


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


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_train_step(tx: optax.GradientTransformationExtraArgs, weighted: bool):
    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        # The weight of a micro-batch is its number of examples.
        extra = {"weight": x.shape[0]} if weighted else {}
        updates, opt_state = tx.update(
            grads, opt_state, eqx.filter(model, eqx.is_array), **extra
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    return train_step


@eqx.filter_jit
def accuracy(model: eqx.nn.MLP, x, y) -> jax.Array:
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), -1) == y)


def max_param_diff(a: eqx.Module, b: eqx.Module) -> float:
    leaves_a = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    leaves_b = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    return max(
        float(jnp.max(jnp.abs(u - v))) for u, v in zip(leaves_a, leaves_b, strict=True)
    )


def main(updates: int = UPDATES) -> dict[str, float | list[float]]:
    """Trains big batch, weighted and unweighted accumulation; returns numbers."""
    start = time.perf_counter()
    x_train, y_train, x_test, y_test = digits()
    init_model = eqx.nn.MLP(64, 10, width_size=64, depth=1, key=jax.random.key(0))
    k = len(MICRO_BATCHES)
    bounds = np.cumsum((0, *MICRO_BATCHES))

    runs = {
        "big_batch": optax.adam(LEARNING_RATE),
        "weighted": gradaccum_jax.MultiSteps(optax.adam(LEARNING_RATE), k),
        "unweighted": gradaccum_jax.MultiSteps(optax.adam(LEARNING_RATE), k),
    }
    models = dict.fromkeys(runs, init_model)
    states = {
        name: tx.init(eqx.filter(init_model, eqx.is_array)) for name, tx in runs.items()
    }
    steps = {
        name: make_train_step(tx, weighted=name == "weighted")
        for name, tx in runs.items()
    }
    losses = {name: [] for name in runs}

    for x, y in batches(x_train, y_train, BATCH, updates):
        models["big_batch"], states["big_batch"], loss = steps["big_batch"](
            models["big_batch"], states["big_batch"], x, y
        )
        losses["big_batch"].append(float(loss))
        for name in ("weighted", "unweighted"):
            window = []
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                models[name], states[name], loss = steps[name](
                    models[name], states[name], x[lo:hi], y[lo:hi]
                )
                window.append(float(loss) * (hi - lo))
            # The window's loss over all its examples: the big batch's loss.
            losses[name].append(sum(window) / BATCH)

    results = {
        **{f"{name}_losses": values for name, values in losses.items()},
        **{
            f"{name}_accuracy": float(accuracy(model, x_test, y_test))
            for name, model in models.items()
        },
        "weighted_max_param_diff": max_param_diff(
            models["big_batch"], models["weighted"]
        ),
        "unweighted_max_param_diff": max_param_diff(
            models["big_batch"], models["unweighted"]
        ),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"equinox MLP, adam over MultiSteps: {updates} updates of {BATCH} "
        f"examples in micro-batches of {MICRO_BATCHES}\n"
        "largest parameter difference from the big-batch run: "
        f"weight=n {results['weighted_max_param_diff']:.2e}, "
        f"unweighted {results['unweighted_max_param_diff']:.2e}\n"
        f"test accuracy: big batch {results['big_batch_accuracy']:.2%}, "
        f"weight=n {results['weighted_accuracy']:.2%}, "
        f"unweighted {results['unweighted_accuracy']:.2%}\n"
        f"done in {results['seconds']:.1f} s"
    )
    return results


if __name__ == "__main__":
    main()
