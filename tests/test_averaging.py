"""Tests for average_across_devices.

conftest.py gives the test process 8 emulated CPU devices.
"""

from __future__ import annotations

import collections
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from helpers import EAGER_AND_JIT

N_DEVICES = 8

# Device i holds updates {"w": [i, 2i], "b": i} (b in bfloat16) and weight
# WEIGHTS[i]. Unweighted mean: w = [3.5, 7], b = 3.5. Weighted mean:
# sum(w_i * i) / sum(w_i) = 33 / 10 = 3.3, so w = [3.3, 6.6], b = 3.3.
UPDATES = {
    "w": jnp.stack([jnp.arange(8.0), 2.0 * jnp.arange(8.0)], axis=1),
    "b": jnp.arange(8.0, dtype=jnp.bfloat16),
}
WEIGHTS = jnp.array([1.0, 2.0, 3.0, 0.0, 0.0, 1.0, 1.0, 2.0])


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert jax.device_count() == N_DEVICES, "tests/conftest.py sets 8 CPU devices"
    return Mesh(np.array(jax.devices()), ("d",))


def _pmap_average(updates, weights=None, **extra_args):
    averager = ga.average_across_devices("d")

    def average(updates, weight):
        return averager.update(
            updates, averager.init(updates), weight=weight, **extra_args
        )[0]

    if weights is None:
        return jax.pmap(lambda u: average(u, None), axis_name="d")(updates)
    return jax.pmap(average, axis_name="d")(updates, weights)


def _shard_map_average(mesh, updates, weights=None):
    averager = ga.average_across_devices("d")

    def average(updates, weights):
        # A weight sharded as P("d") arrives as a shape-(1,) block.
        weight = None if weights is None else weights[0]
        return averager.update(updates, averager.init(updates), weight=weight)[0]

    return jax.jit(
        jax.shard_map(average, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )(updates, weights)


def _assert_every_device_holds(averaged, expected_w, expected_b):
    assert averaged["w"].dtype == jnp.float32
    assert averaged["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        averaged["w"], np.tile(expected_w, (N_DEVICES, 1)), rtol=1e-6
    )
    np.testing.assert_array_equal(
        averaged["b"].astype(jnp.float32), np.full(N_DEVICES, expected_b)
    )


# --- the mean itself ---------------------------------------------------------


def test_unweighted_is_pmean_under_pmap():
    _assert_every_device_holds(_pmap_average(UPDATES), [3.5, 7.0], 3.5)


def test_unweighted_is_pmean_under_shard_map(mesh):
    _assert_every_device_holds(_shard_map_average(mesh, UPDATES), [3.5, 7.0], 3.5)


def test_weighted_mean_under_pmap():
    # b: 3.3 rounded to bfloat16 is 3.296875.
    _assert_every_device_holds(_pmap_average(UPDATES, WEIGHTS), [3.3, 6.6], 3.296875)


def test_weighted_mean_under_shard_map(mesh):
    _assert_every_device_holds(
        _shard_map_average(mesh, UPDATES, WEIGHTS), [3.3, 6.6], 3.296875
    )


def test_integer_weights_give_the_same_mean():
    averaged = _pmap_average(UPDATES, WEIGHTS.astype(jnp.int32))
    _assert_every_device_holds(averaged, [3.3, 6.6], 3.296875)


def test_zero_total_weight_gives_zeros_not_nan():
    nan_updates = jax.tree.map(lambda u: jnp.full_like(u, jnp.nan), UPDATES)
    averaged = _pmap_average(nan_updates, jnp.zeros(N_DEVICES))
    _assert_every_device_holds(averaged, [0.0, 0.0], 0.0)


def test_zero_weight_device_is_left_out_even_if_its_updates_are_nan():
    # An empty shard's mean loss is 0/0: its NaN gradient must not spread.
    weights = jnp.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    updates = jax.tree.map(lambda u: u.at[0].set(jnp.nan), UPDATES)
    # Mean of devices 1..7: 4.
    _assert_every_device_holds(_pmap_average(updates, weights), [4.0, 8.0], 4.0)


def test_zero_weight_device_is_left_out_under_shard_map_too(mesh):
    weights = jnp.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    updates = jax.tree.map(lambda u: u.at[0].set(jnp.nan), UPDATES)
    averaged = _shard_map_average(mesh, updates, weights)
    _assert_every_device_holds(averaged, [4.0, 8.0], 4.0)


@pytest.mark.parametrize(
    "average",
    [
        lambda: ga.average_across_devices("d"),
        # Every leaf below min_size: averaged exactly in float32.
        lambda: ga.ternary_average_across_devices("d", 0, min_size=10**6),
    ],
    ids=["float", "ternary"],
)
def test_a_window_of_padding_only_on_one_device_adds_nothing(mesh, average):
    """The end of an epoch under shard_map: device 0 sees only padding in
    both micro-batches of the window (weight 0, NaN gradients); the window
    is the weighted mean of the other devices' gradients."""
    opt = ga.MultiSteps(optax.chain(average(), optax.sgd(1.0)), 2)
    params = {"w": jnp.zeros(2)}
    grads = jnp.stack([jnp.arange(8.0), 2.0 * jnp.arange(8.0)], axis=1)
    grads = grads.at[0].set(jnp.nan)
    weights = jnp.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def window(grads, weights):
        state = opt.init(params)
        for _ in range(2):
            updates, state = opt.update(
                {"w": grads[0]}, state, params, weight=weights[0]
            )
        return updates["w"][None]

    updates = jax.jit(
        jax.shard_map(window, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )(grads, weights)
    # Mean of devices 1..7: [4, 8], on every device.
    np.testing.assert_array_equal(updates, -np.tile([4.0, 8.0], (N_DEVICES, 1)))


def test_other_extra_args_are_ignored_and_it_chains():
    opt = optax.chain(ga.average_across_devices("d"), optax.sgd(1.0))

    def step(updates, weight):
        return opt.update(updates, opt.init(updates), weight=weight, value=1.0)[0]

    updates = jax.pmap(step, axis_name="d")(UPDATES, WEIGHTS)
    # sgd(1.0) negates the weighted mean.
    _assert_every_device_holds(updates, [-3.3, -6.6], -3.296875)
    averaged = _pmap_average(UPDATES, WEIGHTS, step=3, value=jnp.ones(()))
    _assert_every_device_holds(averaged, [3.3, 6.6], 3.296875)


def test_tuple_of_axis_names_averages_over_both(mesh):
    mesh_2d = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    averager = ga.average_across_devices(("x", "y"))

    def average(updates, weights):
        return averager.update(updates, None, weight=weights[0, 0])[0]

    averaged = jax.jit(
        jax.shard_map(
            average, mesh=mesh_2d, in_specs=P(("x", "y")), out_specs=P(("x", "y"))
        )
    )(UPDATES, WEIGHTS.reshape(8, 1))
    _assert_every_device_holds(averaged, [3.3, 6.6], 3.296875)


def test_shard_map_grad_of_replicated_params_is_already_summed(mesh):
    # What the docstring warns about: without pcast(..., to="varying") the
    # gradient of P() params is the sum over devices, not this device's own.
    def grads(params, inputs, cast):
        if cast:
            params = jax.lax.pcast(params, "d", to="varying")
        local = jax.grad(lambda p: jnp.sum(p * inputs))(params)
        return local[None]

    inputs = jnp.arange(8.0)
    per_device = {
        cast: jax.jit(
            jax.shard_map(
                lambda p, x, cast=cast: grads(p, x, cast),
                mesh=mesh,
                in_specs=(P(), P("d")),
                out_specs=P("d"),
            )
        )(jnp.ones(()), inputs)
        for cast in (True, False)
    }
    np.testing.assert_array_equal(per_device[True], inputs)
    np.testing.assert_array_equal(per_device[False], np.full(8, 28.0))


# --- errors ------------------------------------------------------------------


@EAGER_AND_JIT
def test_unbound_axis_name_says_to_run_inside_pmap_or_shard_map(compile_fn):
    averager = ga.average_across_devices("batch")
    with pytest.raises(NameError) as error:
        compile_fn(averager.update)(UPDATES, averager.init(UPDATES))
    message = str(error.value)
    assert message.startswith("average_across_devices: axis name 'batch' is not bound.")
    assert "jax.pmap(..., axis_name='batch')" in message
    assert "jax.shard_map(" in message
    assert "under plain `jax.jit`" in message


def test_wrong_axis_name_inside_pmap_fails_the_same_way():
    averager = ga.average_across_devices("batch")
    with pytest.raises(NameError, match="axis name 'batch' is not bound"):
        jax.pmap(lambda u: averager.update(u, None)[0], axis_name="d")(UPDATES)


def test_non_scalar_weight_fails_with_the_shard_map_hint(mesh):
    with pytest.raises(ValueError) as error:
        averager = ga.average_across_devices("d")
        jax.jit(
            jax.shard_map(
                lambda u, w: averager.update(u, None, weight=w)[0],
                mesh=mesh,
                in_specs=P("d"),
                out_specs=P("d"),
            )
        )(UPDATES, WEIGHTS)
    assert str(error.value) == (
        "average_across_devices: `weight` must be a scalar (the number of "
        "examples or tokens behind this gradient), got shape (1,). Under "
        "shard_map a weight sharded as P(axis_name) arrives as a shape-(1,) "
        "block: pass `weight[0]`."
    )


# --- inside accumulation: one reduction per window ---------------------------


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Splits compiled HLO text into {computation name: instruction lines}."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def _reachable(computations: dict[str, list[str]], root: str) -> set[str]:
    """The computations ``root`` calls, directly or not (including itself)."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            for line in computations[name]:
                todo += [
                    c for c in re.findall(r"%([\w.\-]+)", line) if c in computations
                ]
    return seen


def _all_reduced_shapes(lines: list[str]) -> list[str]:
    """The shapes reduced by the all-reduce instructions among ``lines``."""
    shapes = []
    for line in lines:
        instruction = re.match(r"\s*%\S+ = (.*?) all-reduce(?:-start)?\(", line)
        if instruction:
            shapes += re.findall(r"\w+\[[\d,]*\]", instruction.group(1))
    return shapes


PARAMS = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}


def _replicate(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N_DEVICES, *x.shape)), tree)


@pytest.mark.parametrize("wrapper", ["MultiSteps", "accumulate"])
def test_all_reduce_runs_only_in_the_emitting_branch(wrapper):
    inner = optax.chain(ga.average_across_devices("d"), optax.sgd(0.1))
    if wrapper == "MultiSteps":
        opt = ga.MultiSteps(inner, every_k_schedule=4)
    else:
        opt = ga.accumulate(inner, 4)

    def train_step(params, opt_state, grads, weight):
        updates, opt_state = opt.update(grads, opt_state, params, weight=weight)
        return optax.apply_updates(params, updates), opt_state

    hlo = (
        jax.pmap(train_step, axis_name="d")
        .lower(
            _replicate(PARAMS),
            _replicate(opt.init(PARAMS)),
            _replicate(PARAMS),
            jnp.ones(N_DEVICES),
        )
        .compile()
        .as_text()
    )
    computations, entry = _computations(hlo)
    while_bodies = [
        body
        for line in computations[entry]
        for body in re.findall(r" while\(.*\bbody=%([\w.\-]+)", line)
    ]
    # run_if's 0/1-trip loop is the only loop of the step.
    assert len(while_bodies) == 1, while_bodies
    in_body = _reachable(computations, while_bodies[0])
    reduced_in_body = _all_reduced_shapes(
        [line for name in in_body for line in computations[name]]
    )
    reduced_elsewhere = _all_reduced_shapes(
        [line for name in set(computations) - in_body for line in computations[name]]
    )
    assert reduced_elsewhere == []
    # Once per window: every gradient leaf once, plus the window's total
    # weight (a float32 scalar) for the weighted mean.
    assert collections.Counter(reduced_in_body) == collections.Counter(
        ["f32[]", "f32[4,3]", "f32[3]"]
    )


# --- data-parallel equivalence with accumulation -----------------------------

K = 3  # micro-batches per window
WINDOWS = 2
MAX_MICRO_BATCH = 5
LEARNING_RATE = 0.1


def _ragged_data():
    """8 devices x WINDOWS * K micro-batches of 0..5 examples each (padded)."""
    rng = np.random.default_rng(0)
    shape = (N_DEVICES, WINDOWS * K, MAX_MICRO_BATCH)
    inputs = rng.normal(size=(*shape, 4)).astype(np.float32)
    targets = rng.normal(size=(*shape, 3)).astype(np.float32)
    sizes = rng.integers(1, MAX_MICRO_BATCH + 1, size=shape[:2])
    # An empty micro-batch, and a device that sees nothing in window 2.
    sizes[2, 1] = 0
    sizes[7, K:] = 0
    mask = (np.arange(MAX_MICRO_BATCH) < sizes[..., None]).astype(np.float32)
    return inputs, targets, mask


def _mean_loss(params, inputs, targets, mask):
    errors = inputs @ params["w"] + params["b"] - targets
    per_example = 0.5 * jnp.sum(errors**2, axis=-1)
    # max(., 1): an empty micro-batch has loss 0 (and weight 0), not 0/0.
    return jnp.sum(mask * per_example) / jnp.maximum(jnp.sum(mask), 1.0)


def _initial_params():
    rng = np.random.default_rng(1)
    return {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.zeros((3,), jnp.float32),
    }


def _inner_optimizer():
    return optax.sgd(LEARNING_RATE, momentum=0.9)


def _big_batch_reference(inputs, targets, mask):
    """One device, the whole window's batch at once: the params to match."""
    params, opt = _initial_params(), _inner_optimizer()
    opt_state = opt.init(params)
    for window in range(WINDOWS):
        steps = slice(window * K, (window + 1) * K)
        grads = jax.grad(_mean_loss)(
            params,
            inputs[:, steps].reshape(-1, 4),
            targets[:, steps].reshape(-1, 3),
            mask[:, steps].reshape(-1),
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _data_parallel_optimizer(wrapper, track_noise_scale=False):
    inner = optax.chain(ga.average_across_devices("d"), _inner_optimizer())
    if wrapper == "MultiSteps":
        return ga.MultiSteps(
            inner, every_k_schedule=K, track_noise_scale=track_noise_scale
        )
    return ga.accumulate(inner, K, track_noise_scale=track_noise_scale)


def _micro_step(opt, params, opt_state, inputs, targets, mask):
    grads = jax.grad(_mean_loss)(params, inputs, targets, mask)
    updates, opt_state = opt.update(grads, opt_state, params, weight=jnp.sum(mask))
    return optax.apply_updates(params, updates), opt_state


def _assert_all_devices_match(params_per_device, reference):
    for leaf in jax.tree.leaves(params_per_device):
        # The all-reduce gives every device bit-identical updates.
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    chex.assert_trees_all_close(
        jax.tree.map(lambda leaf: leaf[0], params_per_device),
        reference,
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    ("wrapper", "track"),
    [("MultiSteps", False), ("accumulate", False), ("accumulate", True)],
)
def test_data_parallel_accumulation_equals_big_batch_under_pmap(wrapper, track):
    inputs, targets, mask = _ragged_data()
    opt = _data_parallel_optimizer(wrapper, track)
    params = _replicate(_initial_params())
    opt_state = _replicate(opt.init(_initial_params()))
    train_step = jax.pmap(
        lambda *args: _micro_step(opt, *args), axis_name="d", donate_argnums=(0, 1)
    )
    for step in range(WINDOWS * K):
        params, opt_state = train_step(
            params, opt_state, inputs[:, step], targets[:, step], mask[:, step]
        )
        emitted = (step + 1) % K == 0
        np.testing.assert_array_equal(opt_state.emitted, [emitted] * N_DEVICES)
    _assert_all_devices_match(params, _big_batch_reference(inputs, targets, mask))
    if track:  # the device-local estimate: finite, one per device
        noise_trace = jax.vmap(opt.stats)(opt_state).noise_trace
        assert noise_trace.shape == (N_DEVICES,) and np.isfinite(noise_trace).all()


@pytest.mark.parametrize("track", [False, True])
def test_data_parallel_accumulation_equals_big_batch_under_shard_map(mesh, track):
    inputs, targets, mask = _ragged_data()
    opt = _data_parallel_optimizer("MultiSteps", track)

    def train(params, inputs, targets, mask):
        # Replicated (P()) params are device-invariant, and JAX's autodiff
        # already sums the gradient of an invariant input over the axis.
        # Marking them varying keeps each device's gradient its own, for
        # average_across_devices to weigh.
        params = jax.lax.pcast(params, "d", to="varying")
        opt_state = opt.init(params)
        for step in range(WINDOWS * K):
            params, opt_state = _micro_step(
                opt, params, opt_state, inputs[0, step], targets[0, step], mask[0, step]
            )
        return jax.tree.map(lambda leaf: leaf[None], params)

    params = jax.jit(
        jax.shard_map(
            train, mesh=mesh, in_specs=(P(), P("d"), P("d"), P("d")), out_specs=P("d")
        )
    )(_initial_params(), inputs, targets, mask)
    _assert_all_devices_match(params, _big_batch_reference(inputs, targets, mask))


def test_unweighted_pmean_differs_from_the_big_batch_on_ragged_data():
    # The reason for `weight=`: averaging per-device means is biased when the
    # devices saw different numbers of examples.
    inputs, targets, mask = _ragged_data()
    opt = _data_parallel_optimizer("MultiSteps")
    params = _replicate(_initial_params())
    opt_state = _replicate(opt.init(_initial_params()))

    def unweighted_step(params, opt_state, inputs, targets, mask):
        grads = jax.grad(_mean_loss)(params, inputs, targets, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    train_step = jax.pmap(unweighted_step, axis_name="d")
    for step in range(K):
        params, opt_state = train_step(
            params, opt_state, inputs[:, step], targets[:, step], mask[:, step]
        )
    reference = _initial_params()
    grads = jax.grad(_mean_loss)(
        reference,
        inputs[:, :K].reshape(-1, 4),
        targets[:, :K].reshape(-1, 3),
        mask[:, :K].reshape(-1),
    )
    expected = optax.apply_updates(
        reference, jax.tree.map(lambda g: -LEARNING_RATE * g, grads)
    )
    gap = np.max(np.abs(params["w"][0] - expected["w"]))
    # 1.5e-2 off, against the 1e-6 of the weighted version above.
    np.testing.assert_allclose(gap, 0.015455, rtol=1e-3)


def test_devices_skipping_different_micro_batches_stay_in_step():
    """With skip_nonfinite, a device that drops a NaN micro-batch still closes
    its window on the same call as the others, so the all-reduce at the
    emitting step is reached by every device (no deadlock), and the dropped
    micro-batch counts with weight 0."""
    n = jax.local_device_count()
    tx = ga.accumulate(
        optax.chain(ga.average_across_devices("d"), optax.sgd(1.0)),
        2,
        skip_nonfinite=True,
    )
    params = _replicate({"w": jnp.zeros(())})
    state = jax.pmap(tx.init)(params)
    step = jax.pmap(lambda g, s, p, w: tx.update(g, s, p, weight=w), axis_name="d")
    first = {"w": jnp.arange(n, dtype=jnp.float32).at[0].set(jnp.nan)}
    second = {"w": jnp.full((n,), 10.0)}
    ones = jnp.ones((n,))
    _, state = step(first, state, params, ones)
    updates, state = step(second, state, params, ones)
    # Device 0 saw one micro-batch (10), the others two (i and 10): the
    # weighted mean over all 15 accepted micro-batches.
    expected = -(sum(range(1, n)) + 10.0 * n) / (2 * n - 1)
    np.testing.assert_allclose(updates["w"], np.full((n,), expected), rtol=1e-6)
    assert bool(jnp.all(state.emitted))


def test_shard_map_inner_output_replicated_over_devices(mesh):
    """After the all-reduce the inner chain's updates are the same on every
    device (device-invariant), while the loop slot started from per-device
    buffers; the engine reconciles the two types inside shard_map."""
    tx = ga.MultiSteps(optax.chain(ga.average_across_devices("d"), optax.sgd(1.0)), 2)
    params = {"w": jnp.zeros((3,))}

    def two_micro_steps(grads):
        # grads: this device's (2, 3) block: one row per micro-step.
        state = tx.init(params)
        _, state = tx.update({"w": grads[0]}, state, params)
        updates, state = tx.update({"w": grads[1]}, state, params)
        return updates["w"][None], state.acc_weight[None]

    grads = jnp.arange(N_DEVICES * 2 * 3, dtype=jnp.float32).reshape(N_DEVICES * 2, 3)
    updates, weights = jax.jit(
        jax.shard_map(
            two_micro_steps,
            mesh=mesh,
            in_specs=P("d"),
            out_specs=(P("d"), P("d")),
        )
    )(grads)
    expected = -np.asarray(grads).mean(axis=0)
    np.testing.assert_allclose(updates, np.tile(expected, (N_DEVICES, 1)), rtol=1e-6)
    np.testing.assert_array_equal(weights, np.zeros(N_DEVICES))


def test_shard_map_params_come_out_replicated_after_accumulation(mesh):
    """With check_vma (the default) the updates of MultiSteps(chain(
    average_across_devices, ...)) are typed device-invariant, so the params
    can be returned with out_specs=P(). The state's window sum is per device
    (P("d")); its counters and the inner state are the same everywhere (P()),
    which keeps the emitting decision, and so the updates, invariant."""
    tx = ga.MultiSteps(
        optax.chain(ga.average_across_devices("d"), optax.sgd(1.0, momentum=0.5)), 2
    )
    params = {"w": jnp.zeros((3,))}
    state_specs = ga.MultiStepsState(
        mini_step=P(),
        gradient_step=P(),
        inner_opt_state=P(),
        acc_grads=P("d"),
        skip_state=P(),
        acc_weight=P(),
        micro_steps=P(),
        emitted=P(),
    )

    def step(params, state, grads):
        updates, state = tx.update({"w": grads}, state, params)
        return optax.apply_updates(params, updates), state

    train_step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), state_specs, P("d")),
            out_specs=(P(), state_specs),
        )
    )
    state = tx.init(params)
    # The global window sum: one (3,) block per device.
    state = state._replace(acc_grads={"w": jnp.zeros((N_DEVICES * 3,))})
    grads = jnp.arange(N_DEVICES * 2 * 3, dtype=jnp.float32).reshape(2, -1)
    params, state = train_step(params, state, grads[0])
    params, state = train_step(params, state, grads[1])
    np.testing.assert_allclose(
        params["w"],
        -np.asarray(grads).reshape(2 * N_DEVICES, 3).mean(axis=0),
        rtol=1e-6,
    )
    assert bool(state.emitted)
