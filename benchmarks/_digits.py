"""The digits data set and the MLP the benchmarks train on it.

scikit-learn's digits (1,797 images of 8x8 pixels, 10 classes), features
scaled to [0, 1], split 80/20 stratified by class (`split`); a ReLU MLP
(`init_mlp`: leaves ``w0, b0, w1, b1, ...``, weights drawn from N(0,
1/fan_in) by numpy, so the same on every backend, biases zero).
`bench_low_communication.py` trains the MLP of `gradaccum_jax.demo` on the
demo's shuffled split (`demo_split`), as its published figures were made.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# 64 pixels -> 128 -> 10 classes: the accuracy runs' model.
LAYERS = (64, 128, 10)


def split() -> tuple[np.ndarray, ...]:
    """``(x_train, x_test, y_train, y_test)``: 80/20, stratified, fixed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(
        x, digits.target.astype(np.int32), test_size=0.2, random_state=0,
        stratify=digits.target,
    )  # fmt: skip


def demo_split(seed: int = 0) -> tuple[np.ndarray, ...]:
    """``(x_train, y_train, x_test, y_test)``: `gradaccum_jax.demo`'s split."""
    from gradaccum_jax import demo

    return demo.load_digits(seed)


def init_mlp(layers: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    """An MLP of ``layers`` widths (inputs first), float32 host arrays."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (n_in, n_out) in enumerate(zip(layers[:-1], layers[1:], strict=True)):
        w = rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)
        params[f"w{i}"] = w.astype(np.float32)
        params[f"b{i}"] = np.zeros((n_out,), np.float32)
    return params


def logits(params: dict[str, Any], x: Any, activation: Any = None) -> Any:
    """The MLP's outputs; ``activation`` between layers (default ReLU)."""
    import jax

    activation = jax.nn.relu if activation is None else activation
    num_layers = len(params) // 2
    for i in range(num_layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < num_layers - 1:
            x = activation(x)
    return x


def loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    """Mean softmax cross-entropy of the MLP on ``(x, y)``."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def accuracy(params: dict[str, Any], x: Any, y: Any) -> Any:
    """The fraction of ``x`` classified as ``y``."""
    import jax.numpy as jnp

    return jnp.mean(jnp.argmax(logits(params, x), -1) == y)
