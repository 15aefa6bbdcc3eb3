"""A real flax program switched to once-per-window data parallelism.

The program is shaped like google/flax's ``examples/lm1b``: a linen language
model whose params are annotated with logical axis names
(``nn.with_logical_partitioning``), a ``TrainState`` over ``optax.adamw``
with a learning-rate schedule, jit with ``in_shardings`` / ``out_shardings``
derived from the annotations, a token-weighted loss and an accuracy
metric, a batch that may lack a field (``batch.get("inputs_position")``).

It is switched as the data-parallel guide says: `MultiSteps` with
``unreduced_axes="data"`` as the TrainState's ``tx``, the gradient from
`local_value_and_grad` (``has_weight``, ``has_aux``), ``weight=`` passed to
``tx.update`` (the TrainState pattern of the frameworks guide, its ``step``
counting gradient steps), the state's shardings from
`gradaccum_jax.state_shardings`. Checked against the unmodified program
fed the same examples as one big batch per window, and by what the
compiled micro-step sends (`gradaccum_jax.measure.step_traffic`).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax.measure import step_traffic

nn = pytest.importorskip("flax.linen")
train_state = pytest.importorskip("flax.training.train_state")

VOCAB, EMBED, MLP, LENGTH = 32, 16, 32, 8
K, MICRO = 4, 16  # micro-batches per window, sequences per micro-batch


class TinyLM(nn.Module):
    """An embedding, one residual MLP block, the embedding as the output
    layer: logical names on every param and on the activations."""

    one_hot: bool = False  # the lookup as a product (no scatter in backward)

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.3)
        embed = nn.Embed(
            VOCAB,
            EMBED,
            embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")),
        )
        if self.one_hot:
            one_hot = jax.nn.one_hot(tokens, VOCAB)
            x = jnp.einsum("blv,ve->ble", one_hot, embed.embedding)
        else:
            x = embed(tokens)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.Dense(
            MLP,
            kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )(x)
        x = x + nn.Dense(
            EMBED,
            kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )(jax.nn.gelu(h))
        return embed.attend(x)


def loss_fn(params, apply_fn, inputs, targets, weights, positions):
    """The token-weighted mean loss and the token count; the number of
    correct tokens as aux. ``positions`` may be None (unpacked batches)."""
    del positions
    logits = apply_fn({"params": params}, inputs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    count = jnp.sum(weights)
    loss = jnp.sum(losses * weights) / jnp.maximum(count, 1.0)
    correct = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
    return (loss, count), {"correct": correct}


def _micro_batches(n: int) -> list[dict[str, np.ndarray]]:
    rs = np.random.RandomState(0)
    batches = []
    for _ in range(n):
        tokens = rs.randint(0, VOCAB, (MICRO, LENGTH + 1)).astype(np.int32)
        batches.append(
            {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "weights": (rs.rand(MICRO, LENGTH) < 0.8).astype(np.float32),
            }
        )
    return batches


class Run(NamedTuple):
    params: Any
    losses: list[float]  # each window's token-weighted mean loss
    correct: list[float]  # each window's correct tokens
    steps: int  # TrainState.step at the end
    compiled: Any  # the compiled (micro-)step


def _per_device_rules(rules):
    """The rules inside the per-device loss: "batch" is a device's own rows,
    split over no data axis."""

    def without_data(axes):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = tuple(name for name in names if name != "data")
        return kept or None

    return tuple(
        (name, without_data(axes) if name == "batch" else axes) for name, axes in rules
    )


def _run(mesh, rules, *, switched: bool, one_hot: bool) -> Run:
    model = TinyLM(one_hot=one_hot)
    inner = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.01)
    opt = ga.MultiSteps(inner, K, unreduced_axes="data") if switched else None
    tx = opt.gradient_transformation() if switched else inner
    example = jnp.ones((1, LENGTH), jnp.int32)
    batch_axes = tuple(name for name in ("data", "fsdp") if name in mesh.axis_names)
    data = NamedSharding(mesh, P(batch_axes))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(model.init, jax.random.key(0), example)["params"]

        def init_fn(rng):
            params = nn.unbox(model.init(rng, example)["params"])
            return train_state.TrainState.create(
                apply_fn=model.apply, params=params, tx=tx
            )

        params_sharding = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(boxed), mesh, rules
        )
        shardings = train_state.TrainState(
            step=NamedSharding(mesh, P()),
            apply_fn=model.apply,
            params=params_sharding,
            tx=tx,
            opt_state=ga.state_shardings(tx, boxed),
        )
        state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))

        if switched:
            local_rules = _per_device_rules(rules)

            def per_device_loss(params, *batch):
                with nn.logical_axis_rules(local_rules):
                    return loss_fn(params, model.apply, *batch)

            grad_fn = ga.local_value_and_grad(
                per_device_loss, "data", has_weight=True, has_aux=True
            )

            def step(state, batch):
                ((loss, weight), aux), grads = grad_fn(
                    state.params,
                    batch["inputs"],
                    batch["targets"],
                    batch["weights"],
                    batch.get("inputs_position"),
                )
                # The TrainState pattern: weight= reaches tx.update, and
                # step counts gradient steps.
                updates, opt_state = state.tx.update(
                    grads, state.opt_state, state.params, weight=weight
                )
                params = optax.apply_updates(state.params, updates)
                state = state.replace(
                    step=state.step + opt.has_updated(opt_state),
                    params=params,
                    opt_state=opt_state,
                )
                # Per-device rows (no collective): summed on the host.
                return state, (loss, weight, aux["correct"])

        else:

            def step(state, batch):
                def big_batch_loss(params):
                    (loss, count), aux = loss_fn(
                        params,
                        model.apply,
                        batch["inputs"],
                        batch["targets"],
                        batch["weights"],
                        batch.get("inputs_position"),
                    )
                    return loss, (count, aux)

                (loss, (count, aux)), grads = jax.value_and_grad(
                    big_batch_loss, has_aux=True
                )(state.params)
                return state.apply_gradients(grads=grads), (
                    loss * count,
                    count,
                    aux["correct"],
                )

        jitted = jax.jit(
            step,
            in_shardings=(shardings, data),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        batches = _micro_batches(2 * K)
        if not switched:  # each window's micro-batches as one big batch
            batches = [
                {
                    name: np.concatenate([b[name] for b in batches[i : i + K]])
                    for name in batches[0]
                }
                for i in (0, K)
            ]
        compiled = jitted.lower(state, jax.device_put(batches[0], data)).compile()
        losses, correct, weights = [], [], []
        for batch in batches:
            state, (loss, weight, right) = jitted(state, jax.device_put(batch, data))
            losses.append(float(np.sum(loss)))
            weights.append(float(np.sum(weight)))
            correct.append(float(np.sum(right)))
        per_window = len(batches) // 2
        windows = [slice(0, per_window), slice(per_window, len(batches))]
        return Run(
            params=jax.device_get(state.params),
            losses=[sum(losses[w]) / sum(weights[w]) for w in windows],
            correct=[sum(correct[w]) for w in windows],
            steps=int(state.step),
            compiled=compiled,
        )


MESHES = {
    # lm1b's layout: every param replicated, the batch over "data".
    "data": ((8,), ("data",), (("batch", "data"),)),
    # HSDP: params split over "fsdp" in each of 2 "data" groups, the batch
    # over both.
    "data-fsdp": (
        (2, 4),
        ("data", "fsdp"),
        (("batch", ("data", "fsdp")), ("embed", "fsdp")),
    ),
}


@pytest.mark.parametrize(
    ("layout", "one_hot"),
    [("data", False), ("data-fsdp", False), ("data-fsdp", True)],
    ids=["data-embed", "data-fsdp-embed", "data-fsdp-one-hot"],
)
def test_a_switched_lm1b_program_reduces_once_per_window(layout, one_hot):
    shape, names, rules = MESHES[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    big = _run(mesh, rules, switched=False, one_hot=one_hot)
    switched = _run(mesh, rules, switched=True, one_hot=one_hot)

    # The big-batch run's values, its metrics kept, its step counted in
    # gradient steps.
    assert switched.steps == big.steps == 2
    np.testing.assert_allclose(switched.losses, big.losses, rtol=1e-5)
    assert switched.correct == big.correct
    for got, want in zip(
        jax.tree.leaves(switched.params), jax.tree.leaves(big.params), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4)

    # A micro-step sends nothing over "data": one reduction of the window
    # (inside the emission's loop), no gather of it.
    traffic = step_traffic(switched.compiled, mesh, "data")
    assert traffic.once_per_window, traffic.every_call_over_summed
    assert list(traffic.per_window) == [("data",)]
    assert all(c.axes == ("fsdp",) for c in traffic.gathers)
    if layout == "data":
        assert traffic.every_call == {} and traffic.gathers == ()
        return
    # Over "fsdp", the unmodified program's own gathers of its params (with
    # the lookup's scatter backward, its token ids gathered instead of one
    # of the weights: the scatter runs per data group).
    plain = step_traffic(big.compiled, mesh, "data")
    ours = sorted(c.shapes for c in traffic.gathers if c.shapes[0][0] == "f")
    theirs = sorted(c.shapes for c in plain.gathers)
    if one_hot:
        assert ours == theirs
    else:
        assert not (collections.Counter(ours) - collections.Counter(theirs))
        assert len(traffic.gathers) == len(plain.gathers)
