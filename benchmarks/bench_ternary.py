"""Ternary compression against float32, side by side in one run.

Measured, not computed from a formula:

- wire bytes: the all-reduce buffers in the compiled HLO of one pmapped
  gradient-averaging step (``ternary_average_across_devices`` against a
  float32 ``pmean``) on the MLP below and on a 4M-parameter model;
- accumulator bytes: ``measure.state_nbytes`` of ``acc_grads`` of
  ``ternary_accumulate`` against ``MultiSteps`` (float32);
- accuracy: an MLP on scikit-learn's ``load_digits`` (1797 8x8 digits, 20 %
  held out), trained with adam at an effective batch of 128, (a) data-
  parallel on 8 emulated CPU devices (16 examples per device) averaging with
  ``ternary_average_across_devices`` or a float32 pmean, and (b) on one
  device with 8 micro-batches of 16 accumulated by ``ternary_accumulate`` or
  float32 ``MultiSteps``; plus the ternary variants without error feedback
  and without clipping. Test accuracy is the mean (and min..max) over seeds
  of initialization and data order.

- compute time (first table): at 4M and 16M float32 params (4 square
  leaves), the median time of a ``ternary_accumulate`` micro-step and
  emitting step against float32 ``MultiSteps`` (sgd inside, so the
  accumulator dominates; gradients donated and updates returned, as in a
  training step), ``ternarize`` against ``optax.identity``, and
  ``ternary_average_across_devices`` against ``average_across_devices`` on
  8 emulated CPU devices (each holding 1/8 of the params). Jitted, state
  donated; the two sides take turns, so load on a shared machine falls on
  both alike.

Run: ``python benchmarks/bench_ternary.py [--seeds 4] [--epochs 30]
[--repeats 5] [--timing-only]``
"""

from __future__ import annotations

import _devices
import _digits

_devices.emulate(8)  # before jax is imported

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _headline  # noqa: E402
import gradaccum_jax as ga  # noqa: E402

NUM_DEVICES = 8
PER_DEVICE_BATCH = 16
LEARNING_RATE = 3e-3


def initial_params(seeds):
    """The MLP's initial params per seed, stacked on a leading axis."""
    per_seed = [_digits.init_mlp(_digits.LAYERS, seed) for seed in seeds]
    return jax.tree.map(lambda *leaves: jnp.asarray(np.stack(leaves)), *per_seed)


def batch_indices(seeds, num_train, epochs, batch):
    """(seeds, steps, batch) example indices: a fresh permutation per epoch."""
    per_epoch = num_train // batch
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(num_train)[: per_epoch * batch] for _ in range(epochs)]
        out.append(np.concatenate(perms).reshape(-1, batch))
    return np.stack(out)


# --- data parallel ---------------------------------------------------------------


def trainer(opt, data):
    """``train_one(params, batch_indices) -> test accuracy`` for optimizer ``opt``."""
    x_train, x_test, y_train, y_test = data

    def train_one(params, batches):

        def step(carry, idx):
            params, opt_state = carry
            grads = jax.grad(_digits.loss)(params, x_train[idx], y_train[idx])
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), batches)
        return _digits.accuracy(params, x_test, y_test)

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
    accuracies = run(initial_params(seeds), indices)
    # Every device holds the same params; the test is on device 0's copy.
    return np.asarray(accuracies[0])


# --- single-device accumulation ------------------------------------------------


def train_accumulating(opt, data, seeds, epochs, every_k=NUM_DEVICES):
    """Test accuracy per seed, accumulating every_k micro-batches per update."""
    indices = batch_indices(seeds, len(data[0]), epochs, every_k * PER_DEVICE_BATCH)
    indices = jnp.asarray(indices.reshape(len(seeds), -1, PER_DEVICE_BATCH))
    train_one = trainer(opt, data)
    return np.asarray(jax.jit(jax.vmap(train_one))(initial_params(seeds), indices))


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
    return ga.measure.all_reduce_nbytes(step.lower(replicated, state).compile())


def accumulator_bytes(opt, params):
    state = jax.eval_shape(opt.init, params)
    return ga.measure.state_nbytes(state.acc_grads)


def _random_grads(params, seed=1):
    return jax.tree.map(
        lambda a: jax.random.normal(jax.random.key(seed), a.shape, a.dtype), params
    )


def _median_ms(times):
    return 1e3 * float(np.median(times))


def accumulation_ms(opts, params, every_k, windows, weighted=False):
    """Median ms of a micro-step and of an emitting step, per optimizer.

    ``update`` is jitted as a training step runs it: the state and the
    micro-batch gradients donated (in a training step the gradients are a
    dead temporary of the same program), the updates returned. Undonated
    gradients would make XLA copy them into the buffers of the emission
    loop's updates on every micro-step of an accumulator whose window
    cannot hold the updates (a ternary one), a cost no training step pays.
    A fresh copy of the gradients is made before each timed call, outside
    the timing. The optimizers take turns window by window, so that load on
    a shared machine falls on all of them alike. With ``weighted``, every
    micro-batch is passed a traced ``weight=`` (its number of examples).
    """
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
    grads = _random_grads(params)
    weight = {"weight": jnp.float32(PER_DEVICE_BATCH)} if weighted else {}

    def fresh_grads():
        return jax.block_until_ready(jax.tree.map(jnp.copy, grads))

    runs = {}
    for name, opt in opts.items():
        update = jax.jit(
            lambda g, s, w, o=opt: o.update(g, s, params, **w), donate_argnums=(0, 1)
        )
        state = opt.init(params)
        for _ in range(every_k):  # compile, and warm both branches
            state = jax.block_until_ready(update(fresh_grads(), state, weight))[1]
        runs[name] = [update, state, [], []]
    for _ in range(windows):
        for run in runs.values():
            update = run[0]
            for call in range(every_k):
                micro_batch = fresh_grads()
                begin = time.perf_counter()
                run[1] = jax.block_until_ready(update(micro_batch, run[1], weight))[1]
                run[3 if call == every_k - 1 else 2].append(time.perf_counter() - begin)
    return {
        name: (_median_ms(run[2]), _median_ms(run[3])) for name, run in runs.items()
    }


def calls_ms(fns, repeats):
    """Median ms of each ``fn()`` (already jitted), taking turns."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            begin = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - begin)
    return {name: _median_ms(t) for name, t in times.items()}


def transform_ms(transforms, params, repeats, devices=None):
    """Median ms of one ``update`` of each transform (state donated).

    With ``devices``, the update is pmapped over that many emulated devices
    (each holding ``params``-shaped updates), timing the whole step.
    """
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
    fns = {}
    for name, tx in transforms.items():
        if devices is None:
            grads, state = _random_grads(params), tx.init(params)
            update = jax.jit(tx.update, donate_argnums=1)
        else:
            grads = jax.tree.map(
                lambda a: jnp.stack([_random_grads(a, d) for d in range(devices)]),
                params,
            )
            state = jax.tree.map(
                lambda a: jnp.broadcast_to(a, (devices, *a.shape)), tx.init(params)
            )
            update = jax.pmap(tx.update, axis_name="i", donate_argnums=1)
        box = [state]

        def call(update=update, grads=grads, box=box):
            updates, box[0] = update(grads, box[0])
            return updates

        fns[name] = call
    return calls_ms(fns, repeats)


def timing_rows(sizes, every_k, repeats):
    """Compute time, ternary against its float32 counterpart, per model size."""
    sgd = optax.sgd(0.1)  # a cheap inner optimizer: the accumulator dominates
    rows = []
    for size_name, params in sizes.items():
        accumulators = {
            "float32": ga.MultiSteps(sgd, every_k).gradient_transformation(),
            "ternary": ga.ternary_accumulate(sgd, every_k),
        }
        # A window has one emitting step: 4 windows per repeat, so that its
        # median is over as many samples as the others are.
        acc = accumulation_ms(accumulators, params, every_k, windows=4 * repeats)
        weighted = accumulation_ms(
            accumulators, params, every_k, windows=4 * repeats, weighted=True
        )
        one = transform_ms(
            {"float32": optax.identity(), "ternary": ga.ternarize(0)},
            params,
            repeats * every_k,
        )
        mean = transform_ms(
            {
                "float32": ga.average_across_devices("i"),
                "ternary": ga.ternary_average_across_devices("i", 0),
            },
            jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(
                    (a.shape[0] // NUM_DEVICES, *a.shape[1:]), a.dtype
                ),
                params,
            ),
            repeats * every_k,
            devices=NUM_DEVICES,
        )
        for what, pair in (
            (
                f"accumulate micro-step (k={every_k})",
                (acc["float32"][0], acc["ternary"][0]),
            ),
            (
                f"accumulate emitting step (k={every_k})",
                (acc["float32"][1], acc["ternary"][1]),
            ),
            (
                f"accumulate micro-step, weight= (k={every_k})",
                (weighted["float32"][0], weighted["ternary"][0]),
            ),
            ("ternarize vs identity", (one["float32"], one["ternary"])),
            (
                f"device mean, {NUM_DEVICES} emulated devices",
                (mean["float32"], mean["ternary"]),
            ),
        ):
            rows.append((size_name, what, *pair))
    return rows


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
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed windows (accumulation) or 8x calls (the others) per size",
    )
    parser.add_argument(
        "--timing-only", action="store_true", help="skip accuracy and bytes"
    )
    _headline.add_argument(parser)
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    start = time.time()
    data = tuple(jnp.asarray(a) for a in _digits.split())
    mlp = jax.eval_shape(lambda: _digits.init_mlp(_digits.LAYERS, 0))
    large = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(4)}
    huge = {f"w{i}": jax.ShapeDtypeStruct((2048, 2048), jnp.float32) for i in range(4)}
    every_k = NUM_DEVICES
    timings = timing_rows({"4M": large, "16M": huge}, every_k, args.repeats)
    print(
        f"\nCompute time, ms (median; jax {jax.__version__}, "
        f"{jax.device_count()} CPU devices; 4 leaves of 1024^2 or 2048^2; the "
        f"device mean holds 1/{NUM_DEVICES} of them per device; accumulation "
        "with sgd as the inner optimizer)\n"
    )
    print("| params | step | float32 | ternary | ratio |")
    print("|---|---|---|---|---|")
    for size_name, what, reference, ternary_time in timings:
        print(
            f"| {size_name} | {what} | {reference:.2f} | {ternary_time:.2f} | "
            f"{ternary_time / reference:.2f}x |"
        )
    if args.timing_only:
        return

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
                summary(accuracies),
            )
        )
    float_acc = None
    for name, opt in accumulating.items():
        acc_mlp, acc_large = accumulator_bytes(opt, mlp), accumulator_bytes(opt, large)
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
                summary(accuracies),
            )
        )

    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(mlp))
    print(
        f"\nload_digits MLP {_digits.LAYERS} ({num_params} params), adam "
        f"{LEARNING_RATE}, effective batch {NUM_DEVICES * PER_DEVICE_BATCH}, "
        f"{args.epochs} epochs, seeds {seeds}; jax {jax.__version__}, "
        f"{jax.device_count()} CPU devices\n"
    )
    header = (
        "setup",
        "wire bytes/step, MLP",
        "wire, 4M params",
        "accumulator bytes",
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
