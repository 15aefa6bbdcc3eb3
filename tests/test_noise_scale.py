"""The gradient noise scale (McCandlish et al. 2018, appendix A).

Exact algebra on hand-made windows; unbiasedness against closed forms on
linear regression with Gaussian noise (many seeds, vectorized); agreement
with a brute-force per-example covariance on scikit-learn's digits; the
sampled estimator (one micro-batch's norm per window); the adaptive window;
the memory cost of tracking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._noise_scale import sampled_slot
from helpers import train_step_temp_bytes

# Every micro-batch's norm: the exact algebra of the estimator.
ALL = {"noise_scale_estimator": "all"}

# --- exact algebra -------------------------------------------------------------


def _window(opt, grads, weights):
    params = {"w": jnp.zeros(np.shape(grads[0]))}
    state = opt.init(params)
    for g, w in zip(grads, weights, strict=True):
        _, state = opt.update({"w": jnp.asarray(g, jnp.float32)}, state, weight=w)
    return state


def _formula(grads, weights, slot=None):
    """The weighted estimator in float64 numpy; sampled if ``slot`` is given
    (micro-batch ``j = slot`` measured: ``A = w_j |g_j|^2``, ``V = w_j``,
    ``n = 1``; every one otherwise)."""
    g, w = np.asarray(grads, np.float64), np.asarray(weights, np.float64)
    total = w.sum()
    measured = w != 0 if slot is None else np.arange(len(w)) == slot
    measured &= w != 0
    a = np.sum(np.where(measured, w * np.sum(g**2, axis=1), 0.0))
    v, n = w[measured].sum(), np.count_nonzero(measured)
    c = np.sum((w @ g / total) ** 2)
    trace = (a - v * c) / (n - v / total)
    return c - trace / total, trace


@pytest.mark.parametrize("estimator", ["all", "sampled"])
@pytest.mark.parametrize("make", ["MultiSteps", "accumulate"])
def test_one_window_matches_the_weighted_formula(make, estimator):
    grads = [[1.0, 2.0, -1.0], [3.0, 0.5, 0.0], [-2.0, 1.0, 4.0], [0.0, 0.0, 1.0]]
    weights = [3.0, 1.0, 5.0, 2.0]
    build = getattr(ga, make)
    opt = build(
        optax.sgd(0.0),
        4,
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator=estimator,
    )
    stats = opt.stats(_window(opt, grads, weights))
    # The first window's slot.
    slot = int(sampled_slot(0, 4)) if estimator == "sampled" else None
    grad_sq_norm, trace = _formula(grads, weights, slot)
    np.testing.assert_allclose(stats.grad_sq_norm, grad_sq_norm, rtol=1e-5)
    np.testing.assert_allclose(stats.noise_trace, trace, rtol=1e-5)
    # One window's |G|^2 estimate may be <= 0 (here the sampled one): B is +inf.
    ratio = trace / grad_sq_norm if grad_sq_norm > 0 else np.inf
    np.testing.assert_allclose(stats.noise_scale, ratio, rtol=1e-5)
    assert {v.dtype for v in stats[5:]} == {jnp.dtype(jnp.float32)}


def test_equal_weights_give_the_papers_two_batch_formulas():
    """B_small = b, B_big = k b (McCandlish et al. 2018, eq. A.2)."""
    grads = [[1.0, 2.0], [3.0, -1.0], [0.0, 1.5]]
    b = 4.0
    opt = ga.MultiSteps(
        optax.sgd(0.0), 3, track_noise_scale=True, noise_scale_decay=0.0, **ALL
    )
    stats = opt.stats(_window(opt, grads, [b] * 3))
    small = np.mean(np.sum(np.square(grads), axis=1))
    big_batch = 3 * b
    big = np.sum(np.mean(grads, axis=0) ** 2)
    paper_g2 = (big_batch * big - b * small) / (big_batch - b)
    paper_trace = (small - big) / (1 / b - 1 / big_batch)
    np.testing.assert_allclose(stats.grad_sq_norm, paper_g2, rtol=1e-5)
    np.testing.assert_allclose(stats.noise_trace, paper_trace, rtol=1e-5)


def test_moving_average_is_bias_corrected_and_b_is_a_ratio_of_averages():
    decay = 0.5
    opt = ga.MultiSteps(
        optax.sgd(0.0), 2, track_noise_scale=True, noise_scale_decay=decay, **ALL
    )
    first, second = [[3.0, 0.0], [3.0, 4.0]], [[1.0, 1.0], [-1.0, 2.0]]
    state = _window(opt, first + second, [1.0] * 4)
    (g1, t1), (g2, t2) = _formula(first, [1, 1]), _formula(second, [1, 1])
    norm = 1 - decay**2
    g_avg = (decay * (1 - decay) * g1 + (1 - decay) * g2) / norm
    t_avg = (decay * (1 - decay) * t1 + (1 - decay) * t2) / norm
    stats = opt.stats(state)
    np.testing.assert_allclose(stats.grad_sq_norm, g_avg, rtol=1e-5)
    np.testing.assert_allclose(stats.noise_trace, t_avg, rtol=1e-5)
    np.testing.assert_allclose(stats.noise_scale, t_avg / g_avg, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"track_noise_scale": True},
        {"every_k_schedule": ga.adaptive_every_k(1, 2, 8)},
        {"every_k_schedule": ga.adaptive_every_k(1, 2, 8), "track_noise_scale": True},
    ],
    ids=["tracked", "adaptive", "both"],
)
def test_the_noise_scale_is_one_statistic_kept_under_its_name(kwargs):
    """One noise scale, whichever asks for it, kept in ``statistics`` next
    to a statistic of the user's."""
    mine = ga.extend.WindowStatistic(
        init=lambda params, layout: jnp.zeros([], jnp.int32),
        observe=lambda state, grads, weight, position, layout: state + 1,
        window_terms=lambda state: (),
        with_window_terms=lambda state, terms: state,
        close=lambda state, window_sum, weight, position: state,
    )
    opt = ga.MultiSteps(
        optax.sgd(0.0),
        **{"every_k_schedule": 2, **kwargs},
        statistics={"micro_batches": mine},
        **ALL,
    )
    state = _window(opt, [[1.0, 0.0], [3.0, 4.0]], [1.0, 1.0])
    assert sorted(state.statistics) == ["micro_batches", "noise_scale"]
    assert isinstance(state.statistics["noise_scale"], ga.extend.NoiseScaleState)
    assert int(state.statistics["micro_batches"]) == 2
    # One window: the bias-corrected averages are its own estimates.
    g2, trace = _formula([[1.0, 0.0], [3.0, 4.0]], [1.0, 1.0])
    np.testing.assert_allclose(opt.stats(state).grad_sq_norm, g2, rtol=1e-5)
    np.testing.assert_allclose(opt.stats(state).noise_trace, trace, rtol=1e-5)


def test_nan_where_undefined_never_a_division_by_zero():
    # Not tracked.
    untracked = ga.MultiSteps(optax.sgd(0.0), 2)
    stats = untracked.stats(_window(untracked, [[1.0], [2.0]], [1, 1]))
    assert all(bool(jnp.isnan(v)) for v in stats[5:])
    assert untracked.init({"w": jnp.zeros(1)}).statistics == {}
    # A window of one micro-batch measures one batch size: no estimate.
    single = ga.MultiSteps(optax.sgd(0.0), 1, track_noise_scale=True)
    stats = single.stats(_window(single, [[1.0], [2.0], [5.0]], [1, 1, 1]))
    assert all(bool(jnp.isnan(v)) for v in stats[5:])
    # A window whose weight sits on one micro-batch (the others skipped).
    opt = ga.MultiSteps(optax.sgd(0.0), 3, track_noise_scale=True)
    state = _window(opt, [[1.0], [np.nan], [2.0]], [0.0, 0.0, 4.0])
    assert int(state.gradient_step) == 1
    assert (
        float(state.statistics["noise_scale"].sq_norm_sum),
        float(state.statistics["noise_scale"].micro_batches),
    ) == (
        0.0,
        0.0,
    )
    assert all(bool(jnp.isnan(v)) for v in opt.stats(state)[5:])


def test_zero_weight_micro_batches_are_not_counted_even_with_nans():
    opt = ga.MultiSteps(
        optax.sgd(0.0), 4, track_noise_scale=True, noise_scale_decay=0.0, **ALL
    )
    grads = [[1.0, 2.0], [np.nan, np.inf], [3.0, -1.0], [0.0, 1.0]]
    stats = opt.stats(_window(opt, grads, [2.0, 0.0, 1.0, 3.0]))
    g2, trace = _formula([grads[0], grads[2], grads[3]], [2.0, 1.0, 3.0])
    np.testing.assert_allclose(stats.grad_sq_norm, g2, rtol=1e-5)
    np.testing.assert_allclose(stats.noise_trace, trace, rtol=1e-5)


def test_reset_drops_the_partial_windows_terms_and_keeps_the_estimate():
    opt = ga.MultiSteps(
        optax.sgd(0.0), 2, track_noise_scale=True, noise_scale_decay=0.0, **ALL
    )
    state = _window(opt, [[3.0, 0.0], [3.0, 4.0], [100.0, 0.0]], [1.0] * 3)
    assert float(state.statistics["noise_scale"].sq_norm_sum) == 10000.0
    before = opt.stats(state)
    state = opt.reset(state)
    assert (
        float(state.statistics["noise_scale"].sq_norm_sum),
        float(state.statistics["noise_scale"].micro_batches),
    ) == (
        0.0,
        0.0,
    )
    assert float(opt.stats(state).noise_trace) == float(before.noise_trace)


def test_ternary_accumulate_refuses_the_noise_scale():
    """A ternary window's decoded sum carries the codes' rounding variance
    into |G_win|^2 and keeps no float sum to take it from: refused."""
    for kwargs in (
        {"track_noise_scale": True},
        {"every_k": ga.adaptive_every_k(1, 2, 8)},
    ):
        with pytest.raises(ValueError, match=r"cannot measure without bias") as error:
            ga.ternary_accumulate(optax.sgd(0.0), **{"every_k": 4, **kwargs})
        assert f"`{next(iter(kwargs))}`" in str(error.value)
    untracked = ga.ternary_accumulate(optax.sgd(0.0), 4)
    assert untracked.init({"w": jnp.zeros(4)}).statistics == {}


# --- linear regression: closed forms ---------------------------------------------

DIM, SIGMA = 4, 1.0
DELTA = jnp.array([0.5, -0.3, 0.2, 0.1])  # w - w*
# Per-example gradient (x.delta - eps) x with x ~ N(0, I), eps ~ N(0, sigma^2):
# G = delta, S = (|delta|^2 + sigma^2) I + delta delta^T (Isserlis).
TRUE_G2 = float(DELTA @ DELTA)
TRUE_TRACE = DIM * (TRUE_G2 + SIGMA**2) + TRUE_G2


def _regression_grad(w, x, y, mask):
    """Gradient of the masked mean of 0.5 (x.w - y)^2."""
    residual = (x @ w - y) * mask
    return residual @ x / jnp.maximum(mask.sum(), 1.0)


def _regression_estimates(
    sizes, seeds, use_microbatching=False, estimator="all", window=None
):
    """One window of micro-batches of ``sizes`` examples per seed (vmapped).

    Seed ``i``'s window is the ``i``-th of a run (its ``gradient_step``), so
    a sampled estimator draws its slot anew for each; with ``window`` every
    seed's window is that one (the same drawn slot).
    """
    sizes = np.asarray(sizes)
    k, width = len(sizes), int(sizes.max())
    mask = jnp.asarray(np.arange(width)[None, :] < sizes[:, None], jnp.float32)
    w_star = jnp.ones(DIM)
    w = w_star + DELTA

    def one_seed(key, window):
        kx, ke = jax.random.split(key)
        x = jax.random.normal(kx, (k, width, DIM))
        y = x @ w_star + SIGMA * jax.random.normal(ke, (k, width))
        if use_microbatching:
            fn = ga.microbatched_value_and_grad(
                lambda w, b: (
                    0.5
                    * jnp.sum(((b["x"] @ w - b["y"]) * b["m"]) ** 2)
                    / jnp.maximum(b["m"].sum(), 1.0)
                ),
                k,
                weight_fn=lambda b: b["m"].sum(),
                return_noise_scale=True,
            )
            # Strided split: micro-batch i holds rows i, i + k, ...
            batch = {
                "x": x.transpose(1, 0, 2).reshape(-1, DIM),
                "y": y.T.reshape(-1),
                "m": mask.T.reshape(-1),
            }
            _, _, estimate = fn(w, batch)
            return estimate.grad_sq_norm, estimate.noise_trace
        opt = ga.MultiSteps(
            optax.sgd(0.0),
            k,
            track_noise_scale=True,
            noise_scale_decay=0.0,
            noise_scale_estimator=estimator,
        )
        state = opt.init(w)._replace(gradient_step=window)

        def micro_step(state, micro_batch):
            xi, yi, mi = micro_batch
            g = _regression_grad(w, xi, yi, mi)
            _, state = opt.update(g, state, w, weight=mi.sum())
            return state, None

        state, _ = jax.lax.scan(micro_step, state, (x, y, mask))
        stats = opt.stats(state)
        return stats.grad_sq_norm, stats.noise_trace

    keys = jax.random.split(jax.random.key(0), seeds)
    windows = jnp.arange(seeds, dtype=jnp.int32)
    if window is not None:
        windows = jnp.full([seeds], window, jnp.int32)
    return jax.jit(jax.vmap(one_seed))(keys, windows)


@pytest.mark.parametrize(
    ("sizes", "microbatching", "estimator"),
    [
        pytest.param([4] * 8, False, "all", id="equal"),
        pytest.param([1, 2, 3, 4, 5, 6, 7, 12], False, "all", id="weighted"),
        pytest.param([1, 2, 3, 4, 5, 6, 7, 12], True, "all", id="microbatched"),
        pytest.param([4] * 8, False, "sampled", id="equal-sampled"),
        # Unbiased over the draws only: a window's m w_j is not W.
        pytest.param(
            [1, 2, 3, 4, 5, 6, 7, 12], False, "sampled", id="weighted-sampled"
        ),
    ],
)
def test_unbiased_against_closed_forms_on_linear_regression(
    sizes, microbatching, estimator
):
    """Each seed is a window of its own, so the sampled estimator's mean is
    over its draws as well as over the data. Its price is variance: one
    window's tr(S) spreads about 4x as wide as with every norm
    (`benchmarks/bench_noise_scale.py`), hence twice the seeds."""
    seeds = 4000 if estimator == "all" else 8000
    g2, trace = map(
        np.asarray, _regression_estimates(sizes, seeds, microbatching, estimator)
    )
    for values, truth in ((g2, TRUE_G2), (trace, TRUE_TRACE)):
        mean, error = values.mean(), values.std() / np.sqrt(seeds)
        assert abs(mean - truth) < 4 * error, (mean, truth, error)
        assert error < 0.06 * truth  # enough seeds for the test to have power
    # The window's norm alone (what one would log) is biased by tr(S) / W:
    # many standard errors away, so the test above can tell.
    naive = g2 + trace / np.sum(sizes)
    assert naive.mean() - TRUE_G2 > 10 * g2.std() / np.sqrt(seeds)


def _window_drawing(size, sizes, m):
    """The first window index whose drawn slot holds a micro-batch of ``size``."""
    return next(n for n in range(100) if sizes[int(sampled_slot(n, m))] == size)


@pytest.mark.parametrize("drawn_size", [2, 14])
def test_sampled_is_unbiased_for_each_drawn_slot_with_unequal_weights(drawn_size):
    """Micro-batches of 2 and 14 examples in turn: whichever is drawn, the
    window is measured at its two batch sizes (``w_j`` and ``W``), so the
    mean over seeds of one window's estimate (its slot the same for all)
    is the truth. Scaling the drawn norm to ``m w_j |g_j|^2`` instead is
    unbiased only over the draws: a drawn 2 gave tr(S) 45% low, a 14 48%
    high (B_simple 0.49x and 1.66x), and a run's windows draw the same
    slots for every seed."""
    sizes, seeds = [2, 14] * 4, 4000
    window = _window_drawing(drawn_size, sizes, len(sizes))
    g2, trace = map(
        np.asarray,
        _regression_estimates(sizes, seeds, estimator="sampled", window=window),
    )
    for values, truth in ((g2, TRUE_G2), (trace, TRUE_TRACE)):
        mean, error = values.mean(), values.std() / np.sqrt(seeds)
        assert abs(mean - truth) < 4 * error, (mean, truth, error)
        assert 4 * error < 0.2 * truth  # the test can tell a 45% bias
    # B_simple from the two means (as `stats` divides two averages).
    np.testing.assert_allclose(trace.mean() / g2.mean(), TRUE_TRACE / TRUE_G2, rtol=0.1)


# --- digits: brute force -----------------------------------------------------------


def _digits_problem():
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = jnp.asarray(digits.data / 16.0, jnp.float32)
    y = jnp.asarray(digits.target)
    k1, k2 = jax.random.split(jax.random.key(42))
    params = {
        "w1": 0.3 * jax.random.normal(k1, (64, 32)),
        "b1": jnp.zeros(32),
        "w2": 0.3 * jax.random.normal(k2, (32, 10)),
        "b2": jnp.zeros(10),
    }

    def loss(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, x, y, loss


def test_matches_a_brute_force_covariance_on_digits():
    params, x, y, loss = _digits_problem()
    # Brute force: every example's gradient; sampling with replacement makes
    # the population covariance of these the S of the estimator.
    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(
        params, x[:, None], y[:, None]
    )
    flat = jnp.concatenate(
        [g.reshape(len(x), -1) for g in jax.tree.leaves(per_example)], axis=1
    )
    mean = flat.mean(0)
    brute_g2 = float(mean @ mean)
    brute_trace = float(jnp.mean(jnp.sum((flat - mean) ** 2, axis=1)))

    k, b, seeds = 8, 16, 1000
    opt = ga.MultiSteps(
        optax.sgd(0.0), k, track_noise_scale=True, noise_scale_decay=0.0
    )
    grad = jax.grad(loss)

    def one_seed(key):
        index = jax.random.randint(key, (k, b), 0, len(x))

        def micro_step(state, i):
            _, state = opt.update(grad(params, x[i], y[i]), state, params, weight=b)
            return state, None

        state, _ = jax.lax.scan(micro_step, opt.init(params), index)
        stats = opt.stats(state)
        return stats.grad_sq_norm, stats.noise_trace

    keys = jax.random.split(jax.random.key(1), seeds)
    g2, trace = map(np.asarray, jax.jit(jax.vmap(one_seed))(keys))
    for values, truth in ((g2, brute_g2), (trace, brute_trace)):
        mean_value, error = values.mean(), values.std() / np.sqrt(seeds)
        assert abs(mean_value - truth) < 4 * error, (mean_value, truth, error)
        assert error < 0.1 * truth
    # B_simple from the averages, as the paper advises: within 10%.
    ratio = trace.mean() / g2.mean()
    assert abs(ratio / (brute_trace / brute_g2) - 1) < 0.1


def test_microbatched_estimate_equals_the_accumulators_on_the_same_batches():
    params, x, y, loss = _digits_problem()
    k, b = 4, 8
    batch = {"x": x[: k * b], "y": y[: k * b]}
    fn = ga.microbatched_value_and_grad(
        lambda p, mb: loss(p, mb["x"], mb["y"]), k, return_noise_scale=True
    )
    value, grads, estimate = jax.jit(fn)(params, batch)
    plain_value, plain_grads = ga.microbatched_value_and_grad(
        lambda p, mb: loss(p, mb["x"], mb["y"]), k
    )(params, batch)
    np.testing.assert_allclose(value, plain_value, rtol=1e-6)
    # The step's estimate measures every micro-batch: the "all" estimator.
    opt = ga.MultiSteps(
        optax.sgd(0.0), k, track_noise_scale=True, noise_scale_decay=0.0, **ALL
    )
    state = opt.init(params)
    for i in range(k):  # the strided micro-batches
        _, state = opt.update(
            jax.grad(loss)(params, x[i : k * b : k], y[i : k * b : k]), state, params
        )
    stats = opt.stats(state)
    assert isinstance(estimate, ga.NoiseScaleEstimate)
    np.testing.assert_allclose(estimate.grad_sq_norm, stats.grad_sq_norm, rtol=1e-4)
    np.testing.assert_allclose(estimate.noise_trace, stats.noise_trace, rtol=1e-4)
    np.testing.assert_allclose(estimate.noise_scale, stats.noise_scale, rtol=1e-4)


def test_microbatched_noise_scale_needs_no_data_axis():
    with pytest.raises(ValueError, match="`return_noise_scale`=True is not supported"):
        ga.microbatched_value_and_grad(
            lambda p, b: p, 2, data_axis="data", return_noise_scale=True
        )


# --- the sampled estimator: one micro-batch's norm per window --------------------


def _sampled(m, **kwargs):
    return ga.MultiSteps(
        optax.sgd(0.0), m, track_noise_scale=True, noise_scale_decay=0.0, **kwargs
    )


def test_sampled_records_w_j_g_j_squared_for_the_drawn_slot_only():
    """A holds ``w_j |g_j|^2`` from the micro-step that fills slot j (0
    before it), V its weight and n = 1, k counts every micro-batch of
    nonzero weight, and each window's estimate is the formula with them: one
    norm per window. A drawn micro-batch of weight 0 measures nothing: the
    estimate stays the last window's."""
    m, windows = 4, 24
    opt = _sampled(m)
    rs = np.random.RandomState(0)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    step = jax.jit(lambda g, w, s: opt.update({"w": g}, s, params, weight=w)[1])
    slots, grad_sq_norm, trace = [], np.nan, np.nan
    for window in range(windows):
        grads = rs.randn(m, 3).astype(np.float32)
        weights = rs.choice([0.0, 1.0, 2.0, 5.0], m).astype(np.float32)
        weights[:2] = [3.0, 1.0]  # k >= 2: an estimate
        slot = int(sampled_slot(window, m))
        slots.append(slot)
        sampled = weights[slot] * np.sum(grads[slot].astype(np.float64) ** 2)
        for i in range(m):
            state = step(grads[i], weights[i], state)
            if i < m - 1:  # the window is still open
                np.testing.assert_allclose(
                    state.statistics["noise_scale"].sq_norm_sum,
                    sampled if i >= slot else 0.0,
                    rtol=1e-6,
                )
                assert float(
                    state.statistics["noise_scale"].micro_batches
                ) == np.count_nonzero(weights[: i + 1])
                filled = i >= slot
                assert (
                    float(state.statistics["noise_scale"].measured_weight)
                    == weights[slot] * filled
                )
                assert (
                    float(state.statistics["noise_scale"].measured_count)
                    == (weights[slot] > 0) * filled
                )
        stats = opt.stats(state)
        if weights[slot] > 0:
            grad_sq_norm, trace = _formula(grads, weights, slot)
        # float32 sums, and both estimates are differences that may cancel.
        np.testing.assert_allclose(stats.grad_sq_norm, grad_sq_norm, rtol=1e-4)
        np.testing.assert_allclose(stats.noise_trace, trace, rtol=1e-4)
    # Every slot is drawn, none much more often than the others.
    assert sorted(set(slots)) == list(range(m)), slots
    assert max(np.bincount(slots)) <= 12, slots


def test_sampled_slot_is_uniform_and_a_function_of_the_window_only():
    draws = np.asarray(jax.vmap(lambda n: sampled_slot(n, 8))(jnp.arange(16000)))
    assert draws.dtype == np.int32 and draws.min() == 0 and draws.max() == 7
    # Each slot 2000 +- 4 standard deviations (sqrt(2000 * 7 / 8) = 42).
    assert np.abs(np.bincount(draws) - 2000).max() < 4 * 42, np.bincount(draws)
    again = np.asarray(jax.jit(jax.vmap(lambda n: sampled_slot(n, 8)))(jnp.arange(16)))
    np.testing.assert_array_equal(again, draws[:16])


@pytest.mark.parametrize("count_skipped", [False, True])
def test_sampled_slots_are_filled_micro_batches(count_skipped):
    """Without ``count_skipped`` a skipped micro-batch takes no slot: slot j
    is the (j+1)-th accepted micro-batch. With it, a skipped micro-batch in
    the drawn slot takes it with weight 0: the window measures nothing and
    gives no estimate."""
    m = 4
    opt = _sampled(m, skip_nonfinite=True, count_skipped=count_skipped)
    slot = int(sampled_slot(0, m))
    accepted = [[1.0, 2.0], [3.0, -1.0], [0.0, 1.5], [2.0, 2.0]]
    weights = [1.0, 2.0, 3.0, 4.0]
    grads, call_weights = list(accepted), list(weights)
    # A non-finite micro-batch where slot j would be filled.
    grads.insert(slot, [np.nan, 1.0])
    call_weights.insert(slot, 5.0)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    step = jax.jit(lambda g, w, s: opt.update({"w": g}, s, params, weight=w)[1])
    calls = 0
    for g, w in zip(grads, call_weights, strict=True):
        state, calls = step(jnp.asarray(g, jnp.float32), w, state), calls + 1
        if int(state.gradient_step) == 1:
            break
    # Counted, the skipped micro-batch closes the window one call early.
    assert calls == (m if count_skipped else m + 1)
    if count_skipped:  # the NaN took slot j with weight 0; the last waits
        window = [accepted[i] if i < slot else accepted[i - 1] for i in range(m)]
        window[slot] = [0.0, 0.0]
        window_weights = [weights[i] if i < slot else weights[i - 1] for i in range(m)]
        window_weights[slot] = 0.0
        assert float(state.statistics["noise_scale"].measured_count) == 0.0
        expected = (np.nan, np.nan)
    else:  # slot j is the next accepted micro-batch
        expected = _formula(accepted, weights, slot)
    stats = opt.stats(state)
    assert np.isnan(float(stats.noise_trace)) == count_skipped
    np.testing.assert_allclose(stats.grad_sq_norm, expected[0], rtol=1e-5)
    np.testing.assert_allclose(stats.noise_trace, expected[1], rtol=1e-5)


def test_a_flushed_window_is_measured_if_its_drawn_slot_was_filled():
    """A window closed before its m slots are filled (`flush`) still holds
    two batch sizes: the drawn micro-batch and the window. Its estimate is
    the formula on the micro-batches seen if slot j was among them; if not,
    nothing was measured and the averages stay as they are."""
    m, seen = 4, 3
    rs = np.random.RandomState(2)
    params = {"w": jnp.zeros(2)}
    opt = _sampled(m)
    flush = jax.jit(lambda s: opt.flush(s, params)[1])
    step = jax.jit(lambda g, w, s: opt.update({"w": g}, s, params, weight=w)[1])
    state, outcomes = opt.init(params), set()
    for window in range(8):
        grads = rs.randn(seen, 2).astype(np.float32)
        weights = rs.choice([1.0, 2.0, 5.0], seen).astype(np.float32)
        before = opt.stats(state)
        for g, w in zip(grads, weights, strict=True):
            state = step(g, w, state)
        state = flush(state)
        assert int(state.gradient_step) == window + 1
        stats = opt.stats(state)
        slot = int(sampled_slot(window, m))
        outcomes.add(slot < seen)
        if slot < seen:
            grad_sq_norm, trace = _formula(grads, weights, slot)
            np.testing.assert_allclose(stats.noise_trace, trace, rtol=1e-4)
            np.testing.assert_allclose(stats.grad_sq_norm, grad_sq_norm, rtol=1e-4)
        else:
            np.testing.assert_array_equal(stats.noise_trace, before.noise_trace)
    assert outcomes == {True, False}  # both cases were drawn


def test_sampled_run_resumes_bitwise_from_a_checkpoint():
    """No PRNG state: the slot is drawn from the window's index, so a state
    restored mid-window (through numpy, as a checkpoint) goes on bit for bit."""
    opt = ga.MultiSteps(
        optax.adam(1e-2), 3, track_noise_scale=True, noise_scale_decay=0.5
    )
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    rs = np.random.RandomState(3)
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rs.randn(*p.shape), jnp.float32), params)
        for _ in range(20)
    ]

    @jax.jit
    def step(params, state, g):
        updates, state = opt.update(g, state, params, weight=2.0)
        return optax.apply_updates(params, updates), state

    def run(params, state, grads):
        for g in grads:
            params, state = step(params, state, g)
        return params, state

    mid = run(params, opt.init(params), grads[:10])
    assert int(mid[1].mini_step) == 1  # mid-window
    through = run(*mid, grads[10:])
    restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), mid)
    resumed = run(*restored, grads[10:])
    assert jax.tree.structure(resumed) == jax.tree.structure(through)
    for a, b in zip(jax.tree.leaves(through), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(float(opt.stats(through[1]).noise_scale))


def test_sampled_bfloat16_gradients_are_measured_in_float32():
    m = 4
    opt = _sampled(m)
    params = {"w": jnp.zeros(64, jnp.bfloat16)}
    rs = np.random.RandomState(4)
    grads = [jnp.asarray(rs.randn(64), jnp.bfloat16) for _ in range(m)]
    weights = [2.0, 1.0, 3.0, 1.0]
    state = opt.init(params)
    for g, w in zip(grads[:-1], weights[:-1], strict=True):
        _, state = opt.update({"w": g}, state, params, weight=w)
    slot = int(sampled_slot(0, m))
    as_float = [np.asarray(g, np.float64) for g in grads]
    assert state.statistics["noise_scale"].sq_norm_sum.dtype == jnp.float32
    if slot < m - 1:
        np.testing.assert_allclose(
            state.statistics["noise_scale"].sq_norm_sum,
            weights[slot] * np.sum(as_float[slot] ** 2),
            rtol=1e-6,
        )
    _, state = opt.update({"w": grads[-1]}, state, params, weight=weights[-1])
    stats = opt.stats(state)
    assert {v.dtype for v in stats[5:]} == {jnp.dtype(jnp.float32)}
    grad_sq_norm, trace = _formula(as_float, weights, slot)
    # The window sums bf16 gradients in float32: exact up to float32 rounding.
    np.testing.assert_allclose(stats.grad_sq_norm, grad_sq_norm, rtol=1e-4)
    np.testing.assert_allclose(stats.noise_trace, trace, rtol=1e-4)


# Per-device terms (`unreduced_axes`): each device's gradient of a micro-batch
# is a small batch of its own; the sampled micro-batch's terms, on every device.

MESHES = {
    "1d-explicit": ((8,), ("data",), AxisType.Explicit),
    "1d-auto": ((8,), ("data",), AxisType.Auto),
    "2d-explicit": ((4, 2), ("data", "model"), AxisType.Explicit),
}


def _device_loss(params, x, y, mask):
    """A device's masked mean loss and its number of valid examples."""
    errors = jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2, axis=-1)
    count = jnp.sum(mask)
    return jnp.sum(mask * errors) / jnp.maximum(count, 1.0), count


def _device_terms(params, batch, devices, weighted):
    """A micro-batch on the host: ``sum_d w_d |g_d|^2``, k, ``sum_d w_d (g_d)``.

    Weighted: ``w_d`` is device d's number of valid examples. Unweighted:
    each device's term is ``g_d / n`` of a micro-batch of weight 1, so
    ``w_d = 1 / n``.
    """
    a = k = total = grad_sum = 0.0
    for x, y, mask in zip(*(np.split(part, devices) for part in batch), strict=True):
        grads = jax.grad(lambda *args: _device_loss(*args)[0])(params, x, y, mask)
        g = np.concatenate([np.ravel(grads[name]) for name in sorted(grads)])
        g = g.astype(np.float64)
        w = float(mask.sum()) if weighted else 1.0 / devices
        if w:
            a, k = a + w * np.sum(g**2), k + 1
        total, grad_sum = total + w, grad_sum + w * g
    return a, k, total, grad_sum


def _per_device_run(m, weighted, estimator):
    """``(opt, jitted step, jitted reduce_window)`` on per-device terms."""
    opt = ga.MultiSteps(
        optax.sgd(0.0),
        m,
        unreduced_axes="data",
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator=estimator,
    )
    grad_fn = ga.local_value_and_grad(
        _device_loss if weighted else (lambda *args: _device_loss(*args)[0]),
        "data",
        has_weight=weighted,
    )

    def step(params, state, x, y, mask):
        if weighted:
            (_, weight), grads = grad_fn(params, x, y, mask)
            return opt.update(grads, state, params, weight=weight)[1]
        return opt.update(grad_fn(params, x, y, mask)[1], state, params)[1]

    return opt, jax.jit(step), jax.jit(opt.reduce_window)


# Each mesh once, weighted where the weights can go wrong apart from the
# mesh (the 1-D Explicit terms, and the 2-D mesh whose output layer is
# gathered before its norm), unweighted on the stacked Auto terms.
@pytest.mark.parametrize(
    ("mesh_name", "weighted"),
    [("1d-explicit", True), ("1d-auto", False), ("2d-explicit", True)],
    ids=["1d-explicit-weighted", "1d-auto-unweighted", "2d-explicit-weighted"],
)
def test_sampled_per_device_terms_are_the_drawn_micro_batchs(mesh_name, weighted):
    """Each device adds its own term of the drawn micro-batch, the same slot
    on every device (n counts the devices' terms in it, V their weight); k
    counts every (device, micro-batch) pair of nonzero weight. Both
    estimators against the devices' gradients taken apart on the host."""
    shape, axes, axis_type = MESHES[mesh_name]
    devices, m, windows = shape[0], 3, 3
    rs = np.random.RandomState(5)
    batches = [
        (
            rs.randn(32, 16).astype(np.float32),
            rs.randn(32, 4).astype(np.float32),
            (rs.rand(32) < 0.6).astype(np.float32),
        )
        for _ in range(m * windows)
    ]
    k1, k2 = jax.random.split(jax.random.key(0))
    host_params = {
        "w1": np.asarray(jax.random.normal(k1, (16, 8)) * 0.3),
        "w2": np.asarray(jax.random.normal(k2, (8, 4)) * 0.3),
    }
    terms = [_device_terms(host_params, b, devices, weighted) for b in batches]
    runs = {name: _per_device_run(m, weighted, name) for name in ("all", "sampled")}
    mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))
    with jax.set_mesh(mesh):
        # On the 2-D mesh the output layer is tensor-parallel over `model`:
        # each device's term of it is gathered whole before its squared norm.
        specs = (
            {"w1": P(), "w2": P(None, "model")}
            if "model" in axes
            else {"w1": P(), "w2": P()}
        )
        params = jax.tree.map(jax.device_put, host_params, specs)
        states = {name: jax.jit(run[0].init)(params) for name, run in runs.items()}
        for window in range(windows):
            slot = int(sampled_slot(window, m))
            window_terms = terms[window * m : (window + 1) * m]
            for i in range(m):
                placed = [
                    jax.device_put(part, P("data")) for part in batches[window * m + i]
                ]
                for name, (_, step, _) in runs.items():
                    states[name] = step(params, states[name], *placed)
                if i < m - 1:  # open: the sampled A holds the drawn terms
                    noise = runs["sampled"][2](states["sampled"]).statistics[
                        "noise_scale"
                    ]
                    np.testing.assert_allclose(
                        float(noise.sq_norm_sum),
                        window_terms[slot][0] if i >= slot else 0.0,
                        rtol=1e-5,
                    )
                    assert float(noise.micro_batches) == sum(
                        t[1] for t in window_terms[: i + 1]
                    )
            a_all, k, total = (sum(t[j] for t in window_terms) for j in range(3))
            mean_sq = np.sum((sum(t[3] for t in window_terms) / total) ** 2)
            drawn = window_terms[slot]
            for name, (a, v, n) in (
                ("all", (a_all, total, k)),
                ("sampled", (drawn[0], drawn[2], drawn[1])),
            ):
                stats = runs[name][0].stats(states[name])
                trace = (a - v * mean_sq) / (n - v / total)
                np.testing.assert_allclose(
                    stats.noise_trace, trace, rtol=1e-4, err_msg=name
                )
                np.testing.assert_allclose(
                    stats.grad_sq_norm,
                    mean_sq - trace / total,
                    rtol=1e-4,
                    atol=1e-4 * abs(trace / total),
                    err_msg=name,
                )


# A ternary window reduction: the codes' rounding is subtracted from C.

TERNARY_DIM, TERNARY_K, TERNARY_EXAMPLES = 256, 4, 4  # examples per device
TERNARY_DELTA = jnp.full(TERNARY_DIM, 1 / 16.0)  # |G|^2 = 1
TERNARY_TRACE = TERNARY_DIM * (1 + SIGMA**2) + 1  # tr(S) = B_simple = 513


def _ternary_window_estimates(axis_type, windows):
    """Per window ``(|G|^2, tr(S))`` of a ternary-reduced window over 8
    devices, each with its own examples of the closed-form regression."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    opt = ga.MultiSteps(
        optax.sgd(0.0),
        TERNARY_K,
        unreduced_axes="data",
        window_reduction=ga.ternary_window_reduction(0),
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator="all",
    )
    grad_fn = ga.local_value_and_grad(
        lambda w, x, y: (0.5 * jnp.mean((x @ w - y) ** 2), jnp.float32(len(y))),
        "data",
        has_weight=True,
    )
    rows = 8 * TERNARY_EXAMPLES
    explicit = axis_type == AxisType.Explicit
    place = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
    with jax.set_mesh(mesh):
        w = jax.device_put(TERNARY_DELTA, P())  # w* = 0

        def micro_step(state, key):
            kx, ke = jax.random.split(key)
            x = jax.random.normal(kx, (rows, TERNARY_DIM))
            y = SIGMA * jax.random.normal(ke, (rows,))
            x, y = (place(v, P("data")) for v in (x, y))
            (_, weight), grads = grad_fn(w, x, y)
            _, state = opt.update(grads, state, w, weight=weight)
            stats = opt.stats(state)
            return state, (
                stats.grad_sq_norm,
                stats.noise_trace,
                opt.has_updated(state),
            )

        run = jax.jit(lambda state, keys: jax.lax.scan(micro_step, state, keys)[1])
        keys = jax.random.split(jax.random.key(0), windows * TERNARY_K)
        g2, trace, emitted = map(np.asarray, run(jax.jit(opt.init)(w), keys))
    return g2[emitted].astype(np.float64), trace[emitted].astype(np.float64)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_ternary_window_reduction_noise_scale_is_unbiased(axis_type):
    """The decoded window's squared norm holds the codes' rounding variance
    (and lacks what clipping cut): the reduction reports that excess and
    the estimator subtracts it. Before, |G|^2 came out about 7x the truth
    and B_simple about 0.13x."""
    windows = 150
    g2, trace = _ternary_window_estimates(axis_type, windows)
    assert len(g2) == windows
    for values, truth in ((g2, 1.0), (trace, TERNARY_TRACE)):
        mean, error = values.mean(), values.std() / np.sqrt(windows)
        assert abs(mean - truth) < 4 * error, (mean, truth, error)
        assert error < 0.1 * truth  # the test can tell
    np.testing.assert_allclose(trace.mean() / g2.mean(), TERNARY_TRACE, rtol=0.3)


# --- the adaptive window -----------------------------------------------------------


def test_adaptive_window_follows_b_simple_at_window_boundaries_only():
    # Windows of 2, g = a + n then a - n: tr(S) = 2 |n|^2 = 8,
    # |G|^2 = |a|^2 - |n|^2 = 5, B_simple = 1.6 micro-batches;
    # micro_batch_size 0.25 asks for 6.4 -> 6. A window of 6 alternating
    # ones: A = 78, C = 9, W = 6: tr(S) = 4.8, |G|^2 = 8.2, B = 0.585 -> 2.
    opt = ga.MultiSteps(
        optax.sgd(1.0), ga.adaptive_every_k(0.25, 2, 10), noise_scale_decay=0.0
    )
    params = jnp.zeros(2)
    state = opt.init(params)
    assert state.window_size.dtype == jnp.int32 and int(state.window_size) == 2
    a, n = jnp.array([3.0, 0.0]), jnp.array([0.0, 2.0])
    sizes, emitted = [], []
    step = jax.jit(lambda g, s: opt.update(g, s, params))
    for i in range(2 + 6 + 6):
        g = a + n if i % 2 == 0 else a - n
        _, state = step(g, state)
        sizes.append(int(opt.stats(state).window_size))
        emitted.append(bool(opt.has_updated(state)))
    np.testing.assert_allclose(opt.stats(state).noise_scale, 1.6, rtol=1e-6)
    assert sizes == [2] + [6] * 6 + [2, 2] + [6] * 5
    assert [i for i, e in enumerate(emitted) if e] == [1, 7, 9]
    # Bounded: a tiny micro-batch asks for more than k_max.
    bounded = ga.MultiSteps(
        optax.sgd(1.0), ga.adaptive_every_k(0.01, 2, 10), noise_scale_decay=0.0
    )
    state = bounded.init(params)
    for g in (a + n, a - n):
        _, state = bounded.update(g, state, params)
    assert int(state.window_size) == 10


def test_adaptive_window_is_in_the_state_and_survives_a_round_trip():
    tx = ga.accumulate(optax.sgd(1.0), ga.adaptive_every_k(0.25, 2, 10))
    params = jnp.zeros(2)
    state = tx.init(params)
    for g in ([3.0, 2.0], [3.0, -2.0], [1.0, 0.0]):
        _, state = tx.update(jnp.asarray(g), state, params)
    restored = jax.tree.unflatten(
        jax.tree.structure(state), [np.asarray(v) for v in jax.tree.leaves(state)]
    )
    for g in ([1.0, 1.0], [2.0, 0.0]):
        out_a, state = tx.update(jnp.asarray(g), state, params)
        out_b, restored = tx.update(jnp.asarray(g), restored, params)
        np.testing.assert_array_equal(out_a, out_b)
    assert int(state.window_size) == int(restored.window_size) > 2


def _device_gradients(steps, devices=8, dim=16):
    """Per-device gradients ``0.5 + s_d noise``: exact on half the devices
    (B_simple 0: k_min), noisy on the others (B_simple 144 / 4: k_max)."""
    noise = jax.random.normal(jax.random.key(7), (steps, devices, dim))
    spread = jnp.where(jnp.arange(devices) < devices // 2, 0.0, 3.0)
    return 0.5 + spread[None, :, None] * noise


def _pmapped(opt, params):
    step = jax.pmap(lambda g, s: opt.update(g, s, params), axis_name="devices")
    state = jax.pmap(lambda _: opt.init(params), axis_name="devices")(jnp.arange(8))
    return step, state


def test_adaptive_window_under_pmap_is_one_size_for_all_devices():
    """Each device estimates from its own gradients: alone, half the devices
    pick k_min and half k_max after the first window, and with an
    average_across_devices inside, those closing first would wait in its
    all-reduce forever. With ``axis_name`` the window's estimate is the
    devices' mean: one size on every device, and the run goes on."""
    params = jnp.zeros(16)
    grads = _device_gradients(2 + 8 + 8)
    local = ga.MultiSteps(optax.sgd(1.0), ga.adaptive_every_k(1, 2, 8))
    step, state = _pmapped(local, params)
    for g in grads[:2]:
        _, state = step(g, state)
    sizes = np.asarray(state.window_size)
    assert set(sizes[:4]) == {2} and min(sizes[4:]) > 2, sizes

    inner = optax.chain(ga.average_across_devices("devices"), optax.sgd(1.0))
    shared = ga.MultiSteps(inner, ga.adaptive_every_k(1, 2, 8, axis_name="devices"))
    step, state = _pmapped(shared, params)
    emitted = []
    for i, g in enumerate(grads):
        updates, state = step(g, state)
        updates.block_until_ready()
        # Checked before the next call: a disagreement never reaches a hang.
        assert len(set(np.asarray(state.window_size).tolist())) == 1, (i, state)
        emitted.append(bool(np.asarray(shared.has_updated(state))[0]))
    assert int(state.window_size[0]) == 8
    assert [i for i, e in enumerate(emitted) if e] == [1, 9, 17]
    # The mean gradient is the same on every device.
    np.testing.assert_array_equal(updates, np.broadcast_to(updates[0], updates.shape))
    stats = jax.vmap(shared.stats)(state)
    assert len(set(np.asarray(stats.noise_scale).tolist())) == 1


@pytest.mark.parametrize("mapped", ["pmap", "shard_map"])
def test_adaptive_window_without_axis_name_is_refused_where_devices_communicate(
    mapped,
):
    inner = optax.chain(ga.average_across_devices("devices"), optax.sgd(1.0))
    opt = ga.MultiSteps(inner, ga.adaptive_every_k(1, 2, 8))
    params = jnp.zeros(16)
    grads = _device_gradients(1)[0]
    with pytest.raises(ValueError, match=r"axis_name='devices'") as error:
        if mapped == "pmap":
            _pmapped(opt, params)[0](grads, _pmapped(opt, params)[1])
        else:
            mesh = jax.make_mesh((8,), ("devices",))

            @jax.shard_map(mesh=mesh, in_specs=P("devices"), out_specs=P("devices"))
            def step(g):
                _, state = opt.update(g[0], opt.init(params), params)
                return state.window_size[None]

            step(jax.device_put(grads, jax.NamedSharding(mesh, P("devices"))))
    assert "wait in that collective forever" in str(error.value)


def test_adaptive_axis_name_is_refused_with_unreduced_axes():
    """With per-device terms the estimate is already the devices' together."""
    with pytest.raises(ValueError, match=r"`axis_name` of adaptive_every_k.*"):
        ga.MultiSteps(
            optax.sgd(1.0),
            ga.adaptive_every_k(1, 2, 8, axis_name="data"),
            unreduced_axes="data",
        )


# --- cost ----------------------------------------------------------------------


def test_tracking_adds_no_parameter_sized_temporary():
    """Not at the emission either: the window's norm is read before the
    update overwrites its buffers (`_noise_scale.close_window`). Gradients
    come in as buffers, as from a backward pass; a gradient that XLA could
    fuse into the add (an elementwise producer) is materialized, as XLA:CPU
    has no multi-output fusion of a reduction with a loop."""
    params = {"w": jnp.zeros((1 << 16,)), "b": jnp.zeros((1 << 10,))}
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    off = train_step_temp_bytes(ga.accumulate(optax.adam(1e-3), 4), params)
    on = train_step_temp_bytes(
        ga.accumulate(optax.adam(1e-3), 4, track_noise_scale=True), params
    )
    assert on - off < 0.05 * param_bytes, (on, off, param_bytes)
