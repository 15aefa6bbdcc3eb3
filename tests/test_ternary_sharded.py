"""Ternary compression of sharded parameters (explicit sharding).

FSDP (``P("data", None)``) and tensor-parallel (``P(None, "model")``)
leaves must give what the same computation gives on one device with the
same seed: the random bits hash each element's global index, not its place
in a shard. Reductions over a sharded leaf add in another order, so scales
may differ in their last bit; codes are compared exactly, values to float32
rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._codecs._ternary_kernels import scale_and_bound
from gradaccum_jax._compression import _random
from helpers import init_as_users_do, moved_arrays

# (mesh shape, mesh axes, the weight's spec, the bias's spec, dtype)
LAYOUTS = {
    "fsdp": ((8,), ("data",), P("data", None), P("data"), jnp.float32),
    "fsdp-2d": ((4, 2), ("data", "model"), P("data", None), P("data"), jnp.float32),
    "tensor-parallel": (
        (4, 2),
        ("data", "model"),
        P(None, "model"),
        P(None),
        jnp.float32,
    ),
    "fsdp-bfloat16": ((8,), ("data",), P("data", None), P("data"), jnp.bfloat16),
    # Megatron's second layer: split by rows.
    "tensor-parallel-rows": (
        (4, 2),
        ("data", "model"),
        P("model", None),
        P(None),
        jnp.float32,
    ),
}


def _mesh(shape, names, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def _tree(seed, dtype):
    """A compressed weight and a bias below ``min_size`` (kept exact)."""
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((16, 32)), dtype),
        "b": jnp.asarray(rng.standard_normal(8), dtype),
    }


def _transforms():
    return {
        "ternarize": ga.ternarize(3),
        "accumulate": ga.ternary_accumulate(optax.sgd(1.0), 2, seed=3),
    }


def _run(tx, place, dtype):
    """Two updates; what each returned, and the state after the first."""
    params = place(_tree(0, dtype))
    update = jax.jit(tx.update)
    first, state = update(place(_tree(1, dtype)), tx.init(params), params)
    second, _ = update(place(_tree(2, dtype)), state, params)
    return (first, second), state


@functools.cache
def _unsharded(dtype):
    return {
        name: _run(tx, lambda tree: tree, dtype) for name, tx in _transforms().items()
    }


def _specs(tree):
    """Each leaf's partitions, one per dimension (``P()`` is ``P(None)``)."""

    def padded(leaf):
        spec = tuple(leaf.sharding.spec)
        return P(*spec, *[None] * (leaf.ndim - len(spec)))

    return jax.tree.map(padded, tree)


def _assert_same_values(actual, expected):
    """The same signs (codes), the same values up to the scales' rounding.

    A clipping residual ``x - bound`` is off by the bound's error: a few
    float32 ulps of ~2.5 (2.4e-7 each) for these unit-variance leaves.
    """
    for leaf, wanted in zip(
        jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
    ):
        leaf, wanted = np.asarray(leaf, np.float32), np.asarray(wanted, np.float32)
        np.testing.assert_array_equal(np.sign(leaf), np.sign(wanted))
        np.testing.assert_allclose(leaf, wanted, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_params_give_the_unsharded_result_sharded_alike(layout):
    mesh_shape, names, w_spec, b_spec, dtype = LAYOUTS[layout]
    specs = {"w": w_spec, "b": b_spec}
    expected = _unsharded(dtype)
    with jax.set_mesh(_mesh(mesh_shape, names)):
        place = functools.partial(jax.device_put, device=specs)
        for name, tx in _transforms().items():
            updates, state = _run(tx, place, dtype)
            want_updates, want_state = expected[name]
            for got, want in zip(updates, want_updates, strict=True):
                assert _specs(got) == specs, name
                assert jax.tree.map(jnp.result_type, got) == {"w": dtype, "b": dtype}
                _assert_same_values(got, want)
            if name == "ternarize":
                assert _specs(state.residual["w"]) == w_spec
                _assert_same_values(state.residual, want_state.residual)
            else:
                window = state.acc_grads
                assert _specs(window.code_sums) == specs
                np.testing.assert_array_equal(
                    window.code_sums["w"], want_state.acc_grads.code_sums["w"]
                )
                _assert_same_values(window, want_state.acc_grads)


def test_random_bits_are_sharded_like_the_leaf_and_do_not_depend_on_it():
    stream = _random.stream(_random.seed_state(7), 2)
    leaf = jnp.zeros((16, 32))
    expected = np.asarray(_random.bits(stream, leaf))
    specs = (P("data", None), P(None, "model"), P("data", "model"), P(None, "data"))
    with jax.set_mesh(_mesh((4, 2), ("data", "model"))):
        leaves = [jax.device_put(leaf, spec) for spec in specs]
        bits = jax.jit(lambda leaves: [_random.bits(stream, x) for x in leaves])(leaves)
    for spec, sharded in zip(specs, bits, strict=True):
        assert sharded.sharding.spec == spec
        np.testing.assert_array_equal(sharded, expected, err_msg=str(spec))


def test_a_devices_block_draws_the_bits_and_scale_of_the_whole_leaf():
    """Inside a shard_map manual over the axes that split a leaf, a device
    sees its block only: told the split, it draws its elements' bits of the
    whole leaf and takes the whole leaf's scale."""
    stream = _random.stream(_random.seed_state(7), 2)
    leaf = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32)
    expected_bits = np.asarray(_random.bits(stream, leaf))
    expected_scale = scale_and_bound(leaf, 2.5, tight=True)[0]
    specs = (
        P("data", None),
        P(None, "model"),
        P("data", "model"),
        P(("model", "data")),
    )
    with jax.set_mesh(_mesh((4, 2), ("data", "model"))):
        for spec in specs:

            def block(x, spec=spec):
                scale = scale_and_bound(x, 2.5, tight=True, split=tuple(spec))[0]
                return _random.bits(stream, x, tuple(spec)), scale

            bits, scale = jax.jit(
                jax.shard_map(block, in_specs=spec, out_specs=(spec, P()))
            )(jax.device_put(leaf, spec))
            np.testing.assert_array_equal(bits, expected_bits, err_msg=str(spec))
            np.testing.assert_allclose(scale, expected_scale, rtol=1e-6)


# --- a per-device window restored on another number of devices -----------


def _per_device_step(opt):
    grad_fn = ga.local_value_and_grad(
        lambda params, x: jnp.mean(jnp.tanh(x @ params["w"])), "data"
    )

    def step(params, state, x):
        return opt.update(grad_fn(params, x)[1], state, params)

    return jax.jit(step)


@pytest.mark.parametrize(
    "axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"]
)
def test_a_per_device_window_restored_on_fewer_devices_is_a_clear_error(axis_type):
    opt = ga.ternary_accumulate(optax.sgd(1.0), 3, unreduced_axes="data")
    params, x = _tree(0, jnp.float32), np.ones((16, 16), np.float32)

    def on_devices(count):
        devices = jax.devices()[:count]
        return jax.set_mesh(
            jax.make_mesh((count,), ("data",), (axis_type,), devices=devices)
        )

    with on_devices(8):
        state = jax.jit(opt.init)(params)
        _, state = _per_device_step(opt)(params, state, jax.device_put(x, P("data")))
        saved = jax.device_get(jax.jit(opt.reduce_window)(state))
    with on_devices(4):
        restored = jax.device_put(saved, P())
        restored = restored._replace(
            acc_grads=jax.device_put(saved.acc_grads, P("data"))
        )
        message = (
            r"holds the windows of 8 devices .* mesh axis 'data' has 4 devices"
            r"(.|\n)*reduce_window` does not help(.|\n)*has 8 devices, or drop"
        )
        step = _per_device_step(opt)
        with pytest.raises(ValueError, match=message):
            step(params, restored, jax.device_put(x, P("data")))
        for method in (opt.flush, opt.reset):
            with pytest.raises(ValueError, match=message):
                method(restored)
        # What the message proposes: a fresh window for these 4 devices.
        fresh = opt.reset(restored._replace(acc_grads=opt.init(params).acc_grads))
        _, fresh = step(params, fresh, jax.device_put(x, P("data")))
        assert fresh.acc_grads.local.code_sums["w"].shape == (4, 16, 32)
        assert int(fresh.mini_step) == 1


# --- a ternary window reduction of tensor-parallel terms -------------------

# Leaves above the default min_size (256): u by columns, v by rows, and a
# bias below it, summed exactly.
TP_SPECS = {"u": P(None, "model"), "v": P("model", None), "c": P("model")}
# Every leaf split along its first dimension over the second mesh axis:
# FSDP's layout (the axis keeps the name `model` in these tests).
ROW_SPECS = {"u": P("model", None), "v": P("model", None), "c": P("model")}


def _window_sums(
    specs, *, seed=3, track_noise_scale=False, axis_type=AxisType.Explicit
):
    """Two windows of 2 micro-batches of per-device gradients on the
    ``data`` 4 x ``model`` 2 mesh; their emitted updates, and the compiled
    step (with ``track_noise_scale``, the last state's stats instead). On
    Auto axes ``init`` runs on the placed params, as users call it: under
    ``jax.jit`` it could not see their split."""
    rng = np.random.default_rng(0)
    params = {
        "u": jnp.asarray(rng.standard_normal((16, 64)), jnp.float32),
        "v": jnp.asarray(rng.standard_normal((64, 8)), jnp.float32),
        "c": jnp.asarray(rng.standard_normal(64), jnp.float32),
    }

    def loss_fn(params, x):
        # Elementwise in each param: no contraction over `model`.
        wide = jnp.tanh(x[:, :, None] * params["u"] + params["c"])
        tall = jnp.tanh(x[:, :8, None, None] * params["v"].T[None, :, :, None])
        return jnp.mean(wide) + jnp.mean(tall)

    opt = ga.MultiSteps(
        optax.sgd(1.0),
        2,
        unreduced_axes="data",
        window_reduction=ga.ternary_window_reduction(seed),
        track_noise_scale=track_noise_scale,
        noise_scale_estimator="all",
    )
    grad_fn = ga.local_value_and_grad(loss_fn, "data")

    def step(params, state, x):
        return opt.update(grad_fn(params, x)[1], state, params)

    with jax.set_mesh(_mesh((4, 2), ("data", "model"), axis_type)):
        params = jax.device_put(params, specs)
        state = init_as_users_do(opt.init, params)
        step = jax.jit(step)
        emitted = []
        for _ in range(4):
            x = jax.device_put(rng.standard_normal((16, 16), np.float32), P("data"))
            updates, state = jax.block_until_ready(step(params, state, x))
            emitted.append(updates)
        if track_noise_scale:
            return emitted[1::2], opt.stats(state)
        compiled = step.lower(params, state, x).compile()
    return emitted[1::2], compiled


@pytest.mark.parametrize(
    ("axis_type", "specs"),
    [
        (AxisType.Explicit, TP_SPECS),
        (AxisType.Auto, TP_SPECS),
        (AxisType.Auto, ROW_SPECS),
    ],
    ids=["explicit-tp", "auto-tp", "auto-fsdp"],
)
def test_ternary_window_reduction_of_split_terms_keeps_their_split(axis_type, specs):
    """Each device codes and sends its own block of a split term, with the
    scale and the random bits of the whole leaf: the codes of replicated
    params, and half their words on the wire. On Auto axes the state says
    how ``init`` saw the params split (their types do not)."""
    emitted, compiled = _window_sums(specs, axis_type=axis_type)
    replicated, replicated_compiled = _window_sums(
        jax.tree.map(lambda _: P(), specs), axis_type=axis_type
    )
    for got, want in zip(emitted, replicated, strict=True):
        if axis_type == AxisType.Explicit:  # on Auto axes the compiler's
            assert _specs(got) == specs
        # A code off by one would move an element of u by a sixteenth of
        # its scale: 1e-6 of it is rounding.
        _assert_same_values(got, want)
    # Nothing moves between devices in the emission but the all-reduces.
    loop = [move for move in moved_arrays(compiled) if move[2] != "entry"]
    assert loop == []
    # Codes: 10 per uint32 word with 4 devices, each device's half of u
    # (1024 codes) and of v (512), instead of the whole leaves.
    words = sorted(r.nbytes for r in ga.measure.all_reduces(compiled))
    replicated_words = sorted(
        r.nbytes for r in ga.measure.all_reduces(replicated_compiled)
    )
    assert -(-512 // 10) * 4 + -(-256 // 10) * 4 in words
    assert -(-1024 // 10) * 4 + -(-512 // 10) * 4 in replicated_words
    # With the scales (each split leaf's sum of squares over `model`, the
    # scales' pmax over `data`, and the collectives compiled in the loop
    # that reads the largest magnitudes, which runs only where a sum of
    # squares overflowed), the exact bias and the window weight: 484 bytes
    # a device against 896.
    assert (sum(words), sum(replicated_words)) == (484, 896)


def test_the_noise_scale_of_a_ternary_window_of_tensor_parallel_terms():
    """What the codes add to the window's squared norm is summed over every
    device's block: the estimate is the one of replicated params (the same
    codes), not the one of a block."""
    _, stats = _window_sums(TP_SPECS, track_noise_scale=True)
    _, replicated = _window_sums(
        jax.tree.map(lambda _: P(), TP_SPECS), track_noise_scale=True
    )
    assert np.isfinite(float(stats.grad_sq_norm))
    for field in ("grad_sq_norm", "noise_trace"):
        np.testing.assert_allclose(
            float(getattr(stats, field)), float(getattr(replicated, field)), rtol=1e-5
        )


def test_a_per_device_ternary_window_of_tensor_parallel_params_is_a_clear_error():
    """Each device's ternary window is a function of its whole term; with
    the leaf split over `model` the message points at the window reduction,
    which keeps the split."""
    opt = ga.ternary_accumulate(optax.sgd(1.0), 2, unreduced_axes="data")
    with jax.set_mesh(_mesh((4, 2), ("data", "model"))):
        params = jax.device_put(
            _tree(0, jnp.float32), {"w": P(None, "model"), "b": P()}
        )
        with pytest.raises(
            ValueError,
            match=r"Param \['w'\] \(float32\[16,32@model\]\) is split over mesh "
            r"axis 'model'(.|\n)*window_reduction=ternary_window_reduction",
        ):
            jax.jit(opt.init)(params)


def test_a_block_of_a_leaf_past_the_uint32_index_draws_its_whole_leaf_bits(
    monkeypatch,
):
    # The limit lowered to 64 elements stands for 2**32: a (16, 32) leaf is
    # then numbered by row stream (dimension 0) and column (dimension 1),
    # and a device's block, split over either, draws the same bits.
    monkeypatch.setattr(_random, "_INDEX_LIMIT", 64)
    stream = _random.stream(_random.seed_state(7), 2)
    leaf = jnp.zeros((16, 32))
    expected = np.asarray(_random.bits(stream, leaf))
    specs = (P("data", None), P(None, "model"), P("data", "model"))
    with jax.set_mesh(_mesh((4, 2), ("data", "model"))):
        for spec in specs:
            bits = jax.jit(
                jax.shard_map(
                    lambda x, spec=spec: _random.bits(stream, x, tuple(spec)),
                    in_specs=spec,
                    out_specs=spec,
                )
            )(jax.device_put(leaf, spec))
            np.testing.assert_array_equal(bits, expected, err_msg=str(spec))
            sharded = jax.jit(lambda x: _random.bits(stream, x))(
                jax.device_put(leaf, spec)
            )
            np.testing.assert_array_equal(sharded, expected, err_msg=str(spec))
