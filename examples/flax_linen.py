"""Gradient accumulation with flax.linen's `TrainState`, clipping logged.

``TrainState.create(..., tx=tx)`` takes any optax transformation, so the
accumulating optimizer is

    tx = MultiSteps(optax.chain(clip_by_global_norm(0.5), optax.adam(lr)), k)

and ``state.apply_gradients(grads=grads)`` is called once per micro-batch.
Clipping sits inside the window: it clips the window's mean gradient, as a
big-batch run clips its batch's gradient, and its state records the norm
before clipping. (``optax.chain(clip_by_global_norm(c), accumulate(adam, k))``
would clip each micro-batch instead.) The train step reads that norm from
``state.opt_state.inner_opt_state[0].global_norm``; it changes only on the
call that closes a window.

The script trains a small MLP on scikit-learn's digits twice from the same
initialization, with batches of ``k * micro_batch`` examples and with k
micro-batches of the same examples, and returns both runs' losses and
logged pre-clip norms, which agree up to float32 rounding.

Run: ``python examples/flax_linen.py``
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from sklearn.datasets import load_digits

import gradaccum_jax

K = 4  # micro-batches per optimizer update
MICRO_BATCH = 32
UPDATES = 40
LEARNING_RATE = 1e-2
MAX_NORM = 0.5


class MLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


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


def clip_state(opt_state) -> gradaccum_jax.ClipByGlobalNormState:
    """The clipping state, inside the accumulator's inner chain or not."""
    if isinstance(opt_state, gradaccum_jax.MultiStepsState):
        opt_state = opt_state.inner_opt_state
    return opt_state[0]


@jax.jit
def train_step(state: TrainState, x, y) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads)
    clipping = clip_state(state.opt_state)
    return state, {
        "loss": loss,
        "pre_clip_norm": clipping.global_norm,
        "clipped": clipping.clipped,
    }


@jax.jit
def accuracy(state: TrainState, x, y) -> jax.Array:
    logits = state.apply_fn({"params": state.params}, x)
    return jnp.mean(jnp.argmax(logits, -1) == y)


def main(
    k: int = K, micro_batch: int = MICRO_BATCH, updates: int = UPDATES
) -> dict[str, float | list[float]]:
    """Trains both runs; returns their losses and pre-clip norms per update."""
    start = time.perf_counter()
    x_train, y_train, x_test, y_test = digits()
    model = MLP()
    params = model.init(jax.random.key(0), x_train[:1])["params"]

    def optimizer() -> optax.GradientTransformation:
        return optax.chain(
            gradaccum_jax.clip_by_global_norm(MAX_NORM), optax.adam(LEARNING_RATE)
        )

    big = TrainState.create(apply_fn=model.apply, params=params, tx=optimizer())
    acc = TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=gradaccum_jax.MultiSteps(optimizer(), k).gradient_transformation(),
    )

    log = {name: [] for name in ("big", "acc")}
    for x, y in batches(x_train, y_train, k * micro_batch, updates):
        big, metrics = train_step(big, x, y)
        log["big"].append(metrics)
        losses = []
        for i in range(k):
            acc, metrics = train_step(acc, x[i::k], y[i::k])
            losses.append(metrics["loss"])
        # The window's last call carries the norm of the window's gradient.
        log["acc"].append({**metrics, "loss": jnp.mean(jnp.stack(losses))})

    def series(run: str, name: str) -> list[float]:
        return [float(metrics[name]) for metrics in log[run]]

    results = {
        "big_batch_losses": series("big", "loss"),
        "accumulated_losses": series("acc", "loss"),
        "big_batch_pre_clip_norms": series("big", "pre_clip_norm"),
        "accumulated_pre_clip_norms": series("acc", "pre_clip_norm"),
        "accumulated_clipped_updates": int(sum(series("acc", "clipped"))),
        "max_param_diff": max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(big.params), jax.tree.leaves(acc.params), strict=True
            )
        ),
        "big_batch_accuracy": float(accuracy(big, x_test, y_test)),
        "accumulated_accuracy": float(accuracy(acc, x_test, y_test)),
        # TrainState counts every call; MultiSteps counts optimizer updates.
        "train_state_steps": int(acc.step),
        "gradient_steps": int(acc.opt_state.gradient_step),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"flax.linen TrainState, MultiSteps(clip {MAX_NORM} + adam, k={k}): "
        f"{updates} updates of {k * micro_batch} examples\n"
        f"final loss: big batch {results['big_batch_losses'][-1]:.4f}, "
        f"accumulated {results['accumulated_losses'][-1]:.4f}\n"
        f"updates clipped: {results['accumulated_clipped_updates']} of {updates}; "
        f"pre-clip norm first {results['accumulated_pre_clip_norms'][0]:.3f}, "
        f"last {results['accumulated_pre_clip_norms'][-1]:.3f}\n"
        f"test accuracy: big batch {results['big_batch_accuracy']:.2%}, "
        f"accumulated {results['accumulated_accuracy']:.2%}\n"
        f"largest parameter difference: {results['max_param_diff']:.2e}\n"
        f"done in {results['seconds']:.1f} s"
    )
    return results


if __name__ == "__main__":
    main()
