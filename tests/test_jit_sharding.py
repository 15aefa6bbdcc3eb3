"""Data parallelism under jax.jit: one gradient all-reduce per window.

Gradients from `local_value_and_grad` are unreduced over the data axis; an
accumulator built with ``unreduced_axes`` keeps its window unreduced across
jitted calls and reduces it once, inside the emission loop. The HLO tests
count all-reduces in compiled programs; the numerical tests compare with the
gradient of the whole (weighted, ragged) batch on one device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, reshard
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax.measure import all_reduces
from helpers import _eager, entry_arrays

N_DEVICES = 8
K = 3


@pytest.fixture
def mesh():
    mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        yield mesh


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def any_mesh(request):
    """Explicit: terms are unreduced arrays. Auto: terms stacked per device."""
    mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(request.param,))
    with jax.set_mesh(mesh):
        yield mesh


def _holds_terms(leaf, mesh, shape):
    """Whether ``leaf`` keeps one term per device of a value of ``shape``.

    Between jitted calls, as an ordinary array split over ``data`` (no
    unreduced type crosses a jit boundary), on Explicit and Auto meshes
    alike: the devices' terms one after another along the leading
    dimension (a new leading axis where there is none or it has size 1).
    """
    del mesh  # the same form on either kind of mesh
    if ga._tree.unreduced_axes(leaf) or leaf.sharding.spec[0] != "data":
        return False
    if shape and shape[0] > 1:
        return leaf.shape == (N_DEVICES * shape[0], *shape[1:])
    return leaf.shape == (N_DEVICES, *shape)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
        "b": jnp.zeros((4,)),
    }


PARAM_BYTES = (16 * 32 + 32 * 4 + 4) * 4


def _errors(params, x, y):
    pred = jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"]
    return jnp.mean((pred - y) ** 2, axis=-1)


def _mean_loss(params, x, y):
    return jnp.mean(_errors(params, x, y))


def _masked_loss(params, x, y, mask):
    """The device's masked mean loss and its number of valid examples."""
    count = jnp.sum(mask)
    loss = jnp.sum(mask * _errors(params, x, y)) / jnp.maximum(count, 1.0)
    return loss, count


def _micro_batches(sizes, masked=False, seed=0):
    rs = np.random.RandomState(seed)
    batches = []
    for n in sizes:
        x = rs.randn(n, 16).astype(np.float32)
        y = rs.randn(n, 4).astype(np.float32)
        # Ragged: devices hold different numbers of valid examples, some none.
        mask = (rs.rand(n) < 0.6).astype(np.float32) if masked else np.ones(n)
        batches.append((x, y, mask.astype(np.float32)))
    return batches


def _big_batch_grad(params, batches):
    x, y, mask = (np.concatenate(parts) for parts in zip(*batches, strict=True))

    def loss(p):
        return jnp.sum(mask * _errors(p, x, y)) / np.sum(mask)

    return jax.grad(loss)(jax.device_get(params))


def _place(batch):
    return tuple(jax.device_put(part, P("data")) for part in batch)


def _weighted_step(opt):
    grad_fn = ga.local_value_and_grad(_masked_loss, "data", has_weight=True)

    def step(params, state, x, y, mask):
        (_, weight), grads = grad_fn(params, x, y, mask)
        return opt.update(grads, state, params, weight=weight)

    return step


def _weighted_step_all_reduces(opt):
    """The all-reduces of ``opt``'s compiled `_weighted_step` (one micro-batch)."""
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    args = _place(_micro_batches([16], masked=True)[0])
    return all_reduces(
        jax.jit(_weighted_step(opt)).lower(params, state, *args).compile()
    )


def _unweighted_step(opt):
    """Each device's gradient of its mean loss: a micro-batch weighs 1/n each."""
    grad_fn = ga.local_value_and_grad(_mean_loss, "data")

    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y)
        return opt.update(grads, state, params)

    return step


def _max_error(updates, grads):
    # sgd(1.0) emits minus the window's gradient.
    return max(
        float(np.abs(-np.asarray(updates[k]) - np.asarray(grads[k])).max())
        for k in grads
    )


# --- HLO: where the gradient all-reduce sits -------------------------------


def test_plain_jit_all_reduces_the_gradients_on_every_micro_step(mesh):
    """The reference the other HLO tests improve on: optax under plain jit."""
    opt = optax.MultiSteps(optax.sgd(1.0), K)
    params = jax.device_put(_params(), P())
    state = opt.init(params)
    x, y, _ = _place(_micro_batches([16])[0])

    def step(params, state, x, y):
        return opt.update(jax.grad(_mean_loss)(params, x, y), state, params)

    ops = all_reduces(jax.jit(step).lower(params, state, x, y).compile())
    entry = [op for op in ops if op.place == "entry"]
    assert sum(op.nbytes for op in entry) >= PARAM_BYTES


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_one_fused_all_reduce_inside_the_emission_loop_and_none_outside(
    any_mesh, weighted
):
    opt = ga.MultiSteps(optax.adam(1e-3), K, unreduced_axes="data")
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    x, y, mask = _place(_micro_batches([16])[0])
    if weighted:
        compiled = jax.jit(_weighted_step(opt)).lower(params, state, x, y, mask)
    else:
        compiled = jax.jit(_unweighted_step(opt)).lower(params, state, x, y)
    ops = all_reduces(compiled.compile())
    # Nothing crosses devices on a micro-step that does not emit ...
    assert [op for op in ops if op.place != "while-body"] == []
    # ... and the emitting one reduces the window and its weight together.
    assert len(ops) == 1
    assert ops[0].operands == 3 + 1
    assert ops[0].nbytes == PARAM_BYTES + 4


def test_accumulate_in_a_chain_reduces_once_per_window_too(mesh):
    opt = optax.chain(ga.accumulate(optax.sgd(1.0), K, unreduced_axes=("data",)))
    ops = _weighted_step_all_reduces(opt)
    assert [(op.place, op.nbytes) for op in ops] == [("while-body", PARAM_BYTES + 4)]


# --- numbers ----------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["all-valid", "ragged"])
def test_weighted_windows_equal_the_big_batch_gradient(any_mesh, masked):
    opt = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data")
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    for window in range(2):
        batches = _micro_batches([16, 32, 8], masked=masked, seed=window)
        for i, batch in enumerate(batches):
            updates, state = step(params, state, *_place(batch))
            assert bool(opt.has_updated(state)) == (i == K - 1)
            # The window stays per device between jitted calls.
            assert _holds_terms(state.acc_grads["w1"], any_mesh, (16, 32))
            assert _holds_terms(state.acc_weight, any_mesh, ())
        assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6


def test_unweighted_equal_micro_batches_equal_the_big_batch_gradient(mesh):
    opt = ga.accumulate(optax.sgd(1.0), K, unreduced_axes="data")
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    grad_fn = ga.local_value_and_grad(_mean_loss, "data")

    @jax.jit
    def step(params, state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, state = opt.update(grads, state, params)
        return updates, state, loss  # one term per device

    batches = _micro_batches([16, 16, 16])
    for batch in batches:
        updates, state, loss = step(params, state, *_place(batch[:2]))
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6
    np.testing.assert_allclose(
        loss.sum(), _mean_loss(jax.device_get(params), *batches[-1][:2]), rtol=1e-6
    )


# A float32 window, and per-device ternary windows with every leaf below
# ``min_size``: each device's window is then an exact float32 sum, so the
# plumbing (per-device add, decode, one reduction) must give the big-batch
# gradient exactly.
WINDOWS = {
    "float32": lambda: ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data"),
    "per-device-ternary": lambda: _per_device_ternary(min_size=10**6),
}


# Pairwise: each window on one axis type. The window's storage and the
# placement of its terms on the mesh are separate parts; both windows run on
# both axis types in the other tests of this file.
@pytest.mark.parametrize(
    ("any_mesh", "window"),
    [(AxisType.Explicit, "per-device-ternary"), (AxisType.Auto, "float32")],
    ids=["explicit-per-device-ternary", "auto-float32"],
    indirect=["any_mesh"],
)
def test_flush_emits_the_partial_window_and_stats_reduce_its_weight(any_mesh, window):
    opt = WINDOWS[window]()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    batches = _micro_batches([16, 24], masked=True)
    for batch in batches:
        _, state = step(params, state, *_place(batch))
    assert not bool(opt.has_updated(state))
    stats = jax.jit(opt.stats)(state)
    assert int(stats.window_fill) == 2
    assert float(stats.window_weight) == sum(float(b[2].sum()) for b in batches)
    updates, state = jax.jit(opt.flush)(state, params)
    assert bool(opt.has_updated(state))
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6
    assert float(jax.jit(opt.stats)(state).window_weight) == 0.0


@pytest.mark.parametrize("build", WINDOWS.values(), ids=WINDOWS.keys())
def test_reset_drops_the_partial_window(mesh, build):
    opt = build()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    _, state = step(params, state, *_place(_micro_batches([16], True, seed=9)[0]))
    state = jax.jit(opt.reset)(state)
    assert int(jax.jit(opt.stats)(state).window_fill) == 0
    batches = _micro_batches([16, 32, 8], masked=True)
    for batch in batches:
        updates, state = step(params, state, *_place(batch))
    assert bool(opt.has_updated(state))
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6


def _assert_replicated_bitwise(updates):
    """Every device holds the whole of each leaf, bitwise the same."""
    for name, leaf in updates.items():
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == N_DEVICES
        assert all(s.shape == leaf.shape for s in shards), name
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0], err_msg=name)


def _run_window(step, state, batches):
    """Runs a jitted ``step`` over ``batches``; the last updates and state."""
    params = jax.device_put(_params(), P())
    for batch in batches:
        updates, state = step(params, state, *_place(batch))
    return updates, state


def test_a_non_finite_micro_batch_spoils_only_its_own_window(any_mesh):
    opt = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data")
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    spoiled = _micro_batches([16, 16, 16], masked=True, seed=1)
    spoiled[1][0][3] = np.nan
    updates, state = _run_window(step, state, spoiled)
    assert np.isnan(np.asarray(updates["w1"])).any()
    batches = _micro_batches([16, 32, 8], masked=True, seed=2)
    updates, state = _run_window(step, state, batches)
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6


# --- a device of padding only ----------------------------------------------


def _padded_mean_loss(params, x, y, mask):
    """The usual masked mean, ``sum / count``: 0 / 0 (NaN, NaN gradient
    too) on a device whose shard is all padding, of weight 0."""
    hidden = jnp.tanh(x @ params["w1"])
    if AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types:
        # Tensor parallelism's second matmul contracts over ``model`` on
        # both sides: on an Explicit mesh JAX asks for its output sharding.
        pred = jnp.matmul(hidden, params["w2"], out_sharding=P())
    else:
        pred = hidden @ params["w2"]
    errors = jnp.mean((pred + params["b"] - y) ** 2, axis=-1)
    count = jnp.sum(mask)
    return jnp.sum(mask * errors) / count, count


# Megatron's split of the test model over a 2-D mesh's ``model`` axis.
TENSOR_PARALLEL = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
PADDED_MESHES = {
    "1d-explicit": ((N_DEVICES,), ("data",), AxisType.Explicit),
    "1d-auto": ((N_DEVICES,), ("data",), AxisType.Auto),
    "2d-tp-explicit": ((4, 2), ("data", "model"), AxisType.Explicit),
    "2d-tp-auto": ((4, 2), ("data", "model"), AxisType.Auto),
}


@pytest.mark.parametrize(
    ("mesh_name", "reduction"),
    [
        *((name, "float") for name in PADDED_MESHES),
        # (A ternary window reduction of tensor-parallel leaves on an
        # Explicit 2-D mesh: tests/test_ternary_sharded.py.)
        ("1d-explicit", "ternary"),
        ("2d-tp-auto", "ternary"),
    ],
)
def test_a_device_of_padding_only_adds_nothing_to_the_window(mesh_name, reduction):
    """The end of an epoch: in the window's last micro-batch one device's
    shard is all padding, its weight 0 and its loss and gradient NaN. Its
    terms are zeros, so the window is the big-batch gradient of the valid
    examples (the loss too), exactly with the float reduction; the ternary
    codes are finite and its exactly summed leaf exact."""
    shape, axes, axis_type = PADDED_MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))
    kwargs = {}
    if reduction == "ternary":
        kwargs["window_reduction"] = ga.ternary_window_reduction(
            0, clip_sigma=None, min_size=TERNARY_MIN_SIZE
        )
    opt = ga.MultiSteps(
        optax.sgd(1.0), K, unreduced_axes="data", track_noise_scale=True, **kwargs
    )
    grad_fn = ga.local_value_and_grad(_padded_mean_loss, "data", has_weight=True)

    def step(params, state, x, y, mask):
        (loss, weight), grads = grad_fn(params, x, y, mask)
        updates, state = opt.update(grads, state, params, weight=weight)
        return updates, state, loss

    batches = _micro_batches([16, 16, 16], masked=True, seed=3)
    data_devices = shape[0]
    batches[-1][2][-16 // data_devices :] = 0.0  # the last device: padding only
    batches[-1][2][0] = 1.0  # every other device holds a valid example
    with jax.set_mesh(mesh):
        specs = TENSOR_PARALLEL if len(shape) == 2 else dict.fromkeys(_params(), P())
        params = {
            name: jax.device_put(leaf, jax.NamedSharding(mesh, specs[name]))
            for name, leaf in _params().items()
        }
        state = jax.jit(opt.init)(params)
        for batch in batches:
            updates, state, loss = jax.block_until_ready(
                jax.jit(step)(params, state, *_place(batch))
            )
        stats = jax.jit(opt.stats)(state)
        logged = float(np.sum(loss))  # one term per device, either mesh
    exact = _big_batch_grad(params, batches)
    x, y, mask = batches[-1]
    valid = mask.astype(bool)
    expected_loss = float(_mean_loss(jax.device_get(params), x[valid], y[valid]))
    np.testing.assert_allclose(logged / mask.sum(), expected_loss, rtol=1e-6)
    assert np.isfinite(float(stats.noise_scale))
    for name, leaf in updates.items():
        assert np.isfinite(np.asarray(leaf)).all(), name
    if reduction == "float":
        assert _max_error(updates, exact) < 1e-6
    else:
        np.testing.assert_allclose(-np.asarray(updates["b"]), exact["b"], atol=1e-6)


def test_the_window_drops_a_zero_weight_device_term_even_if_it_is_nan(any_mesh):
    """Per-device terms formed elsewhere (``w_d * g_d`` as a plain product):
    the window adds a device's term only where its weight is not 0."""
    opt = ga.MultiSteps(optax.sgd(1.0), 1, unreduced_axes="data")
    params = {"w": jnp.zeros(3)}
    weights = np.arange(1.0, N_DEVICES + 1).astype(np.float32)
    weights[-1] = 0.0
    terms = weights[:, None] * np.ones((N_DEVICES, 3), np.float32)
    terms[-1] = np.nan  # 0 * NaN: a device of padding only
    grads, weight = jax.device_put(({"w": terms}, weights), P("data"))
    if any_mesh.axis_types == (AxisType.Explicit,):
        grads, weight = ga._tree.stacked_as_unreduced((grads, weight), "data")
    updates, _ = jax.jit(opt.update)(
        grads, jax.jit(opt.init)(params), params, weight=weight
    )
    np.testing.assert_array_equal(updates["w"], -np.ones(3, np.float32))


# --- checkpoints ------------------------------------------------------------


def test_a_per_device_state_is_saved_through_reduce_window(any_mesh):
    opt = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data")
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    batches = _micro_batches([16, 32, 8], masked=True)
    _, state = step(params, state, *_place(batches[0]))
    # Saved as it is (ordinary arrays), restored replicated, it goes on too.
    raw = jax.device_put(jax.device_get(state), P())
    for batch in batches[1:]:
        raw_updates, raw = step(params, raw, *_place(batch))
    assert _holds_terms(raw.acc_grads["w1"], any_mesh, (16, 32))
    assert _max_error(raw_updates, _big_batch_grad(params, batches)) < 1e-6
    saved = jax.device_get(jax.jit(opt.reduce_window)(state))
    assert saved.acc_weight == batches[0][2].sum()
    assert saved.acc_grads["w1"].shape == (16, 32)
    # Restored (replicated) it goes on as if it had never left the devices.
    restored = jax.device_put(saved, P())
    for batch in batches[1:]:
        updates, restored = step(params, restored, *_place(batch))
    assert _holds_terms(restored.acc_grads["w1"], any_mesh, (16, 32))
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6


# --- the gradient noise scale: each device's micro-batch a small batch ------

NOISE_DECAY = 0.5


def _tracked(make="MultiSteps"):
    # Every micro-batch's norm: comparable with one device fed each
    # device's share apart (whose window samples other slots).
    return getattr(ga, make)(
        optax.sgd(1.0),
        K,
        unreduced_axes="data",
        track_noise_scale=True,
        noise_scale_decay=NOISE_DECAY,
        noise_scale_estimator="all",
    )


def _one_device_noise_stats(params, windows, weighted=True):
    """Every device's share of every micro-batch fed apart to one device.

    Weighted: each share weighs its number of valid examples. Unweighted:
    a micro-step weighs 1, so each of the devices' equal shares 1 / n.
    """
    opt = ga.MultiSteps(
        optax.sgd(1.0),
        K * N_DEVICES,
        track_noise_scale=True,
        noise_scale_decay=NOISE_DECAY,
        noise_scale_estimator="all",
    )
    grad_fn = jax.value_and_grad(_masked_loss, has_aux=True)

    @jax.jit
    def step(params, state, x, y, mask):
        (_, count), grads = grad_fn(params, x, y, mask)
        weight = count if weighted else 1.0 / N_DEVICES
        return opt.update(grads, state, params, weight=weight)[1]

    params = jax.device_get(params)
    state = opt.init(params)
    for batches in windows:
        for batch in batches:
            shares = (np.split(part, N_DEVICES) for part in batch)
            for x, y, mask in zip(*shares, strict=True):
                state = step(params, state, x, y, mask)
    return opt.stats(state)


def _assert_same_noise_stats(stats, expected):
    for name in ("grad_sq_norm", "noise_trace", "noise_scale"):
        actual, wanted = getattr(stats, name), getattr(expected, name)
        assert np.isfinite(wanted), name
        np.testing.assert_allclose(actual, wanted, rtol=1e-5, err_msg=name)


def test_tracked_noise_scale_adds_four_scalars_to_the_one_fused_all_reduce(any_mesh):
    opt = _tracked()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    args = _place(_micro_batches([16], masked=True)[0])
    step = jax.jit(_weighted_step(opt))
    ops = all_reduces(step.lower(params, state, *args).compile())
    # A non-emitting micro-step still moves nothing: each device adds its
    # own terms of A, k, V and n ...
    assert [op for op in ops if op.place != "while-body"] == []
    # ... which the emission reduces with the window and its weight.
    assert [(op.operands, op.nbytes) for op in ops] == [(3 + 1 + 4, PARAM_BYTES + 20)]
    _, state = step(params, state, *args)
    assert _holds_terms(state.statistics["noise_scale"].sq_norm_sum, any_mesh, ())
    assert _holds_terms(state.statistics["noise_scale"].micro_batches, any_mesh, ())


# Pairwise: MultiSteps and accumulate are built by the same `configure`
# into the same engine, so each meets one axis type.
@pytest.mark.parametrize(
    ("any_mesh", "make"),
    [(AxisType.Explicit, "MultiSteps"), (AxisType.Auto, "accumulate")],
    ids=["explicit-MultiSteps", "auto-accumulate"],
    indirect=["any_mesh"],
)
def test_noise_scale_of_device_micro_batches_equals_one_device_fed_them_apart(
    any_mesh, make
):
    opt = _tracked(make)
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    windows = [_micro_batches([16, 32, 8], masked=True, seed=seed) for seed in range(2)]
    # Ragged down to empty: some devices hold no valid example (weight 0,
    # a 0/0 loss), and they must count for nothing in A or k.
    empty = [part.sum() == 0 for batch in windows[0] for part in np.split(batch[2], 8)]
    assert 0 < sum(empty) < len(empty)
    for batches in windows:
        for batch in batches:
            _, state = step(params, state, *_place(batch))
            assert _holds_terms(
                state.statistics["noise_scale"].sq_norm_sum, any_mesh, ()
            )
    stats = jax.jit(opt.stats)(state)
    _assert_same_noise_stats(stats, _one_device_noise_stats(params, windows))


def test_unweighted_device_gradients_weigh_one_nth_of_a_micro_batch(any_mesh):
    opt = _tracked()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_unweighted_step(opt))
    windows = [_micro_batches([16, 16, 16], seed=seed) for seed in range(2)]
    for batches in windows:
        for batch in batches:
            _, state = step(params, state, *_place(batch[:2]))
    expected = _one_device_noise_stats(params, windows, weighted=False)
    _assert_same_noise_stats(jax.jit(opt.stats)(state), expected)


def test_a_tracked_per_device_state_is_saved_through_reduce_window(any_mesh):
    opt = _tracked()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    windows = [_micro_batches([16, 32, 8], masked=True, seed=seed) for seed in range(2)]
    for batch in windows[0] + windows[1][:1]:
        _, state = step(params, state, *_place(batch))
    saved = jax.device_get(jax.jit(opt.reduce_window)(state))
    # Mid-window: A and k of the second window's first micro-batch, summed.
    empty = sum(part.sum() == 0 for part in np.split(windows[1][0][2], N_DEVICES))
    assert saved.statistics["noise_scale"].micro_batches == N_DEVICES - empty
    assert saved.statistics["noise_scale"].sq_norm_sum.shape == ()
    restored = jax.device_put(saved, P())
    for batch in windows[1][1:]:
        _, restored = step(params, restored, *_place(batch))
    assert _holds_terms(restored.statistics["noise_scale"].sq_norm_sum, any_mesh, ())
    stats = jax.jit(opt.stats)(restored)
    _assert_same_noise_stats(stats, _one_device_noise_stats(params, windows))


# --- errors -----------------------------------------------------------------


def test_unreduced_gradients_need_an_unreduced_window(mesh):
    opt = ga.MultiSteps(optax.sgd(1.0), K)
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    grad_fn = ga.local_value_and_grad(_mean_loss, "data")

    def step(params, state, x, y):
        return opt.update(grad_fn(params, x, y)[1], state, params)

    x, y, _ = _place(_micro_batches([16], True)[0])
    with pytest.raises(ValueError, match=r"leaf \['b'\] is unreduced over mesh axes"):
        jax.jit(step)(params, state, x, y)
    # Its weights, one row per device, name the same fix.
    with pytest.raises(ValueError, match=r"one row per device .* unreduced_axes"):
        jax.jit(_weighted_step(opt))(
            params, state, *_place(_micro_batches([16], True)[0])
        )


@pytest.mark.parametrize(
    ("build", "with_params"),
    [
        (lambda: ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data"), True),
        (lambda: ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data"), False),
        (lambda: ga.ternary_accumulate(optax.sgd(1.0), K, unreduced_axes="data"), True),
        (
            lambda: ga.ternary_accumulate(optax.sgd(1.0), K, unreduced_axes="data"),
            False,
        ),
    ],
    ids=["MultiSteps", "MultiSteps-no-params", "ternary", "ternary-no-params"],
)
def test_jax_grad_gradients_for_a_window_of_terms_name_both_fixes(
    any_mesh, build, with_params
):
    # jax.grad's whole gradients for an accumulator built with
    # unreduced_axes: most likely the user wants local_value_and_grad, or
    # else no unreduced_axes; the error says both (on an Auto mesh it used
    # to compare the stacked terms' shape with "the params'").
    opt = build()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    x, y, _ = _place(_micro_batches([16])[0])

    def step(params, state, x, y):
        grads = jax.grad(_mean_loss)(params, x, y)  # all-reduced, whole
        return opt.update(grads, state, params if with_params else None)

    with pytest.raises(ValueError, match=r"Gradient leaf \['b'\]") as raised:
        jax.jit(step)(params, state, x, y)
    message = str(raised.value)
    assert "local_value_and_grad" in message
    assert "without unreduced_axes" in message
    if with_params or any_mesh.axis_types == (AxisType.Explicit,):
        assert "came whole (summed over the devices, as jax.grad returns it)" in message
        assert "local_value_and_grad(loss_fn, 'data')" in message
        assert "unreduced_axes=(), the default" in message


def test_unreduced_axes_and_a_skip_function_are_rejected():
    with pytest.raises(ValueError, match="`unreduced_axes` cannot be combined"):
        ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data", skip_nonfinite=True)


def test_local_gradients_on_a_1d_mesh_are_written_as_they_lie(any_mesh):
    """With no other mesh axis each device's gradient is traced on its own
    rows: every weight gradient's dot writes it in the param's layout, no
    transpose, no collective. (Traced in a vmap, the dots were batched and
    XLA:CPU wrote each weight gradient transposed, then copied it back: the
    gradient of bench_sharded.py's 4.2M-parameter MLP took 3x as long.)"""

    def loss(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

    params = {"w1": jnp.ones((64, 96)), "w2": jnp.ones((96, 32))}
    x, y = jnp.ones((16, 64)), jnp.ones((16, 32))
    compiled = (
        jax.jit(ga.local_value_and_grad(loss, "data")).lower(params, x, y).compile()
    )
    assert compiled.as_text().count(" transpose(") == 0
    assert ga.measure.collectives(compiled, any_mesh) == []


def test_local_value_and_grad_stacks_the_terms_on_an_auto_mesh():
    auto = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
    grad_fn = ga.local_value_and_grad(_masked_loss, "data", has_weight=True)
    x, y, mask = _micro_batches([16], masked=True)[0]
    with jax.set_mesh(auto):
        (loss, weight), grads = jax.jit(grad_fn)(_params(), x, y, mask)
    assert weight.shape == loss.shape == (N_DEVICES,)
    np.testing.assert_array_equal(weight, mask.reshape(N_DEVICES, -1).sum(1))
    assert grads["w1"].shape == (N_DEVICES, 16, 32)
    assert grads["w1"].sharding.spec == P("data")


# --- FSDP: a window sharded like the parameters ----------------------------


def test_fsdp_params_keep_a_sharded_window_reduced_every_micro_step():
    """The other choice: plain `MultiSteps` with parameters sharded over the
    data axis keeps its window sharded like them (1/n of the accumulator per
    device), at the price of a gradient reduction on every micro-step."""
    mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
    shard_rows = jax.sharding.NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        params = {
            "w1": jax.device_put(_params()["w1"], shard_rows),  # (16, 32)
            "w2": jax.device_put(_params()["w2"], shard_rows),  # (32, 4)
            "b": _params()["b"],
        }
        opt = ga.MultiSteps(optax.sgd(1.0), K)
        state = opt.init(params)

        @jax.jit
        def step(params, state, x, y, mask):
            grads = jax.grad(lambda p: _masked_loss(p, x, y, mask)[0])(params)
            return opt.update(grads, state, params, weight=jnp.sum(mask))

        batches = _micro_batches([16, 24, 8], masked=True)
        for batch in batches:
            updates, state = step(params, state, *_place(batch))
        compiled = step.lower(params, state, *_place(batches[0])).compile()

    for name in ("w1", "w2"):
        acc = state.acc_grads[name]
        assert acc.sharding.spec == P("data")
        assert acc.addressable_shards[0].data.shape[0] == acc.shape[0] // N_DEVICES
    # Every micro-step reduces the gradients outside the emission loop.
    every_call = [r for r in all_reduces(compiled) if r.place == "entry"]
    assert sum(r.nbytes for r in every_call) >= PARAM_BYTES // N_DEVICES
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6


def test_a_one_device_mesh_runs_the_same_code():
    """Code written for a mesh must also run on one device (a laptop, one
    GPU): there the single term is the sum, kept stacked."""
    mesh = jax.make_mesh(
        (1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1]
    )
    with jax.set_mesh(mesh):
        opt = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data")
        params = _params()
        state = opt.init(params)
        step = jax.jit(_weighted_step(opt))
        batches = _micro_batches([8, 12, 4], masked=True)
        for batch in batches:
            updates, state = step(params, state, *_place(batch))
    assert bool(opt.has_updated(state))
    assert _max_error(updates, _big_batch_grad(params, batches)) < 1e-6


# --- a ternary window reduction: codes on the wire at the emission ---------

# The test model's leaves are small: compress the two matrices (512 and 128
# elements), sum the bias (4) and the weight exactly.
TERNARY_MIN_SIZE = 16
# Packed codes (base 17, 7 per uint32 word, each leaf packed on its own),
# one pmax of the two scales, one psum of the bias and the weight.
CODE_BYTES = (-(-512 // 7) + -(-128 // 7)) * 4
SCALE_BYTES = 2 * 4
EXACT_BYTES = (4 + 1) * 4


def _ternary_opt(seed=0, clip_sigma=None):
    reduction = ga.ternary_window_reduction(
        seed, clip_sigma=clip_sigma, min_size=TERNARY_MIN_SIZE
    )
    return ga.MultiSteps(
        optax.sgd(1.0), K, unreduced_axes="data", window_reduction=reduction
    )


def test_ternary_window_reduction_sends_a_sixth_of_the_bytes_inside_the_loop(
    any_mesh,
):
    opt = _ternary_opt()
    ops = _weighted_step_all_reduces(opt)
    assert {op.place for op in ops} == {"while-body"}
    assert sorted(op.nbytes for op in ops) == [SCALE_BYTES, EXACT_BYTES, CODE_BYTES]
    float_window = PARAM_BYTES + 4
    # 372 + 8 + 20 = 400 bytes against 2580: 0.155 of the float32 all-reduce.
    assert max(op.nbytes for op in ops) <= 0.25 * float_window
    assert sum(op.nbytes for op in ops) <= 0.16 * float_window


def test_ternary_window_draws_its_random_bits_only_when_it_emits(any_mesh):
    """The element indices the rounding hashes depend on nothing the
    emission's loop carries; left so, XLA hoists them out of it, and every
    micro-step writes a uint32 array the size of each compressed leaf (a
    window took 1.37x longer at 4.2M params, bench_sharded.py)."""
    opt = _ternary_opt()
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    args = _place(_micro_batches([16], masked=True)[0])
    compiled = jax.jit(_weighted_step(opt)).lower(params, state, *args).compile()
    hoisted = [
        (line, size)
        for line, size in entry_arrays(compiled, "u32")
        if size >= TERNARY_MIN_SIZE
    ]
    assert hoisted == []


def test_a_tracked_ternary_window_sums_the_noise_scale_terms_exactly(mesh):
    opt = ga.MultiSteps(
        optax.sgd(1.0),
        K,
        unreduced_axes="data",
        window_reduction=ga.ternary_window_reduction(0, min_size=TERNARY_MIN_SIZE),
        track_noise_scale=True,
    )
    ops = _weighted_step_all_reduces(opt)
    assert {op.place for op in ops} == {"while-body"}
    params = jax.device_put(_params(), P())
    compiled = (
        jax.jit(_weighted_step(opt))
        .lower(
            params, jax.jit(opt.init)(params), *_place(_micro_batches([16], True)[0])
        )
        .compile()
    )
    found = ga.measure.collectives(compiled)
    # A, k, V and n: four more scalars in the exact psum, and a fifth: what
    # the codes add to the window's squared norm (summed after the codes are
    # drawn, XLA combines it with the exact psum); all in the emission.
    assert sorted(c.nbytes for c in found if c.trips == (None,)) == [
        SCALE_BYTES,
        EXACT_BYTES + 4 * 4 + 4,
        CODE_BYTES,
    ]
    # The scales' pmax again, in a loop inside the emission that runs only
    # where a scale came back +inf (a sum of squares that overflowed).
    rechecks = [(c.kind, c.nbytes) for c in found if c.trips == (None, None)]
    assert rechecks == [("all-reduce", SCALE_BYTES)]


def test_ternary_window_is_identical_on_every_device_and_per_seed(any_mesh):
    opt = _ternary_opt(seed=3, clip_sigma=2.5)
    params = jax.device_put(_params(), P())
    batches = _micro_batches([16, 32, 8], masked=True)
    step = jax.jit(_weighted_step(opt))
    updates, state = _run_window(step, jax.jit(opt.init)(params), batches)
    assert bool(opt.has_updated(state))
    # The PRNG counter (seed, windows reduced) is in the state, replicated,
    # and nothing else (no residual).
    np.testing.assert_array_equal(state.reduction_state.key, [3, 1])
    assert ga.measure.state_nbytes(state.reduction_state) == 8  # the key only
    _assert_replicated_bitwise(updates)
    # Ternary: each device sends codes in {-1, 0, 1} times one shared scale,
    # so a compressed leaf's sum takes at most 2n + 1 values.
    assert len(np.unique(np.asarray(updates["w1"]))) <= 2 * N_DEVICES + 1
    # The bias is summed exactly.
    exact = _big_batch_grad(params, batches)
    np.testing.assert_allclose(-np.asarray(updates["b"]), exact["b"], atol=1e-6)
    # Same seed, same draws; another seed (only the state differs, so the
    # same compiled step), other draws.
    again, _ = _run_window(step, jax.jit(opt.init)(params), batches)
    other = _ternary_opt(seed=4, clip_sigma=2.5)
    different, _ = _run_window(step, jax.jit(other.init)(params), batches)
    np.testing.assert_array_equal(again["w1"], updates["w1"])
    assert not np.array_equal(different["w1"], updates["w1"])


def _assert_unbiased_over_seeds(opt, seeded, seeds, shrink):
    """Runs one window of ``opt`` from ``seeded(state0, seed)`` per seed.

    Without clipping each element's mean over seeds must be within 6
    standard errors of the exact big-batch gradient, and averaging the
    seeds must shrink the error of one seed (the largest element's) by more
    than ``shrink``. One compiled step serves every seed: the seed is state.
    """
    params = jax.device_put(_params(), P())
    batches = _micro_batches([16, 32, 8], masked=True)
    exact = _big_batch_grad(params, batches)
    step = jax.jit(_weighted_step(opt))
    state0 = jax.jit(opt.init)(params)
    samples = {name: [] for name in exact}
    for seed in range(seeds):
        updates, _ = _run_window(step, seeded(state0, seed), batches)
        for name in exact:
            samples[name].append(-np.asarray(updates[name]))
    single_seed_error = np.abs(samples["w1"][0] - exact["w1"]).max()
    for name, draws in samples.items():
        draws = np.stack(draws)
        standard_error = draws.std(axis=0, ddof=1) / np.sqrt(seeds)
        error = np.abs(draws.mean(axis=0) - exact[name])
        assert (error <= 6 * standard_error + 1e-5).all(), name
    mean_error = np.abs(np.mean(samples["w1"], axis=0) - exact["w1"]).max()
    assert mean_error < single_seed_error / shrink


def test_ternary_window_is_unbiased_over_seeds(any_mesh):
    """The window reduction's seed is its state's counter: 96 seeds."""
    _assert_unbiased_over_seeds(
        _ternary_opt(clip_sigma=None),
        lambda state0, seed: state0._replace(
            reduction_state=state0.reduction_state._replace(
                key=jnp.array([seed, 0], jnp.uint32)
            )
        ),
        seeds=96,
        shrink=4,
    )


def test_ternary_window_state_checkpoints_and_draws_the_same_bits(mesh):
    opt = _ternary_opt(seed=5, clip_sigma=2.5)
    params = jax.device_put(_params(), P())
    step = jax.jit(_weighted_step(opt))
    first = _micro_batches([16, 32, 8], masked=True, seed=0)
    second = _micro_batches([16, 32, 8], masked=True, seed=1)
    _, state = _run_window(step, jax.jit(opt.init)(params), first)
    # Saved at a window boundary: the counter is all the reduction keeps.
    saved = jax.device_get(jax.jit(opt.reduce_window)(state))
    np.testing.assert_array_equal(saved.reduction_state.key, [5, 1])
    restored = jax.device_put(saved, P())
    for batch in second:
        expected, state = step(params, state, *_place(batch))
        updates, restored = step(params, restored, *_place(batch))
    for name in expected:
        np.testing.assert_array_equal(updates[name], expected[name], err_msg=name)
    np.testing.assert_array_equal(restored.reduction_state.key, [5, 2])


# --- a ternary window per device: ternary_accumulate(unreduced_axes=) ------


def _per_device_ternary(seed=0, clip_sigma=None, min_size=TERNARY_MIN_SIZE):
    return ga.ternary_accumulate(
        optax.sgd(1.0),
        K,
        seed=seed,
        clip_sigma=clip_sigma,
        min_size=min_size,
        unreduced_axes="data",
    )


def test_per_device_ternary_windows_reduce_once_inside_the_emission_loop(any_mesh):
    opt = _per_device_ternary()
    ops = _weighted_step_all_reduces(opt)
    # No collective on a micro-step; at the emission the decoded float32
    # sums of the three leaves and the weight, in one fused all-reduce.
    assert [(op.place, op.operands, op.nbytes) for op in ops] == [
        ("while-body", 3 + 1, PARAM_BYTES + 4)
    ]


def test_per_device_ternary_state_is_int8_codes_stacked_per_device(any_mesh):
    opt = _per_device_ternary()
    params = jax.device_put(_params(), P())
    step = jax.jit(_weighted_step(opt))
    state = jax.jit(opt.init)(params)
    batch = _micro_batches([16], masked=True)[0]
    _, state = step(params, state, *_place(batch))
    window = state.acc_grads.local
    assert isinstance(window, ga.extend.TernaryAccumulatorState)
    for name, shape in (("w1", (16, 32)), ("w2", (32, 4))):
        codes = window.code_sums[name]
        assert (codes.dtype, codes.shape) == (jnp.int8, (N_DEVICES, *shape))
        assert codes.sharding.spec[0] == "data"
        assert codes.addressable_shards[0].data.shape == (1, *shape)
        assert window.scales[name].shape == (N_DEVICES,)
    # The bias (4 < min_size) accumulates exactly, in float32, per device.
    assert window.code_sums["b"].dtype == jnp.float32
    # Each device draws its own bits: its own seed word, and a counter of
    # the micro-steps it added (a device without valid examples adds none).
    keys = np.asarray(window.key)
    assert len(set(keys[:, 0].tolist())) == N_DEVICES
    has_examples = batch[2].reshape(N_DEVICES, -1).sum(1) > 0
    assert not has_examples.all()
    np.testing.assert_array_equal(keys[:, 1], has_examples)
    # 1 byte per compressed parameter per device, plain arrays: fetchable.
    codes_bytes = ga.measure.state_nbytes(window.code_sums) - 4 * 4 * N_DEVICES
    assert codes_bytes == (16 * 32 + 32 * 4) * N_DEVICES
    jax.device_get(state.acc_grads)


def test_per_device_ternary_update_is_identical_on_every_device(any_mesh):
    opt = _per_device_ternary(seed=3, clip_sigma=2.5)
    params = jax.device_put(_params(), P())
    step = jax.jit(_weighted_step(opt))
    batches = _micro_batches([16, 32, 8], masked=True)
    updates, state = _run_window(step, jax.jit(opt.init)(params), batches)
    assert bool(opt.has_updated(state))
    _assert_replicated_bitwise(updates)
    exact = _big_batch_grad(params, batches)
    np.testing.assert_allclose(-np.asarray(updates["b"]), exact["b"], atol=1e-6)
    assert not np.allclose(-np.asarray(updates["w1"]), exact["w1"], atol=1e-3)


def test_per_device_ternary_window_is_unbiased_over_seeds(any_mesh):
    """The seed is in each device's window key: 32 seeds."""
    params = jax.device_put(_params(), P())

    def seeded(state0, seed):
        init = _per_device_ternary(seed=seed, clip_sigma=None).init
        return state0._replace(acc_grads=jax.jit(init)(params).acc_grads)

    _assert_unbiased_over_seeds(
        _per_device_ternary(clip_sigma=None), seeded, seeds=32, shrink=3
    )


def test_per_device_ternary_state_checkpoints_and_draws_the_same_bits(any_mesh):
    """The windows are plain arrays; only the weight needs `reduce_window`.
    Restored mid-window with the same shardings, the run goes on bitwise."""
    opt = _per_device_ternary(seed=5, clip_sigma=2.5)
    params = jax.device_put(_params(), P())
    step = jax.jit(_weighted_step(opt))
    batches = _micro_batches([16, 32, 8], masked=True)
    _, state = step(params, jax.jit(opt.init)(params), *_place(batches[0]))
    reduced = jax.jit(opt.reduce_window)(state)
    saved = jax.device_get(reduced)
    assert saved.acc_weight == batches[0][2].sum()
    assert saved.acc_grads.local.code_sums["w1"].dtype == np.int8
    restored = jax.device_put(saved, jax.tree.map(lambda a: a.sharding, reduced))
    for batch in batches[1:]:
        expected, state = step(params, state, *_place(batch))
        updates, restored = step(params, restored, *_place(batch))
    assert bool(opt.has_updated(restored))
    for name in expected:
        np.testing.assert_array_equal(updates[name], expected[name], err_msg=name)


def test_per_device_ternary_state_restored_from_host_arrays_goes_on_bitwise(any_mesh):
    """Restored without shardings (``jax.device_get``, a checkpointer given
    no sharding), the int8 windows, their keys and scales arrive as host
    arrays (eagerly) or replicated (under jit): the window's functions split
    them over the data axis themselves, and the run goes on bitwise with the
    same shardings as one restored with them."""
    opt = _per_device_ternary(seed=5, clip_sigma=2.5)
    params = jax.device_put(_params(), P())
    step = jax.jit(_weighted_step(opt))
    batches = _micro_batches([16, 32, 8], masked=True)
    _, state = step(params, jax.jit(opt.init)(params), *_place(batches[0]))
    reduced = jax.jit(opt.reduce_window)(state)
    saved = jax.device_get(reduced)
    placed = jax.device_put(saved, jax.tree.map(lambda a: a.sharding, reduced))
    runs = {}
    for name, restored in (("placed", placed), ("host", saved)):
        for batch in batches[1:]:
            updates, restored = step(params, restored, *_place(batch))
        runs[name] = updates, restored.acc_grads.local
    (updates, window), (expected, expected_window) = runs["host"], runs["placed"]
    # Eagerly the host arrays are NumPy arrays: split there too.
    eager_reset = opt.reset(saved).acc_grads.local
    expected_reset = jax.jit(opt.reset)(placed).acc_grads.local
    for have, want in zip(
        jax.tree.leaves((updates, window, eager_reset)),
        jax.tree.leaves((expected, expected_window, expected_reset)),
        strict=True,
    ):
        np.testing.assert_array_equal(have, want)
        assert have.sharding.is_equivalent_to(want.sharding, have.ndim)


def test_per_device_windows_track_the_noise_scale(any_mesh):
    """Per-device windows (a float window per device, decoded then reduced
    like a ternary one; `ternary_accumulate` refuses the noise scale) give
    the noise scale of each device's micro-batches fed apart to one device:
    A and k are reduced with the decoded sums, the window's norm is taken
    after that one reduction."""
    opt = ga.MultiSteps(
        optax.sgd(1.0),
        K,
        window_accumulator=ga.extend.float_accumulator(jnp.float32),
        unreduced_axes="data",
        track_noise_scale=True,
        noise_scale_decay=NOISE_DECAY,
        noise_scale_estimator="all",
    )
    params = jax.device_put(_params(), P())
    state = jax.jit(opt.init)(params)
    step = jax.jit(_weighted_step(opt))
    windows = [_micro_batches([16, 32, 8], masked=True, seed=seed) for seed in range(2)]
    for batches in windows:
        for batch in batches:
            _, state = step(params, state, *_place(batch))
    stats = jax.jit(opt.stats)(state)
    _assert_same_noise_stats(stats, _one_device_noise_stats(params, windows))


@pytest.mark.parametrize(
    ("shape", "axis_type"),
    [
        ((N_DEVICES,), AxisType.Explicit),
        ((N_DEVICES,), AxisType.Auto),
        ((N_DEVICES // 2, 2), AxisType.Explicit),
    ],
    ids=["1d-explicit", "1d-auto", "2d-explicit"],
)
def test_stats_and_reduce_window_work_outside_set_mesh(shape, axis_type):
    """A host-side look at a state of per-device terms finds the arrays' mesh."""
    axes = ("data", "model")[: len(shape)]
    mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(shape))
    opt = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data")
    batch = _micro_batches([16], masked=True)[0]
    with jax.set_mesh(mesh):
        params = jax.device_put(_params(), P())
        state = jax.jit(opt.init)(params)
        _, state = jax.jit(_weighted_step(opt))(params, state, *_place(batch))
        inside = opt.stats(state)
    outside = opt.stats(state)  # no mesh set here
    assert float(outside.window_weight) == float(inside.window_weight) == batch[2].sum()
    reduced = opt.reduce_window(state)
    assert float(reduced.acc_weight) == batch[2].sum()
    assert jax.tree.structure(reduced) == jax.tree.structure(state)


def test_all_reduces_leaves_out_groups_of_one_device():
    """A one-device mesh axis keeps its all-reduces in the HLO; none moves data."""
    one_device = jax.make_mesh(
        (1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1]
    )
    # (The data-parallel paths emit none there any more: a psum over it.)
    device_sum = jax.shard_map(
        lambda x: jax.lax.psum(x, "data"), in_specs=P("data"), out_specs=P()
    )
    with jax.set_mesh(one_device):
        x = jax.device_put(jnp.ones((8, 16)), P("data"))
        compiled = jax.jit(device_sum).lower(x).compile()
    assert "all-reduce(" in compiled.as_text()
    assert all_reduces(compiled) == []
    assert ga.measure.all_reduce_nbytes(compiled) == 0


# --- inputs restored from host arrays onto a 2-D mesh -----------------------

# Tensor-parallel params (by columns) on a data x model mesh.
TP_SPECS = {"w": P(None, "model"), "b": P("model")}


def _tp_mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh(
        (N_DEVICES // 2, 2), ("data", "model"), axis_types=(axis_type,) * 2
    )


def _tp_params():
    rs = np.random.RandomState(3)
    return {
        "w": (rs.randn(16, 8) * 0.3).astype(np.float32),
        "b": (rs.randn(8) * 0.1).astype(np.float32),
    }


def _tp_loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def _tp_batch(seed):
    rs = np.random.RandomState(seed)
    return rs.randn(16, 16).astype(np.float32), rs.randn(16, 8).astype(np.float32)


def _collectives(compiled) -> list[str]:
    """The collective ops of a compiled program, by kind."""
    kinds = r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
    return sorted(re.findall(rf"= \S+ ({kinds})(?:-start)?\(", compiled.as_text()))


@pytest.mark.parametrize("compile_fn", [_eager, jax.jit], ids=["eager", "jit"])
@pytest.mark.parametrize("layout", ["1d", "2d-tp"])
def test_local_value_and_grad_splits_a_host_batch_itself(layout, compile_fn):
    """A batch (and 1-D params) as host arrays, as restored without
    shardings: split over the data axis here, no collective added, and the
    terms are those of the placed batch, bitwise and with their types."""
    if layout == "1d":
        mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
        specs = {"w": P(), "b": P()}
    else:
        mesh, specs = _tp_mesh(), TP_SPECS
    grad_fn = ga.local_value_and_grad(_tp_loss, "data")
    host_params, (x, y) = _tp_params(), _tp_batch(0)
    with jax.set_mesh(mesh):
        params = jax.tree.map(jax.device_put, host_params, specs)
        placed = jax.tree.map(lambda a: jax.device_put(a, P("data")), (x, y))
        # Eager shard_map runs op by op (no fusion): compared with itself.
        expected = compile_fn(grad_fn)(params, *placed)
        # Params stay placed on the 2-D mesh: their model split is theirs.
        from_host = host_params if layout == "1d" else params
        got = compile_fn(grad_fn)(from_host, x, y)
        reduce = jax.jit(ga._tree.reduce_unreduced)
        for (path, have), want in zip(
            jax.tree_util.tree_flatten_with_path(got)[0],
            jax.tree.leaves(expected),
            strict=True,
        ):
            assert jax.typeof(have) == jax.typeof(want), path
            np.testing.assert_array_equal(reduce(have), reduce(want))
        host_program = jax.jit(grad_fn).lower(from_host, x, y).compile()
        placed_program = jax.jit(grad_fn).lower(params, *placed).compile()
    assert _collectives(host_program) == _collectives(placed_program)


def test_a_float_window_restored_from_host_arrays_keeps_the_params_split():
    """On a data x model mesh with tensor-parallel params, a window saved
    through `reduce_window` and restored without shardings has lost its
    model split: `update` places it like the gradients and goes on bitwise,
    noise-scale terms and Adam's state included."""
    opt = ga.MultiSteps(
        optax.adam(0.1), K, unreduced_axes="data", track_noise_scale=True
    )
    grad_fn = ga.local_value_and_grad(_tp_loss, "data")

    def step(params, state, x, y):
        return opt.update(grad_fn(params, x, y)[1], state, params)

    with jax.set_mesh(_tp_mesh()):
        params = jax.tree.map(jax.device_put, _tp_params(), TP_SPECS)
        batches = [
            jax.tree.map(lambda a: jax.device_put(a, P("data")), _tp_batch(seed))
            for seed in range(3)
        ]
        step = jax.jit(step)
        _, state = step(params, jax.jit(opt.init)(params), *batches[0])
        reduced = jax.jit(opt.reduce_window)(state)
        saved = jax.device_get(reduced)
        runs = {}
        for name, restored in (
            (
                "placed",
                jax.device_put(saved, jax.tree.map(lambda a: a.sharding, reduced)),
            ),
            ("host", saved),
        ):
            for batch in batches[1:]:
                updates, restored = step(params, restored, *batch)
            runs[name] = (updates, jax.jit(opt.reduce_window)(restored))
    (updates, state), (expected, expected_state) = runs["host"], runs["placed"]
    assert bool(opt.has_updated(state))
    for have, want in zip(
        jax.tree.leaves((updates, state)),
        jax.tree.leaves((expected, expected_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(have, want)
        assert have.sharding.is_equivalent_to(want.sharding, have.ndim)
    assert updates["w"].sharding.spec == P(None, "model")


@pytest.mark.parametrize("compile_fn", [_eager, jax.jit], ids=["eager", "jit"])
def test_local_value_and_grad_gives_0d_arguments_to_every_device(any_mesh, compile_fn):
    """A dropout key (typed) and a Python number reach every device whole,
    as jax.value_and_grad would see them on one device; a raw uint32 key,
    whose 2 rows cannot be split over 8 devices, is refused by name."""

    def loss_fn(params, x, y, key, scale):
        noise = jax.random.uniform(key, (x.shape[0],))
        return scale * jnp.mean(_errors(params, x, y) * noise)

    grad_fn = ga.local_value_and_grad(loss_fn, "data")
    params = jax.device_put(_params(), P())
    x, y, _ = _micro_batches([16])[0]
    key = jax.random.key(4)
    loss, grads = compile_fn(grad_fn)(params, x, y, key, 2.0)
    total = jax.jit(
        lambda tree: ga._partials.terms_layout(frozenset({"data"})).reduce(tree)
    )
    loss, grads = np.sum(loss), total(grads)  # the loss: one row per device
    rows = np.split(np.arange(16), N_DEVICES)
    terms = [
        jax.value_and_grad(loss_fn)(jax.device_get(params), x[r], y[r], key, 2.0)
        for r in rows
    ]
    want_loss = sum(t[0] for t in terms) / N_DEVICES
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for name in grads:
        want = sum(np.asarray(t[1][name]) for t in terms) / N_DEVICES
        np.testing.assert_allclose(grads[name], want, rtol=1e-5, atol=1e-7)
    with pytest.raises(
        ValueError, match=r"local_value_and_grad: argument 3 has shape \(2,\)"
    ):
        compile_fn(grad_fn)(params, x, y, jax.random.PRNGKey(4), 2.0)


@pytest.mark.parametrize(
    ("made", "used", "differ"),
    [
        (None, ga.ternary_window_reduction(0), r"missing \['.key'\], unexpected none"),
        (ga.ternary_window_reduction(0), None, r"missing none, unexpected \['.key'\]"),
    ],
    ids=["float-state-to-ternary", "ternary-state-to-float"],
)
def test_a_state_made_with_another_window_reduction_is_refused(
    any_mesh, made, used, differ
):
    """On both axis types: the reduction state another window_reduction made
    (restored from a run that reduced its windows otherwise) is named, not
    failed on deep inside (an AttributeError) or carried along unused."""

    def window(reduction):
        return ga.MultiSteps(
            optax.sgd(1.0), K, unreduced_axes="data", window_reduction=reduction
        )

    params = jax.device_put(_params(), P())
    state = jax.jit(window(made).init)(params)
    with pytest.raises(
        ValueError,
        match=r"MultiSteps.update: the state's reduction_state does not have the "
        rf"leaves this transformation's init makes for these params \({differ}\): "
        r"it was made with another window_reduction",
    ):
        jax.jit(_weighted_step(window(used)))(
            params, state, *_place(_micro_batches([16], masked=True)[0])
        )


WINDOW_REDUCTIONS = {
    "float32": {},
    "ternary": {"window_reduction": ga.ternary_window_reduction(0)},
    "topk": {"window_reduction": ga.compressed_window_reduction(ga.codecs.topk(0.1))},
    "e2m1": {
        "window_reduction": ga.compressed_window_reduction(
            ga.codecs.quantized(bits=4, min_size=16)
        )
    },
    "powersgd": {
        "window_reduction": ga.compressed_window_reduction(
            ga.codecs.powersgd(2, min_size=16)
        )
    },
}


@pytest.mark.parametrize("kwargs", WINDOW_REDUCTIONS.values(), ids=WINDOW_REDUCTIONS)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_donated_step_compiles_once(axis_type, kwargs):
    """The state ``init`` makes is placed as the step returns it: the second
    and third calls of a donated jitted step reuse the first's program (the
    codecs' random counter was written P() by init and P(None,) by the
    step; on Auto axes the per-device window P("data", None, None) against
    the compiler's P("data"))."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    opt = ga.MultiSteps(optax.adam(1e-2), 2, unreduced_axes="data", **kwargs)

    def loss(params, x):
        # No contraction over `model`, which Explicit axes would ask to
        # place by hand.
        hidden = jnp.mean(jnp.tanh(x @ params["w1"]) ** 2)
        bias = jnp.mean((x[:, :4] + params["b"]) ** 2)
        return hidden + bias + 1e-3 * jnp.sum(params["w2"] ** 2)

    def step(params, state, x):
        grads = ga.local_value_and_grad(loss, "data")(params, x)[1]
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        # Made by a jitted function, as a step makes them (jit's
        # `out_shardings` would write b's P() as given, the step P(None)),
        # w1 and w2 split over `model` (tensor parallel).
        specs = {"w1": P(None, "model"), "w2": P("model"), "b": P()}
        place = reshard if axis_type == AxisType.Explicit else None
        place = place or jax.lax.with_sharding_constraint
        params = jax.jit(lambda: jax.tree.map(place, _params(), specs))()
        state = opt.init(params)
        train_step = jax.jit(step, donate_argnums=(0, 1))
        x = jax.device_put(jnp.ones((16, 16)), P("data"))
        for _ in range(3):
            params, state = jax.block_until_ready(train_step(params, state, x))
    assert train_step._cache_size() == 1
    assert int(state.gradient_step) == 1


MESHES_1D_2D = {
    "1d-explicit": ((8,), ("data",), AxisType.Explicit),
    "1d-auto": ((8,), ("data",), AxisType.Auto),
    "2d-explicit": ((4, 2), ("data", "model"), AxisType.Explicit),
    "2d-auto": ((4, 2), ("data", "model"), AxisType.Auto),
}


@pytest.mark.parametrize("layout", sorted(MESHES_1D_2D))
def test_local_value_and_grad_returns_each_devices_aux(layout):
    """``has_aux``: the aux stacked per device (an ordinary array split over
    ``data``, row d device d's); loss, weight and grads are those without it."""
    shape, names, axis_type = MESHES_1D_2D[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))

    def with_aux(params, x, y, mask):
        (loss, count) = _masked_loss(params, x, y, mask)
        errors = _errors(params, x, y)
        return (loss, count), {"max_error": jnp.max(errors), "rows": x.shape[0]}

    x, y, mask = _micro_batches([16], masked=True)[0]
    with jax.set_mesh(mesh):
        params = jax.device_put(_params(), P())
        args = _place((x, y, mask))
        total = ga._partials.terms_layout(frozenset({"data"})).reduce
        plain_fn = ga.local_value_and_grad(_masked_loss, has_weight=True)
        aux_fn = ga.local_value_and_grad(with_aux, has_weight=True, has_aux=True)

        @jax.jit
        def summed(params, *args):  # the gradients summed; the rows as they are
            value, grads = plain_fn(params, *args)
            (aux_value, aux), aux_grads = aux_fn(params, *args)
            return (value, total(grads)), (aux_value, total(aux_grads)), aux

        (value, grads), (aux_value, aux_grads), aux = summed(params, *args)
        assert value[0].shape == value[1].shape == (mesh.shape["data"],)
        n = mesh.shape["data"]
        assert aux["max_error"].shape == (n,) and aux["rows"].shape == (n,)
        assert not ga._tree.unreduced_axes(aux["max_error"])
        if axis_type == AxisType.Explicit:
            assert aux["max_error"].sharding.spec == P("data")
    rows = np.split(np.arange(16), n)
    want = [float(jnp.max(_errors(_params(), x[r], y[r]))) for r in rows]
    np.testing.assert_allclose(aux["max_error"], want, rtol=1e-6)
    np.testing.assert_array_equal(aux["rows"], [16 // n] * n)
    for got, expected in zip(
        jax.tree.leaves(jax.device_get((aux_value, aux_grads))),
        jax.tree.leaves(jax.device_get((value, grads))),
        strict=True,
    ):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("layout", sorted(MESHES_1D_2D))
def test_none_batch_arguments_reach_the_loss_as_none(layout):
    """An absent batch field (``batch.get("inputs_position")``), as an
    argument or inside a dict, passes through every ``*_value_and_grad``."""
    shape, names, axis_type = MESHES_1D_2D[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))

    def loss_fn(params, x, y, positions, extras):
        assert positions is None and extras["segmentation"] is None
        return _mean_loss(params, x, y)

    x, y, _ = _micro_batches([16])[0]
    extras = {"segmentation": None}
    with jax.set_mesh(mesh):
        params = jax.device_put(_params(), P())
        args = (*_place((x, y)), None, extras)
        local = jax.jit(ga.local_value_and_grad(loss_fn))(params, *args)
        micro = jax.jit(
            ga.microbatched_value_and_grad(loss_fn, 2, batch_argnums=(1, 2, 3, 4))
        )(params, *args)
        micro_data = jax.jit(
            ga.microbatched_value_and_grad(
                loss_fn, 2, batch_argnums=(1, 2, 3, 4), data_axis="data"
            )
        )(params, *args)
        workers = ga.stack_workers(params, "data")
        worker = jax.jit(ga.worker_value_and_grad(loss_fn, "data"))(workers, *args)
        local_total = (
            np.sum(local[0]),  # one row per device
            jax.jit(ga._partials.terms_layout(frozenset({"data"})).reduce)(local[1]),
        )
    want_loss, want_grads = jax.value_and_grad(_mean_loss)(_params(), x, y)
    for loss, grads in (local_total, micro, micro_data):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for name in want_grads:
            np.testing.assert_allclose(
                grads[name], want_grads[name], rtol=1e-4, atol=1e-6
            )
    assert worker[0].shape == (mesh.shape["data"],)


@pytest.mark.parametrize(
    ("reduction", "dtype", "bound"),
    [
        (None, jnp.float32, -0.9),
        (None, jnp.bfloat16, -0.45),
        ("ternary", jnp.float32, -0.45),
        ("ternary", jnp.bfloat16, 0.3),
        ("topk", jnp.float32, -0.3),
        ("topk", jnp.bfloat16, 1.2),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_a_window_of_terms_holds_its_updates_in_its_own_buffers(
    reduction, dtype, bound
):
    """Compiled on `data` 4 x `model` 2, tensor-parallel params of 8 MiB a
    device (a "share"), adam, donated: the temporaries of a window reduced
    once, less those of the plain step that all-reduces every micro-batch,
    are at most ``bound`` shares. A float32 model's window terms hold its
    updates: measured 1.0 share under the plain step (0.49 with a ternary
    window, 0.36 with top-k); with the update slots carried beside the
    terms it was 0.0 (0.0, 0.63 over). A bfloat16 model's float32 terms
    cannot hold its bfloat16 updates: 0.5 under (0.26 over with ternary,
    1.13 over with top-k, its decoded sums and input), as before."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    shapes = {"w1": (1024, 2048), "w2": (2048, 1024)}
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    batch = jax.ShapeDtypeStruct((8, 1024), dtype, sharding=P("data"))

    def loss(params, x):
        hidden = x @ params["w1"]  # split over `model` by columns
        rows = jax.typeof(x).sharding.spec[0]  # `data` here, not per device
        out = jnp.matmul(hidden, params["w2"], out_sharding=P(rows, None))
        return jnp.mean(out.astype(jnp.float32) ** 2)

    window = {
        None: None,
        "ternary": ga.ternary_window_reduction(0),
        "topk": ga.compressed_window_reduction(ga.codecs.topk(0.01)),
    }[reduction]

    def temporaries(tx, grad_fn):
        def step(params, state, x):
            updates, state = tx.update(grad_fn(params, x), state, params)
            return optax.apply_updates(params, updates), state

        with jax.set_mesh(mesh):
            params = {
                name: jax.ShapeDtypeStruct(shape, dtype, sharding=specs[name])
                for name, shape in shapes.items()
            }
            state = jax.eval_shape(tx.init, params)
            step = jax.jit(step, donate_argnums=(0, 1))
            compiled = step.lower(params, state, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain = temporaries(ga.MultiSteps(optax.adam(1e-3), 4), jax.grad(loss))
    local = ga.local_value_and_grad(loss, "data")
    once = temporaries(
        ga.MultiSteps(
            optax.adam(1e-3), 4, unreduced_axes="data", window_reduction=window
        ),
        lambda params, x: local(params, x)[1],
    )
    share = 4 * sum(np.prod(shape) for shape in shapes.values()) // 2
    assert once - plain <= bound * share, (once, plain, share)
