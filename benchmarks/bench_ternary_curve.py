"""Test accuracy of ternary averaging against training steps, next to float32.

The digits MLP of ``bench_ternary.py`` (its data, model and data-parallel
training loop on 8 emulated CPU devices, imported from it), averaged across
devices with ``ternary_average_across_devices`` or a float32 pmean, trained
for 1, 2, 4, ... epochs. An ``e``-epoch run draws the same batches and the
same ternary random numbers as the first ``e`` epochs of a longer one, so
each point is the accuracy the longest run had after that many steps. Mean
(and min..max) test accuracy over ``--seeds`` seeds.

Run: ``python benchmarks/bench_ternary_curve.py [--epochs 1,2,4,8,16,30]``
"""

from __future__ import annotations

import argparse
import time

import bench_ternary  # sets 8 emulated devices before jax starts
import numpy as np

import _digits
import _headline
import gradaccum_jax as ga


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--epochs", default="1,2,4,8,16,30", help="E,E,...")
    _headline.add_argument(parser)
    args = parser.parse_args()
    import jax.numpy as jnp

    start = time.time()
    seeds = list(range(args.seeds))
    epochs = [int(e) for e in args.epochs.split(",") if e]
    data = tuple(jnp.asarray(a) for a in _digits.split())
    global_batch = bench_ternary.NUM_DEVICES * bench_ternary.PER_DEVICE_BATCH
    steps_per_epoch = len(data[0]) // global_batch
    variants = {
        "float32 mean": bench_ternary.float_pmean(),
        "ternary mean": ga.ternary_average_across_devices("i", 0),
    }
    accuracy = {name: [] for name in variants}
    for name, averaging in variants.items():
        for e in epochs:
            per_seed = bench_ternary.train_data_parallel(averaging, data, seeds, e)
            accuracy[name].append([100 * float(a) for a in per_seed])

    print(
        f"# digits MLP, adam {bench_ternary.LEARNING_RATE}, "
        f"{bench_ternary.NUM_DEVICES} devices x {bench_ternary.PER_DEVICE_BATCH} "
        f"examples, {steps_per_epoch} steps per epoch, seeds {seeds}: "
        "test accuracy %, mean (min..max)\n"
    )
    print("| steps | " + " | ".join(variants) + " | ternary - float32 |")
    print("|---:|" + "---:|" * (len(variants) + 1))
    for i, e in enumerate(epochs):
        cells = [
            f"{np.mean(accuracy[n][i]):.2f} ({min(accuracy[n][i]):.2f}.."
            f"{max(accuracy[n][i]):.2f})"
            for n in variants
        ]
        gap = np.mean(accuracy["ternary mean"][i]) - np.mean(
            accuracy["float32 mean"][i]
        )
        print(f"| {e * steps_per_epoch} | " + " | ".join(cells) + f" | {gap:+.2f} |")
    print(f"\n({time.time() - start:.0f} s)")
    _headline.write(
        args.json,
        "ternary accuracy curve",
        {},
        data={
            "steps": [e * steps_per_epoch for e in epochs],
            "accuracy": accuracy,
            "seeds": len(seeds),
        },
    )


if __name__ == "__main__":
    main()
