"""Statistical tests of the ternary transformations' random bits (`_random`).

The bits are a hash of (seed, step, leaf, device, element). Every statistic
below is computed on pinned inputs, so it is deterministic; its bound is
five standard deviations of the statistic under ideal random bits, so a
real defect (a bias, a correlation of a few times 1/sqrt(n)) fails it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from gradaccum_jax._compression import _random

SIZE = 1 << 16
NUM_DEVICES = 8


def _shaped(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _bits(state, leaf=0, device=0, size=SIZE):
    stream = _random.stream(jnp.asarray(state, jnp.uint32), leaf, device)
    return np.asarray(_random.bits(stream, _shaped(size)))


def _uniform(state, leaf=0, device=0, size=SIZE):
    """The top 24 bits of a stream's first ``size`` draws, as float64 in [0, 1)."""
    return (_bits(state, leaf, device, size) >> 8).astype(np.float64) / 2**24


def _chi_square(counts):
    counts = np.asarray(counts, np.float64).reshape(-1)
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum()), counts.size - 1


def _assert_chi_square_plausible(counts):
    statistic, dof = _chi_square(counts)
    # Chi-square with dof degrees of freedom: mean dof, variance 2 dof.
    assert abs(statistic - dof) < 5 * np.sqrt(2 * dof), (statistic, dof)


def _assert_uncorrelated(a, b):
    r = np.corrcoef(a, b)[0, 1]
    assert abs(r) < 5 / np.sqrt(len(a)), r


def test_counter_state_is_seed_and_step():
    state = _random.seed_state(7)
    assert state.dtype == jnp.uint32 and state.shape == (2,)
    np.testing.assert_array_equal(state, [7, 0])
    np.testing.assert_array_equal(_random.advance(_random.advance(state)), [7, 2])
    # The step counter wraps instead of overflowing into the seed.
    np.testing.assert_array_equal(
        _random.advance(jnp.array([7, 2**32 - 1], jnp.uint32)), [7, 0]
    )


@pytest.mark.parametrize("bits_from", ["top", "low"])
def test_bits_are_uniform(bits_from):
    bits = np.asarray(
        _random.bits(_random.stream(_random.seed_state(0), 0), _shaped(SIZE))
    )
    byte = bits >> 24 if bits_from == "top" else bits & 0xFF
    _assert_chi_square_plausible(np.bincount(byte, minlength=256))
    # Every one of the 32 bits is set half of the time.
    ones = np.array([((bits >> k) & 1).mean() for k in range(32)])
    assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(SIZE)), ones


def test_consecutive_elements_are_independent():
    u = _uniform(_random.seed_state(1))
    _assert_uncorrelated(u[:-1], u[1:])
    _assert_uncorrelated(u[::2], u[1::2])
    # Joint histogram of neighbours (16 x 16 cells): catches non-linear
    # dependence that a correlation misses.
    cells = np.floor(u[:-1:2] * 16) * 16 + np.floor(u[1::2] * 16)
    _assert_chi_square_plausible(np.bincount(cells.astype(int), minlength=256))


@pytest.mark.parametrize(
    "other",
    [
        {"state": [1, 1]},  # the next step
        {"state": [2, 0]},  # the next seed
        {"leaf": 1},
        {"device": 1},
    ],
    ids=["step", "seed", "leaf", "device"],
)
def test_streams_are_independent(other):
    base = {"state": [1, 0], "leaf": 0, "device": 0}
    u = _uniform(**base)
    v = _uniform(**{**base, **other})
    _assert_uncorrelated(u, v)
    # No stream replays another, shifted (as one additive key would): two
    # sets of 2**16 random 32-bit words share ~1 value, a shifted copy ~2**16.
    shared = np.intersect1d(_bits(**base), _bits(**{**base, **other}))
    assert len(shared) <= 8
    cells = np.floor(u * 16) * 16 + np.floor(v * 16)
    _assert_chi_square_plausible(np.bincount(cells.astype(int), minlength=256))


def test_all_device_pairs_are_uncorrelated():
    draws = np.stack([_uniform([3, 5], 2, d, SIZE // 4) for d in range(NUM_DEVICES)])
    correlation = np.corrcoef(draws)[np.triu_indices(NUM_DEVICES, 1)]
    assert np.all(np.abs(correlation) < 5 / np.sqrt(SIZE // 4)), correlation


def test_same_state_gives_the_same_bits_and_shape_is_row_major():
    stream = _random.stream(jnp.array([4, 9], jnp.uint32), 3, 2)
    flat = _random.bits(stream, _shaped(12))
    np.testing.assert_array_equal(
        _random.bits(stream, _shaped(3, 4)), flat.reshape(3, 4)
    )
    np.testing.assert_array_equal(jax.jit(_random.bits)(stream, jnp.zeros(12)), flat)


def test_bernoulli_is_exact_at_the_ends_and_unbiased_between():
    bits = _random.bits(_random.stream(_random.seed_state(5), 0), _shaped(SIZE))
    assert _random.threshold(jnp.float32(1.0)) == 2**24
    assert bool(jnp.all(_random.bernoulli(bits, _random.threshold(jnp.float32(1.0)))))
    assert not bool(
        jnp.any(_random.bernoulli(bits, _random.threshold(jnp.float32(0.0))))
    )
    for p in (2.0**-10, 0.1, 0.5, 0.9):
        frequency = float(
            jnp.mean(_random.bernoulli(bits, _random.threshold(jnp.float32(p))))
        )
        assert abs(frequency - p) < 5 * np.sqrt(p * (1 - p) / SIZE), (p, frequency)


def test_device_mean_rounding_is_independent_across_devices():
    # Every device sends the same x = 0.5 * scale: with independent draws the
    # mean of the n codes has variance p(1 - p) / n per element, with shared
    # draws p(1 - p).
    transform = ga.ternary_average_across_devices(
        "i", 0, error_feedback=False, clip_sigma=None, min_size=0
    )
    x = jnp.tile(jnp.array([1.0, 0.5]), SIZE // 2)
    grads = jnp.broadcast_to(x, (NUM_DEVICES, SIZE))
    state = jax.tree.map(
        lambda a: jnp.broadcast_to(a, (NUM_DEVICES, *a.shape)), transform.init(x)
    )
    mean, _ = jax.pmap(transform.update, axis_name="i")(grads, state)
    halves = np.asarray(mean[0], np.float64)[1::2]  # p = 0.5, scale 1 / n
    # The scale is max|x / n| = 1 / n, so mean * n is the code sum: a sum of
    # n independent Bernoulli(1/2), variance n / 4 (n**2 / 4 if shared).
    variance = np.var(halves * NUM_DEVICES)
    expected = NUM_DEVICES * 0.25
    # The sample variance of m draws has relative standard error sqrt(2 / m).
    m = len(halves)
    assert abs(variance - expected) < 5 * expected * np.sqrt(2 / m), variance
    assert abs(halves.mean() * NUM_DEVICES - NUM_DEVICES * 0.5) < 5 * np.sqrt(
        expected / m
    )


def test_accumulator_draws_are_independent_across_micro_steps():
    # A constant micro-batch gradient with p = 1/2 per element: after k
    # micro-steps the code sums are Binomial(k, 1/2) if the steps draw
    # independently (variance k / 4), and k times one Bernoulli (k**2 / 4)
    # if they repeated their draws. The scale never grows: no re-rounding.
    every_k = 8
    tx = ga.ternary_accumulate(optax.sgd(1.0), every_k, clip_sigma=None, min_size=0)
    params = {"w": jnp.zeros((SIZE,))}
    g = {"w": jnp.tile(jnp.array([1.0, 0.5]), SIZE // 2)}
    state = tx.init(params)
    update = jax.jit(lambda s: tx.update(g, s, params)[1])
    for _ in range(every_k - 1):
        state = update(state)
    code_sums = np.asarray(state.acc_grads.code_sums["w"], np.float64)
    np.testing.assert_array_equal(code_sums[::2], every_k - 1)  # p = 1
    sums, added = code_sums[1::2], every_k - 1
    expected, m = added / 4, len(sums)
    assert abs(np.var(sums) - expected) < 5 * expected * np.sqrt(2 / m)
    assert abs(sums.mean() - added / 2) < 5 * np.sqrt(expected / m)


def test_a_leaf_past_the_uint32_index_gets_a_stream_per_leading_index(monkeypatch):
    # A leaf of 2**32 elements or more cannot be run here: the limit is
    # lowered to 64 elements, and a (4, 32) leaf stands for one. Numbered
    # mod the limit, rows 0 and 2 (64 elements apart) would draw the same
    # bits; each leading index selects a stream of its own instead.
    stream = _random.stream(_random.seed_state(7), 0)
    small = np.asarray(_random.bits(stream, _shaped(4, 32)))
    monkeypatch.setattr(_random, "_INDEX_LIMIT", 64)
    big = np.asarray(_random.bits(stream, _shaped(4, 32)))
    # Rows are numbered 0..31 within their own stream, all distinct.
    assert len(np.unique(big)) == big.size
    assert not np.array_equal(big[0], big[2])
    # Leaves under the limit keep their bits; a split leaf its whole-leaf ones.
    np.testing.assert_array_equal(
        _random.bits(stream, _shaped(2, 16)), small[:1].reshape(2, 16)
    )
    with pytest.raises(ValueError, match=r"dimension of 128 elements, 2\*\*32 or more"):
        _random.bits(stream, _shaped(128))
