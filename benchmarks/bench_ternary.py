"""Ternary compression against float32, side by side in one run.

Measured, not computed from a formula:

- wire bytes: the all-reduce buffers in the compiled HLO of one pmapped
  gradient-averaging step (``ternary_average_across_devices`` against a
  float32 ``pmean``) on the MLP below and on a 4M-parameter model;
- accumulator bytes: ``state_nbytes`` of ``acc_grads`` of
  ``ternary_accumulate`` against ``MultiSteps`` (float32);
- accuracy: an MLP on scikit-learn's ``load_digits`` (1797 8x8 digits, 20 %
  held out), trained with adam at an effective batch of 128, (a) data-
  parallel on 8 emulated CPU devices (16 examples per device) averaging with
  ``ternary_average_across_devices`` or a float32 pmean, and (b) on one
  device with 8 micro-batches of 16 accumulated by ``ternary_accumulate`` or
  float32 ``MultiSteps``; plus the ternary variants without error feedback
  and without clipping. Test accuracy is the mean (and min..max) over seeds
  of initialization and data order.

Run: ``python benchmarks/bench_ternary.py [--seeds 4] [--epochs 30]``
"""

from __future__ import annotations

import os

# 8 emulated devices; XLA reads the flag once, before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import _headline  # noqa: E402
import gradaccum_jax as ga  # noqa: E402

NUM_DEVICES = 8
PER_DEVICE_BATCH = 16
HIDDEN = 128
LEARNING_RATE = 3e-3


def load_data():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(
        x, digits.target.astype(np.int32), test_size=0.2, random_state=0,
        stratify=digits.target,
    )  # fmt: skip


def init_mlp(key, num_features=64, num_classes=10):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (num_features, HIDDEN)) / np.sqrt(num_features),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k2, (HIDDEN, num_classes)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((num_classes,)),
    }


def logits_fn(params, x):
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def loss_fn(params, x, y):
    logits = logits_fn(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch_indices(seeds, num_train, epochs, batch):
    """(seeds, steps, batch) example indices: a fresh permutation per epoch."""
    per_epoch = num_train // batch
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(num_train)[: per_epoch * batch] for _ in range(epochs)]
        out.append(np.concatenate(perms).reshape(-1, batch))
    return np.stack(out)


def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(logits_fn(params, x), -1) == y)


# --- data parallel ---------------------------------------------------------------


def trainer(opt, data):
    """``train_one(seed, batch_indices) -> test accuracy`` for optimizer ``opt``."""
    x_train, x_test, y_train, y_test = data

    def train_one(seed, batches):
        params = init_mlp(jax.random.key(seed))

        def step(carry, idx):
            params, opt_state = carry
            grads = jax.grad(loss_fn)(params, x_train[idx], y_train[idx])
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), batches)
        return accuracy(params, x_test, y_test)

    return train_one


def train_data_parallel(averaging, data, seeds, epochs):
    """Test accuracy per seed, training data-parallel on 8 devices."""
    train_one = trainer(optax.chain(averaging, optax.adam(LEARNING_RATE)), data)
    global_batch = NUM_DEVICES * PER_DEVICE_BATCH
    indices = batch_indices(seeds, len(data[0]), epochs, global_batch)
    # (devices, seeds, steps, per-device batch): each device its own slice.
    indices = indices.reshape(len(seeds), indices.shape[1], NUM_DEVICES, -1)
    indices = jnp.asarray(indices.transpose(2, 0, 1, 3))
    run = jax.pmap(jax.vmap(train_one), axis_name="i", in_axes=(None, 0))
    accuracies = run(jnp.asarray(seeds), indices)
    # Every device holds the same params; the test is on device 0's copy.
    return np.asarray(accuracies[0])


# --- single-device accumulation ------------------------------------------------


def train_accumulating(opt, data, seeds, epochs, every_k=NUM_DEVICES):
    """Test accuracy per seed, accumulating every_k micro-batches per update."""
    indices = batch_indices(seeds, len(data[0]), epochs, every_k * PER_DEVICE_BATCH)
    indices = jnp.asarray(indices.reshape(len(seeds), -1, PER_DEVICE_BATCH))
    train_one = trainer(opt, data)
    return np.asarray(jax.jit(jax.vmap(train_one))(jnp.asarray(seeds), indices))


# --- bytes ------------------------------------------------------------------------


def wire_bytes(averaging, params):
    """All-reduce bytes in the compiled HLO of one pmapped averaging step."""
    replicated = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((NUM_DEVICES, *a.shape), a.dtype), params
    )
    state = jax.eval_shape(
        lambda: jax.tree.map(
            lambda a: jnp.broadcast_to(a, (NUM_DEVICES, *a.shape)),
            averaging.init(params),
        )
    )
    step = jax.pmap(averaging.update, axis_name="i")
    return ga.all_reduce_nbytes(step.lower(replicated, state).compile())


def accumulator_bytes(opt, params):
    state = jax.eval_shape(opt.init, params)
    return ga.state_nbytes(state.acc_grads)


def micro_step_ms(opt, params, every_k, windows=2):
    """Median time of one ``update`` call (state donated), over whole windows."""
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
    grads = jax.tree.map(
        lambda a: jax.random.normal(jax.random.key(1), a.shape, a.dtype), params
    )
    update = jax.jit(lambda g, s: opt.update(g, s, params)[1], donate_argnums=1)
    state = update(grads, opt.init(params))  # compile
    times = []
    for _ in range(windows * every_k):
        begin = time.perf_counter()
        state = jax.block_until_ready(update(grads, state))
        times.append(time.perf_counter() - begin)
    return 1e3 * float(np.median(times))


def float_pmean():
    def update_fn(updates, state, params=None):
        return jax.lax.pmean(updates, "i"), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def summary(accuracies):
    accuracies = 100 * np.asarray(accuracies)
    return f"{accuracies.mean():6.2f} ({accuracies.min():.2f}..{accuracies.max():.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30)
    _headline.add_argument(parser)
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    start = time.time()
    data = tuple(jnp.asarray(a) for a in load_data())
    mlp = jax.eval_shape(init_mlp, jax.random.key(0))
    large = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(4)}
    every_k = NUM_DEVICES

    def ternary(**kwargs):
        return ga.ternary_average_across_devices("i", 0, **kwargs)

    averaging = {
        "float32 pmean": float_pmean(),
        "ternary (clip 2.5, error feedback)": ternary(),
        "ternary, no error feedback": ternary(error_feedback=False),
        "ternary, no clipping (unbiased, no residual)": ternary(clip_sigma=None),
    }
    adam = optax.adam(LEARNING_RATE)
    accumulating = {
        "float32 MultiSteps": ga.MultiSteps(adam, every_k).gradient_transformation(),
        "ternary_accumulate (clip 2.5)": ga.ternary_accumulate(adam, every_k),
        "ternary_accumulate, no clipping": ga.ternary_accumulate(
            adam, every_k, clip_sigma=None
        ),
    }

    rows = []
    mean_accuracy = {}
    wire_ratio = {}
    memory_ratio = {}
    float_wire = {name: None for name in ("mlp", "large")}
    for name, averaging_fn in averaging.items():
        wire = {
            k: wire_bytes(averaging_fn, p) for k, p in (("mlp", mlp), ("large", large))
        }
        if float_wire["mlp"] is None:
            float_wire = wire
        accuracies = train_data_parallel(averaging_fn, data, seeds, args.epochs)
        mean_accuracy[name] = 100 * float(np.mean(accuracies))
        wire_ratio[name] = wire["large"] / float_wire["large"]
        rows.append(
            (
                f"8 devices: {name}",
                f"{wire['mlp']} ({wire['mlp'] / float_wire['mlp']:.3f}x)",
                f"{wire['large'] / float_wire['large']:.3f}x",
                "",
                "",
                summary(accuracies),
            )
        )
    float_acc = None
    for name, opt in accumulating.items():
        acc_mlp, acc_large = accumulator_bytes(opt, mlp), accumulator_bytes(opt, large)
        step_ms = micro_step_ms(opt, large, every_k)
        if float_acc is None:
            float_acc = (acc_mlp, acc_large)
        accuracies = train_accumulating(opt, data, seeds, args.epochs, every_k)
        mean_accuracy[name] = 100 * float(np.mean(accuracies))
        memory_ratio[name] = acc_large / float_acc[1]
        rows.append(
            (
                f"1 device, k={every_k}: {name}",
                "",
                "",
                f"{acc_mlp} ({acc_mlp / float_acc[0]:.3f}x); "
                f"4M: {acc_large / float_acc[1]:.3f}x",
                f"{step_ms:.1f}",
                summary(accuracies),
            )
        )

    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(mlp))
    print(
        f"\nload_digits MLP 64-{HIDDEN}-10 ({num_params} params), adam "
        f"{LEARNING_RATE}, effective batch {NUM_DEVICES * PER_DEVICE_BATCH}, "
        f"{args.epochs} epochs, seeds {seeds}; jax {jax.__version__}, "
        f"{jax.device_count()} CPU devices\n"
    )
    header = (
        "setup",
        "wire bytes/step, MLP",
        "wire, 4M params",
        "accumulator bytes",
        "micro-step ms, 4M params",
        "test acc % mean (min..max)",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n({time.time() - start:.0f} s)")
    ternary_mean = "ternary (clip 2.5, error feedback)"
    ternary_acc = "ternary_accumulate (clip 2.5)"
    _headline.write(
        args.json,
        "ternary",
        {
            "wire bytes, ternary mean / float32 psum": (wire_ratio[ternary_mean], 0.25),
            "accumulator bytes, ternary / float32": (memory_ratio[ternary_acc], 0.3),
            "accuracy loss, ternary mean (points)": (
                mean_accuracy["float32 pmean"] - mean_accuracy[ternary_mean],
                1.0,
            ),
            "accuracy loss, ternary_accumulate (points)": (
                mean_accuracy["float32 MultiSteps"] - mean_accuracy[ternary_acc],
                1.0,
            ),
        },
    )


if __name__ == "__main__":
    main()
