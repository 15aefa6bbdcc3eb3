"""Tests for ternary compression.

Statistical tests use pinned keys, so they are deterministic; their
tolerances are derived from the variance of the estimator, so a real bias
of a fraction of a standard error would fail them.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from gradaccum_jax._codecs import _packing
from gradaccum_jax._codecs._ternary_kernels import scale_and_bound
from gradaccum_jax._ternary import _accumulator
from helpers import EAGER_AND_JIT

NUM_DEVICES = 8


# An MLP's leaves: two compressed weight matrices, two float32 biases.
PARAMS = {
    "w1": jnp.zeros((64, 64)),
    "b1": jnp.zeros((64,)),
    "w2": jnp.zeros((64, 10)),
    "b2": jnp.zeros((10,)),
}


def _normal(seed, shape):
    # numpy, not jax.random: test data needs no compilation.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _heavy_tailed(seed, size):
    """Student-t(3) values: some far above the rest, like real gradients."""
    return jnp.asarray(np.random.default_rng(seed).standard_t(3.0, size), jnp.float32)


def _random_like(tree, seed, leading=()):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef,
        [_normal((seed, i), leading + leaf.shape) for i, leaf in enumerate(leaves)],
    )


def _clipped(x, clip_sigma=2.5):
    """TernGrad's clipping (to clip_sigma root-mean-squares), in numpy."""
    x = np.asarray(x, np.float32)
    bound = clip_sigma * np.sqrt(np.mean(x.astype(np.float64) ** 2))
    return np.clip(x, -bound, bound)


def _replicate(tree):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (NUM_DEVICES, *a.shape)), tree)


# --- ternary_quantize ---------------------------------------------------------


@pytest.mark.parametrize("stochastic", [True, False], ids=["terngrad", "twn"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_codes_dtype_values_and_scale(stochastic, dtype):
    x = _normal(0, (7, 33)).astype(dtype)
    key = jax.random.key(1) if stochastic else None
    codes, scale = ga.ternary_quantize(x, key)
    assert codes.dtype == jnp.int8 and codes.shape == x.shape
    assert set(np.unique(codes)) <= {-1, 0, 1}
    assert scale.dtype == jnp.float32 and scale.shape == ()
    # Codes never flip a sign.
    assert np.all(np.asarray(codes) * np.sign(np.asarray(x, np.float32)) >= 0)
    if stochastic:
        x32 = np.asarray(x, np.float32)
        bound = 2.5 * np.sqrt(np.mean(x32**2))
        np.testing.assert_allclose(scale, min(np.abs(x32).max(), bound), rtol=1e-5)


def test_unclipped_scale_is_max_abs():
    x = jnp.array([0.5, -4.0, 1.0, 0.0])
    codes, scale = ga.ternary_quantize(x, jax.random.key(0), clip_sigma=None)
    assert float(scale) == 4.0 and int(codes[1]) == -1 and int(codes[3]) == 0


def test_twn_threshold_by_hand():
    # mean|x| = 6.3 / 5 = 1.26, delta = 0.882: support {3, -1, 2}, scale 2.
    x = jnp.array([3.0, -1.0, 0.1, -0.2, 2.0])
    codes, scale = ga.ternary_quantize(x)
    np.testing.assert_array_equal(codes, [1, -1, 0, 0, 1])
    np.testing.assert_allclose(scale, 2.0, rtol=1e-6)


def test_stochastic_quantizer_is_unbiased():
    # Heavy-tailed values, so some elements are far below the scale.
    x = _heavy_tailed(0, 256)
    num_draws = 4096
    keys = jax.random.split(jax.random.key(1), num_draws)
    draws = jax.vmap(
        lambda k: ga.ternary_dequantize(*ga.ternary_quantize(x, k, clip_sigma=None))
    )(keys)
    x, scale = np.asarray(x, np.float64), float(np.abs(x).max())
    # Var[code * scale] = scale * |x| - x**2 per element (a scaled Bernoulli).
    standard_error = np.sqrt((scale * np.abs(x) - x**2) / num_draws)
    error = np.asarray(draws, np.float64).mean(0) - x
    z = error / np.maximum(standard_error, 1e-12)
    assert np.all(np.abs(error) <= 5 * standard_error + 1e-6)
    # Under no bias, mean(z**2) ~ 1 +- 0.09 (chi-square with 256 dof).
    assert 0.7 < np.mean(z**2) < 1.3
    np.testing.assert_allclose(np.mean(z**2), 1.089, atol=1e-3)  # pinned keys


def test_clipped_quantizer_is_unbiased_for_the_clipped_tensor():
    x = _heavy_tailed(2, 256)
    bound = 2.5 * float(jnp.sqrt(jnp.mean(x**2)))
    keys = jax.random.split(jax.random.key(3), 4096)
    mean = jax.vmap(lambda k: ga.ternary_dequantize(*ga.ternary_quantize(x, k)))(
        keys
    ).mean(0)
    clipped = np.clip(np.asarray(x), -bound, bound)
    standard_error = np.sqrt((bound * np.abs(clipped) - clipped**2) / 4096)
    assert np.all(np.abs(np.asarray(mean) - clipped) <= 5 * standard_error + 1e-6)


@pytest.mark.parametrize("key", [None, jax.random.key(0)], ids=["twn", "terngrad"])
def test_zeros_and_non_finite(key):
    codes, scale = ga.ternary_quantize(jnp.zeros((300,)), key)
    assert float(scale) == 0.0 and not np.any(codes)
    x = jnp.arange(300.0).at[7].set(jnp.nan)
    codes, scale = ga.ternary_quantize(x, key)
    assert np.isnan(scale) and set(np.unique(codes)) <= {-1, 0, 1}
    assert np.all(np.isnan(ga.ternary_dequantize(codes, scale)))
    _, scale = ga.ternary_quantize(x.at[7].set(jnp.inf), key)
    assert np.isnan(scale)


def test_dequantize_dtype_and_summed_codes():
    codes = jnp.array([3, -2, 0], jnp.int16)
    out = ga.ternary_dequantize(codes, jnp.float32(0.5), jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, [1.5, -1.0, 0.0])


# --- ternarize ----------------------------------------------------------------


@EAGER_AND_JIT
@pytest.mark.parametrize("stochastic", [True, False], ids=["terngrad", "twn"])
def test_error_feedback_bookkeeping(compile_fn, stochastic):
    # The residual is the compressor's bias x - E[C(x)]: everything TWN did
    # not send; TernGrad's clipping error (its rounding is unbiased). Either
    # way sum(E[sent]) + residual = sum(inputs).
    transform = ga.ternarize(0, stochastic=stochastic)
    state = transform.init(PARAMS)
    update = compile_fn(transform.update)
    expected_sum = {name: 0.0 for name in ("w1", "w2")}
    input_sum = jax.tree.map(jnp.zeros_like, PARAMS)
    for step in range(2):
        grads = _random_like(PARAMS, step)
        inputs = {name: grads[name] + state.residual[name] for name in expected_sum}
        sent, state = update(grads, state)
        for name, x in inputs.items():
            expected = _clipped(x) if stochastic else sent[name]
            expected_sum[name] = expected_sum[name] + expected
            if stochastic:  # scale = max|clip(x)|, codes in {-1, 0, 1}
                ratio = np.asarray(sent[name]) / np.abs(expected).max()
                assert set(np.unique(np.round(ratio, 5))) <= {-1, 0, 1}
        input_sum = jax.tree.map(jnp.add, input_sum, grads)
    # Small leaves pass through exactly and keep no residual.
    assert jax.tree.leaves(state.residual["b1"]) == []
    np.testing.assert_array_equal(sent["b2"], grads["b2"])
    for name in expected_sum:
        assert len(np.unique(np.abs(sent[name]))) <= 2  # {-scale, 0, scale}
        assert np.any(state.residual[name])  # clipping happened
        np.testing.assert_allclose(
            expected_sum[name] + state.residual[name], input_sum[name], atol=1e-5
        )


def test_unclipped_terngrad_keeps_no_residual():
    state = ga.ternarize(0, clip_sigma=None).init(PARAMS)
    assert jax.tree.leaves(state.residual) == []
    assert ga.measure.state_nbytes(state) == 8  # the key


def test_ternarize_is_reproducible_from_the_seed_and_splits_its_key():
    grads = _random_like(PARAMS, 0)

    def run(seed):
        transform = ga.ternarize(seed, error_feedback=False)
        state = transform.init(PARAMS)
        first, state = transform.update(grads, state)
        second, state = transform.update(grads, state)
        return first["w1"], second["w1"]

    first, second = run(3)
    again_first, again_second = run(3)
    np.testing.assert_array_equal(first, again_first)
    np.testing.assert_array_equal(second, again_second)
    assert not np.array_equal(first, second)  # a fresh key each step
    assert not np.array_equal(first, run(4)[0])


def test_ternarize_scans_and_a_non_finite_step_keeps_the_residual():
    # TWN, whose bookkeeping is exact: sent + residual = inputs.
    transform = ga.ternarize(0, stochastic=False, min_size=0)
    grads = _random_like(PARAMS, 0)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)

    def step(state, g):
        sent, state = transform.update(g, state)
        return state, sent

    stacked = jax.tree.map(lambda g, b: jnp.stack([g, b, g]), grads, bad)
    state, sent = jax.lax.scan(step, transform.init(PARAMS), stacked)
    assert np.all(np.isnan(sent["w1"][1])) and np.all(np.isfinite(sent["w1"][2]))
    np.testing.assert_allclose(
        sent["w1"][0] + sent["w1"][2] + state.residual["w1"],
        2 * grads["w1"],
        atol=1e-5,
    )


# --- ternary_average_across_devices --------------------------------------------


AVERAGE = ga.ternary_average_across_devices("i", 0)


@functools.cache
def _compiled_average(weighted: bool):
    """The pmapped step ``(grads, state[, weight])``, compiled once per module."""
    grads = jax.eval_shape(lambda: _random_like(PARAMS, 0, (NUM_DEVICES,)))
    state = jax.eval_shape(lambda: _replicate(AVERAGE.init(PARAMS)))
    if weighted:
        step = jax.pmap(lambda g, s, w: AVERAGE.update(g, s, weight=w), axis_name="i")
        weight = jax.ShapeDtypeStruct((NUM_DEVICES,), jnp.float32)
        return step.lower(grads, state, weight).compile()
    return jax.pmap(AVERAGE.update, axis_name="i").lower(grads, state).compile()


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
def test_average_identical_on_every_device_with_bookkeeping(weighted):
    state = _replicate(AVERAGE.init(PARAMS))
    weight = jnp.arange(1.0, NUM_DEVICES + 1)
    share = weight / weight.sum() if weighted else jnp.full(NUM_DEVICES, 0.125)
    step = _compiled_average(weighted)
    names = ("w1", "w2")
    expected_sum = {name: 0.0 for name in names}
    target_sum = {name: 0.0 for name in names}
    share = np.asarray(share)
    for seed in range(3):
        grads = jax.device_get(_random_like(PARAMS, seed, (NUM_DEVICES,)))
        # Each device's share of the mean plus its residual.
        residual = jax.device_get(state.residual)
        inputs = {n: share[:, None, None] * grads[n] + residual[n] for n in names}
        mean, state = step(grads, state, weight) if weighted else step(grads, state)
        mean = jax.device_get(mean)
        for leaf in jax.tree.leaves(mean):  # bitwise identical everywhere
            assert all(np.array_equal(leaf[0], leaf[d]) for d in range(NUM_DEVICES))
        for name, x in inputs.items():
            # E[mean] = sum over devices of their clipped shares.
            expected_sum[name] += sum(_clipped(x[d]) for d in range(NUM_DEVICES))
            target_sum[name] += np.tensordot(share, grads[name], 1)
    # Small leaves: the exact float32 mean.
    np.testing.assert_allclose(
        mean["b1"][0], np.tensordot(share, grads["b1"], 1), atol=1e-6
    )
    # Compressed leaves: E[sent] + every device's residual = the target.
    residual = jax.device_get(state.residual)
    for name in names:
        assert np.any(residual[name])
        np.testing.assert_allclose(
            expected_sum[name] + residual[name].sum(0),
            target_sum[name],
            atol=1e-5,
        )


def test_zero_total_weight_gives_zeros_and_keeps_the_residual():
    step = _compiled_average(weighted=True)
    grads = _random_like(PARAMS, 0, (NUM_DEVICES,))
    _, state = step(grads, _replicate(AVERAGE.init(PARAMS)), jnp.ones(NUM_DEVICES))
    mean, new_state = jax.device_get(step(grads, state, jnp.zeros(NUM_DEVICES)))
    assert not any(np.any(leaf) for leaf in jax.tree.leaves(mean))
    np.testing.assert_array_equal(new_state.residual["w1"], state.residual["w1"])


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
def test_wire_bytes_from_compiled_hlo(weighted):
    compiled = _compiled_average(weighted)
    grads = _random_like(PARAMS, 0, (NUM_DEVICES,))
    float_psum = jax.pmap(lambda g: jax.lax.pmean(g, "i"), axis_name="i")
    float_bytes = ga.measure.all_reduce_nbytes(float_psum.lower(grads).compile())
    # What every call sends (the entry computation): the scales' pmax is
    # compiled once more, in a loop that runs only where a scale came back
    # +inf (a sum of squares that overflowed).
    found = ga.measure.collectives(compiled)
    ternary_bytes = sum(c.nbytes for c in found if c.place == "entry")
    assert [(c.place, c.nbytes) for c in found if c.place != "entry"] == [("loop", 8)]
    assert float_bytes == 4 * 4810
    # u32[592] + u32[92] codes, 7 base-17 digits per word: 4096 codes as
    # 256 rows of 16 (padded to 259 = 7 planes of 37 rows), 640 as 640 rows
    # of 1 (644 = 7 x 92); + f32[74] biases + f32[2] scales (+ the weight).
    assert ternary_bytes == (592 + 92) * 4 + 74 * 4 + 2 * 4 + 4 * weighted
    assert ternary_bytes <= float_bytes / 4
    assert "u32[592]" in compiled.as_text() and "u32[92]" in compiled.as_text()
    # One all-reduce for the exact leaves (and the weight), one pmax for the
    # scales, one psum for the codes (and the recheck's pmax).
    assert compiled.as_text().count(" all-reduce(") == 4


def test_average_is_unbiased_without_clipping():
    transform = ga.ternary_average_across_devices(
        "i", 0, error_feedback=False, clip_sigma=None, min_size=0
    )
    grads = _normal(0, (NUM_DEVICES, 128))
    steps = 512

    def run(g, state):
        def step(state, _):
            mean, state = transform.update(g, state)
            return state, mean

        return jax.lax.scan(step, state, None, length=steps)[1]

    state = _replicate(transform.init(grads[0]))
    means = np.asarray(jax.pmap(run, axis_name="i")(grads, state)[0], np.float64)
    target = np.asarray(grads, np.float64).mean(0)
    # Independent rounding per device: Var = sum_d (s |x_d| - x_d**2) / n**2.
    x = np.asarray(grads, np.float64) / NUM_DEVICES
    variance = (np.abs(x).max() * np.abs(x) - x**2).sum(0)
    # Scale s is the max over devices of each step: the bound above is exact.
    standard_error = np.sqrt(variance / steps)
    assert np.all(np.abs(means.mean(0) - target) <= 5 * standard_error)


def test_packed_codes_sum_exactly_for_any_number_of_devices():
    # 32768 devices leave no room for two base-65537 digits: plain int32 sums.
    for num_devices in (8, 128, 32768):
        keys = jax.random.split(jax.random.key(num_devices))
        leaves = [
            jax.random.randint(key, (num_devices, *shape), -1, 2).astype(jnp.int8)
            for key, shape in zip(keys, [(257,), (3, 5)], strict=True)
        ]
        sums = jax.vmap(
            lambda *c, n=num_devices: _packing.packed_sum(list(c), "i", n, 1),
            axis_name="i",
        )(*leaves)
        for leaf, leaf_sums in zip(leaves, sums, strict=True):
            assert leaf_sums.shape == leaf.shape and leaf_sums.dtype == jnp.int32
            np.testing.assert_array_equal(leaf_sums[0], leaf.astype(jnp.int32).sum(0))


@pytest.mark.parametrize(
    "shape, words",
    [
        ((2048, 64), 19 * 1024),  # rows of 1024, 133 rows padded to 7 x 19
        ((300, 16), 43 * 16),  # rows of 16: 4800 is no multiple of 64
        ((3, 5, 7, 16), 240),  # 1680 rows of 1 (too few rows of 16)
    ],
)
def test_packed_codes_of_any_shape_come_back_in_place(shape, words):
    # 8 devices: 7 digits per word, planes of whole rows.
    codes = jax.random.randint(jax.random.key(0), (NUM_DEVICES, *shape), -1, 2)
    codes = codes.astype(jnp.int8)
    assert _packing.pack(codes[0], NUM_DEVICES, 1).shape == (words,)
    sums = jax.vmap(
        lambda c: _packing.packed_sum([c], "i", NUM_DEVICES, 1)[0], axis_name="i"
    )(codes)
    assert sums.shape == codes.shape and sums.dtype == jnp.int32
    np.testing.assert_array_equal(sums[3], codes.astype(jnp.int32).sum(0))


def test_unbound_axis_is_a_clear_error():
    transform = ga.ternary_average_across_devices("batch", 0)
    with pytest.raises(NameError, match="axis name 'batch' is not bound"):
        transform.update(PARAMS, transform.init(PARAMS))


# --- ternary_accumulate -----------------------------------------------------------


def test_accumulator_memory_and_dtypes():
    params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,)), "c": jnp.zeros((3,))}
    float_state = ga.MultiSteps(optax.sgd(0.1), 4).init(params)
    ternary_state = ga.ternary_accumulate(optax.sgd(0.1), 4).init(params)
    acc = ternary_state.acc_grads
    assert (
        acc.code_sums["w"].dtype == jnp.int8 and acc.code_sums["c"].dtype == jnp.float32
    )
    ratio = ga.measure.state_nbytes(acc) / ga.measure.state_nbytes(
        float_state.acc_grads
    )
    assert ratio <= 0.3
    np.testing.assert_allclose(ratio, (65792 + 12 + 8 + 8) / (4 * 65795), rtol=1e-12)
    wide = ga.ternary_accumulate(optax.sgd(0.1), 200).init(params).acc_grads
    assert wide.code_sums["w"].dtype == jnp.int16
    scheduled = ga.ternary_accumulate(optax.sgd(0.1), lambda step: 4)
    assert scheduled.init(params).acc_grads.code_sums["w"].dtype == jnp.int16
    bounded = ga.ternary_accumulate(optax.sgd(0.1), lambda step: 4, max_every_k=8)
    assert bounded.init(params).acc_grads.code_sums["w"].dtype == jnp.int8


def test_window_sum_is_unbiased_when_the_scale_grows():
    # Later, larger and weighted micro-batches: the scale grows twice, so
    # the code sums are re-rounded; the window sum must stay unbiased.
    base = _heavy_tailed(0, 300)
    grads = [base, -3.0 * base[::-1], 0.5 * base**2]
    weights = [1.0, 2.0, 0.5]
    accumulator = _accumulator._ternary_window_accumulator(0, None)

    def window(key_data):
        acc = accumulator.init(base)._replace(key=key_data)
        for g, w in zip(grads, weights, strict=True):
            acc = accumulator.add(acc, g, jnp.float32(w))
        return accumulator.total(acc)

    keys = jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(1), 4096))
    totals = np.asarray(jax.jit(jax.vmap(window))(keys), np.float64)
    target = sum(
        w * np.asarray(g, np.float64) for g, w in zip(grads, weights, strict=True)
    )
    standard_error = totals.std(0) / np.sqrt(len(totals))
    z = (totals.mean(0) - target) / standard_error
    assert np.all(np.abs(z) < 5)
    assert 0.7 < np.mean(z**2) < 1.3


def test_weighted_statistics_come_from_the_unweighted_gradient():
    # The scale and clipping bound of w g, from g's own reductions.
    x = _heavy_tailed(3, 1000)
    rms = np.sqrt(np.mean(np.asarray(x, np.float64) ** 2))
    # 1e-20: (w g)**2 would underflow float32, clipping everything to 0.
    for weight in (0.5, -3.0, 1e-20):
        weight = jnp.float32(weight)
        # Exact: rounding is monotone, so max|w g| = |w| max|g|.
        max_abs = float(jnp.max(jnp.abs(weight * x)))
        scale, bound, finite = scale_and_bound(x, 2.5, weight)
        np.testing.assert_allclose(bound, 2.5 * abs(float(weight)) * rms, rtol=1e-6)
        # The bound is the scale: one reduction, no max|x|.
        assert float(scale) == float(bound) and bool(finite)
        tight = scale_and_bound(x, 2.5, weight, tight=True)
        assert float(tight[0]) == min(max_abs, float(bound)) and bool(tight[2])
        scale, bound, finite = scale_and_bound(x, None, weight)
        assert float(scale) == max_abs
        assert float(bound) == np.inf and bool(finite)
    for clip_sigma, tight in ((2.5, False), (2.5, True), (None, False)):
        kwargs = {"clip_sigma": clip_sigma, "tight": tight}
        for weight in (np.nan, np.inf):
            finite = scale_and_bound(x, weight=jnp.float32(weight), **kwargs)
            assert not bool(finite[2])
        for bad in (np.nan, np.inf):
            finite = scale_and_bound(x.at[7].set(bad), weight=2.0, **kwargs)
            assert not bool(finite[2])
    # Finite, but the sum of squares overflows float32: the largest
    # magnitude is read then, and the leaf is merely not clipped, tight or
    # not (an infinite element stays non-finite, above).
    huge = jnp.full((1000,), 1e19, jnp.float32)
    for tight in (False, True):
        scale, bound, finite = scale_and_bound(huge, 2.5, tight=tight)
        assert float(scale) == float(np.float32(1e19)) and bool(finite)
        assert float(bound) == np.inf
    assert bool(scale_and_bound(huge, None)[2])


def test_scale_is_the_clipping_bound_even_without_outliers():
    # A constant tensor: ternary_quantize's scale is max|clip(x)| = 1 (exact
    # codes); the accumulator's is the bound 2.5, from one pass, and its
    # codes stay unbiased, each 1 with probability 1 / 2.5.
    x = jnp.ones((4096,))
    codes, scale = ga.ternary_quantize(x, jax.random.key(0))
    assert float(scale) == 1.0 and np.all(np.asarray(codes) == 1)
    accumulator = _accumulator._ternary_window_accumulator(0, 2.5)
    window = accumulator.add(accumulator.init(x), x, jnp.float32(1.0))
    assert float(window.scales) == 2.5
    np.testing.assert_allclose(np.mean(np.asarray(window.code_sums)), 0.4, atol=0.02)


def test_weighted_micro_step_writes_no_float_temporary():
    # XLA:CPU's reductions do not fuse an elementwise producer: reducing
    # w * g would write it out, a parameter-sized float32 temporary.
    accumulator = _accumulator._ternary_window_accumulator(0, 2.5)
    grads = jnp.zeros((256, 256))
    compiled = (
        jax.jit(lambda g, acc, w: accumulator.add(acc, g, w), donate_argnums=1)
        .lower(grads, accumulator.init(grads), jnp.float32(0.5))
        .compile()
        .as_text()
    )
    entry = compiled[compiled.index("ENTRY") :].splitlines()[1:]
    computed = [line for line in entry if " = " in line and "parameter(" not in line]
    results = [line.split(" = ", 1)[1].split()[0] for line in computed]
    # One pass writes the new int8 sums; nothing else is parameter-sized.
    assert [r for r in results if "[256,256]" in r] == ["s8[256,256]{1,0}"]


@pytest.mark.parametrize("clip_sigma, reductions", [(2.5, 1), (None, 2)])
def test_micro_step_reads_the_gradient_in_one_reduction_when_clipping(
    clip_sigma, reductions
):
    # With clipping the scale is the bound, from the sum of squares alone;
    # unclipped it is max|g|, and the sum of squares is the NaN check.
    accumulator = _accumulator._ternary_window_accumulator(0, clip_sigma)
    grads = jnp.zeros((256, 256))
    jaxpr = jax.make_jaxpr(accumulator.add)(
        accumulator.init(grads), grads, jnp.float32(1.0)
    )
    names = [str(eqn.primitive) for eqn in jaxpr.jaxpr.eqns]
    assert names.count("reduce_sum") + names.count("reduce_max") == reductions


def test_emitting_step_writes_no_float_temporary():
    # The decoded window and adamw's update are computed inside the emission
    # loops, in the update buffers: XLA must not hoist them out of the
    # nested 0/1-trip loop (which passes the window and the params through
    # unchanged) into a parameter-sized float32 temporary copied in after.
    params = {"w": jnp.zeros((512, 512))}
    tx = ga.ternary_accumulate(optax.adamw(1e-3), 4)
    # The gradients donated, as a dead temporary of a train step: the
    # emitted updates take their buffers.
    compiled = (
        jax.jit(lambda g, s: tx.update(g, s, params), donate_argnums=(0, 1))
        .lower(params, tx.init(params))
        .compile()
    )
    # Nothing window-sized is left: the window is reset by the next
    # micro-batch, so the emission neither copies the int8 window before
    # reading it nor writes zeros next to it (each 1/4 of the float32
    # params: 0.5x the params before, 2.25x before that).
    assert compiled.memory_analysis().temp_size_in_bytes < 512 * 512 * 4 * 0.05


def test_ternary_accumulate_emits_through_the_engine():
    # Entries of equal magnitude ternarize exactly: the emitted update is
    # then the exact window mean, which checks the plumbing.
    params = {"w": jnp.zeros((32, 32)), "b": jnp.zeros((5,))}
    signs = jnp.sign(_normal(0, (32, 32)))
    grads = {"w": 0.25 * signs, "b": jnp.arange(5.0)}
    opt = ga.ternary_accumulate(optax.sgd(1.0), 3, clip_sigma=None)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for _ in range(2):
        updates, state = update(grads, state, params)
        assert not np.any(updates["w"])
    updates, state = update(grads, state, params)
    np.testing.assert_allclose(updates["w"], -grads["w"], rtol=1e-6)
    np.testing.assert_allclose(updates["b"], -grads["b"], rtol=1e-6)
    # The emitted window is reset by the next micro-batch (lazily, as the
    # state's contract says): the next window's update is again the mean
    # of its own gradients, nothing of the last one left in it.
    assert int(state.mini_step) == 0
    half = jax.tree.map(lambda g: g / 2, grads)
    for _ in range(3):
        updates, state = update(half, state, params)
    np.testing.assert_allclose(updates["w"], -half["w"], rtol=1e-6)
    np.testing.assert_allclose(updates["b"], -half["b"], rtol=1e-6)


def test_a_non_finite_micro_batch_spoils_only_its_window():
    params = {"w": jnp.zeros((32, 32))}
    opt = ga.ternary_accumulate(optax.sgd(1.0), 2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    grads = _random_like(params, 0)
    updates, state = update(
        jax.tree.map(lambda g: g.at[0, 0].set(jnp.nan), grads), state
    )
    updates, state = update(grads, state)
    assert np.all(np.isnan(updates["w"]))
    for _ in range(2):
        updates, state = update(grads, state)
    assert np.all(np.isfinite(updates["w"])) and np.any(updates["w"])


def test_a_skipped_micro_batch_leaves_the_window_as_it_was():
    params = {"w": jnp.zeros((32, 32))}
    opt = ga.ternary_accumulate(
        optax.sgd(1.0), 2, should_skip_update_fn=ga.skip_not_finite
    )
    grads = _random_like(params, 0)
    state = opt.init(params)
    _, state = opt.update(grads, state)
    nan_grads = jax.tree.map(lambda g: g.at[0, 0].set(jnp.nan), grads)
    _, skipped = opt.update(nan_grads, state)
    chex.assert_trees_all_equal(skipped.acc_grads, state.acc_grads)


# --- state_nbytes and errors ----------------------------------------------------


def test_state_nbytes_counts_real_arrays():
    tree = {
        "codes": jnp.zeros((10, 3), jnp.int8),
        "scale": np.float32(1.0),
        "shape_only": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16),
        "key": jax.random.key(0),
        "masked": optax.MaskedNode(),
        "count": 3,
    }
    assert ga.measure.state_nbytes(tree) == 30 + 4 + 32 + 8


def test_quantizing_integers_is_a_value_error():
    with pytest.raises(ValueError, match="`x` must be a floating-point array"):
        ga.ternary_quantize(jnp.ones(3, jnp.int32))


# Each ternary transformation and the prefix of its messages.
_TRANSFORMS = {
    "ternarize": lambda: ga.ternarize(0),
    "ternary_accumulate": lambda: ga.ternary_accumulate(optax.sgd(1.0), 2),
    "ternary_average_across_devices": lambda: ga.ternary_average_across_devices("i", 0),
}


@pytest.mark.parametrize("leaf", ["w1", "b1"], ids=["compressed", "below-min-size"])
@pytest.mark.parametrize("name", _TRANSFORMS)
def test_complex_leaves_are_rejected_naming_the_leaf(name, leaf):
    """Not cast to float32, which dropped the imaginary part, at any size."""
    transform = _TRANSFORMS[name]()
    complex_tree = {**PARAMS, leaf: PARAMS[leaf].astype(jnp.complex64)}
    message = rf"\['{leaf}'\] has dtype complex64: ternary compression takes real"
    with pytest.raises(ValueError, match=rf"{name}: params leaf {message}") as error:
        transform.init(complex_tree)
    assert "optax.masked" in str(error.value)
    state = transform.init(PARAMS)
    with pytest.raises(
        ValueError, match=rf"{name}: (updates|gradients) leaf {message}"
    ):
        transform.update(complex_tree, state)


def test_complex_params_of_a_ternary_window_reduction_are_rejected():
    with pytest.raises(ValueError, match=r"params leaf \['b2'\] has dtype complex64"):
        ga.ternary_window_reduction(0).init(  # (params, layout): no layout needed
            {**PARAMS, "b2": PARAMS["b2"].astype(jnp.complex64)}, None
        )
    with pytest.raises(ValueError, match="complex array has no ternary code"):
        ga.ternary_quantize(jnp.ones(3, jnp.complex64), jax.random.key(0))


def test_bad_inputs_name_the_leaf():
    transform = ga.ternarize(0)
    state = transform.init(PARAMS)
    wrong_shape = {**PARAMS, "w1": jnp.zeros((64, 65))}
    with pytest.raises(ValueError, match=r"\['w1'\] has shape \(64, 65\)"):
        transform.update(wrong_shape, state)
    with pytest.raises(ValueError, match=r"missing leaves \[\"\['b2'\]\"\]"):
        transform.update({k: v for k, v in PARAMS.items() if k != "b2"}, state)
    integer = {**PARAMS, "b1": jnp.zeros((64,), jnp.int32)}
    with pytest.raises(ValueError, match=r"\['b1'\] has dtype int32"):
        transform.update(integer, state)
    average = ga.ternary_average_across_devices("i", 0)
    with pytest.raises(ValueError, match="`weight` must be a scalar"):
        jax.pmap(lambda g, s: average.update(g, s, weight=jnp.ones(2)), axis_name="i")(
            _random_like(PARAMS, 0, (NUM_DEVICES,)), _replicate(average.init(PARAMS))
        )


def test_packed_psum_digits_per_word_and_extremes():
    # base 2n + 1: 13 codes per word for 2 devices, 10 for 4, 7 for 8.
    assert [_packing.digits_per_word(n, 1) for n in (1, 2, 4, 8, 16)] == [
        20,
        13,
        10,
        7,
        6,
    ]
    for num_devices in (1, 2, 3, 16):
        for fill in (-1, 1):  # every digit at its extreme: no carry, no borrow
            codes = jnp.full((num_devices, 29), fill, jnp.int8)
            sums = jax.vmap(
                lambda c, n=num_devices: _packing.packed_sum([c], "i", n, 1)[0],
                axis_name="i",
            )(codes)
            np.testing.assert_array_equal(sums, fill * num_devices)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"error_feedback": False}, {"clip_sigma": None}],
    ids=["residual", "no_residual", "unclipped"],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_weight_zero_device_with_nan_gradients_contributes_nothing(kwargs, bad):
    # Without a residual the statistics come from the raw gradients scaled
    # by the share: a zero share must still keep the device out.
    average = ga.ternary_average_across_devices("i", 0, **kwargs)
    grads = jax.device_get(_random_like(PARAMS, 5, (NUM_DEVICES,)))
    weights = jnp.arange(NUM_DEVICES, dtype=jnp.float32).at[3].set(0.0)
    nan_grads = jax.tree.map(lambda g: g.copy(), grads)
    for leaf in nan_grads.values():
        leaf[3] = bad
    state = _replicate(average.init(PARAMS))
    step = jax.pmap(lambda g, s, w: average.update(g, s, weight=w), axis_name="i")
    clean_mean, clean_state = step(grads, state, weights)
    nan_mean, nan_state = step(nan_grads, state, weights)
    for name in PARAMS:
        assert np.all(np.isfinite(nan_mean[name])), name
        np.testing.assert_array_equal(nan_mean[name], clean_mean[name])
    chex.assert_trees_all_equal(nan_state, clean_state)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ga.ternarize(0),
        lambda: ga.ternary_average_across_devices("i", 0),
    ],
    ids=["ternarize", "device_mean"],
)
def test_a_leaf_grown_past_min_size_is_a_clear_error(build):
    transform = build()
    state = transform.init({"b": jnp.zeros((10,))})
    with pytest.raises(ValueError, match=r"updates leaf \['b'\] has shape \(300,\)"):
        jax.vmap(transform.update, in_axes=(0, None), axis_name="i")(
            {"b": jnp.zeros((2, 300))}, state
        )


@pytest.mark.parametrize(
    "build",
    [
        lambda: ga.ternarize(0, clip_sigma=None),
        lambda: ga.ternarize(0, error_feedback=False),
        lambda: ga.ternary_average_across_devices("i", 0, clip_sigma=None),
        lambda: ga.ternary_average_across_devices("i", 0, error_feedback=False),
    ],
    ids=[
        "ternarize-unclipped",
        "ternarize-no-feedback",
        "mean-unclipped",
        "mean-no-feedback",
    ],
)
def test_a_leaf_without_residual_still_has_its_shape_checked(build):
    """A leaf that keeps no residual still records its shape (no memory):
    updates of another shape are an error naming the leaf, not silently
    compressed."""
    transform = build()
    state = transform.init({"w": jnp.zeros((16, 32)), "b": jnp.zeros((4,))})
    assert ga.measure.state_nbytes(state) == 8  # the key only
    with pytest.raises(
        ValueError,
        match=r"updates leaf \['w'\] has shape \(32, 16\), but the "
        r"parameters the state was initialized with have shape \(16, 32\)",
    ):
        jax.vmap(transform.update, in_axes=(0, None), axis_name="i")(
            {"w": jnp.zeros((2, 32, 16)), "b": jnp.zeros((2, 4))}, state
        )


def test_ternary_accumulate_differentiates_through_update():
    # run_if differentiates as a cond; the stochastic rounding is a
    # constant of the PRNG key, so the meta-gradient is finite and the
    # unclipped window of one micro-batch per code is reproducible.
    def unrolled_loss(learning_rate, grads_seq):
        tx = ga.ternary_accumulate(
            optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate),
            2,
            clip_sigma=None,
            min_size=0,
        )
        params = {"w": jnp.array([1.0, -1.0, 0.5, 2.0])}
        state = tx.init(params)
        for grads in grads_seq:
            updates, state = tx.update({"w": grads + params["w"]}, state, params)
            params = optax.apply_updates(params, updates)
        return jnp.sum(params["w"] ** 2)

    grads_seq = _normal(0, (4, 4))
    d_lr, d_grads = jax.jit(jax.grad(unrolled_loss, argnums=(0, 1)))(0.1, grads_seq)
    assert d_lr.shape == () and bool(jnp.isfinite(d_lr)) and float(d_lr) != 0.0
    assert d_grads.shape == (4, 4) and bool(jnp.all(jnp.isfinite(d_grads)))
    again = jax.jit(jax.grad(unrolled_loss))(0.1, grads_seq)
    np.testing.assert_array_equal(d_lr, again)


# --- leaves past 2**31 elements, traced without allocating them ---------------

# 2**31 + 2**16 elements (an int32 count overflows) and 2**33 (a uint32
# element index overflows, and a leading dimension's stride is 2**32).
_HUGE_SHAPES = [(65536, 32769), (2, 65536, 65536)]


def _traced(name, huge):
    """Lowers transformation ``name`` on ``huge`` (a ShapeDtypeStruct)."""
    if name == "ternary_quantize":
        return jax.jit(ga.ternary_quantize).lower(huge, jax.random.key(0))
    tx = (
        ga.ternarize(0)
        if name == "ternarize"
        else ga.ternary_accumulate(optax.sgd(1.0), 2)
    )
    state = jax.eval_shape(tx.init, huge)
    return jax.jit(lambda g, s: tx.update(g, s, g)).lower(huge, state)


@pytest.mark.parametrize("shape", _HUGE_SHAPES, ids=["2^31+2^16", "2^33"])
@pytest.mark.parametrize(
    "name", ["ternary_quantize", "ternarize", "ternary_accumulate"]
)
def test_leaves_of_2_31_elements_and_more_trace(name, shape):
    # The element count was a Python int in the step's arithmetic, which JAX
    # makes an int32 (OverflowError at trace time past 2**31 elements); the
    # stride of a leading dimension was a uint32 (past 2**32).
    lowered = _traced(name, jax.ShapeDtypeStruct(shape, jnp.float32))
    first = jax.tree.leaves(lowered.out_info)[0]  # the codes, or the updates
    expected = jnp.int8 if name == "ternary_quantize" else jnp.float32
    assert (first.shape, first.dtype) == (shape, expected)


def test_twn_scale_counts_the_support_in_float32():
    # An int32 count of the support wraps past 2**31 elements; the float32
    # one gives the same scale at every size that can be run here.
    x = _heavy_tailed(3, 4096)
    magnitude = np.abs(np.asarray(x, np.float64))
    support = magnitude > 0.7 * magnitude.mean()
    _, scale = ga.ternary_quantize(x)
    np.testing.assert_allclose(scale, magnitude[support].mean(), rtol=1e-6)
    text = jax.jit(ga.ternary_quantize).lower(x).as_text()
    assert "tensor<i32>" not in text
