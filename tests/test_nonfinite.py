"""What every transformation does with NaN/Inf gradients (the docs table).

One test per row of the table in docs/guides/nonfinite.md, so the table
cannot drift from the code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

NAN = float("nan")
N = jax.local_device_count()


def feed(tx, values, params=None, weights=None):
    """Feeds scalar gradients {"a": v}; returns the updates and final state."""
    params = {"a": jnp.zeros([])} if params is None else params
    state = tx.init(params)
    update = jax.jit(tx.update)
    outputs = []
    for i, value in enumerate(values):
        kwargs = {} if weights is None else {"weight": weights[i]}
        updates, state = update({"a": jnp.asarray(value)}, state, params, **kwargs)
        outputs.append(float(updates["a"]))
    return outputs, state


def test_multisteps_without_skip_function_spoils_one_window():
    outputs, _ = feed(ga.MultiSteps(optax.sgd(1.0), 2), [NAN, 1.0, 2.0, 4.0])
    assert np.isnan(outputs[1])
    assert outputs[2:] == [0.0, -3.0]


def test_multisteps_of_adam_is_spoiled_for_good_by_one_nan_micro_batch():
    # The accumulator is reset, but the NaN window's mean reaches adam's
    # moments, and every later update is NaN: only a stateless optimizer
    # (sgd above) recovers by itself.
    outputs, state = feed(ga.MultiSteps(optax.adam(0.1), 2), [NAN, 1.0, 2.0, 4.0])
    assert np.isnan(outputs[1]) and np.isnan(outputs[3])
    assert np.isnan(float(state.inner_opt_state[0].mu["a"]))


def test_remedies_keep_adam_finite():
    values = [NAN, 1.0, 2.0, 4.0, 1.0]
    adam = optax.adam(0.1)
    # Dropped (window of 2 accepted micro-batches: 1, 2 | 4, 1).
    dropped, _ = feed(ga.MultiSteps(adam, 2, skip_nonfinite=True), values)
    # Dropped before it reaches the accumulator, by optax.
    outside, _ = feed(
        optax.apply_if_finite(ga.MultiSteps(adam, 2).gradient_transformation(), 5),
        values,
    )
    # Counted with weight 0 (windows of 2 calls: NaN, 1 | 2, 4 | 1).
    in_place, _ = feed(ga.accumulate(adam, 2, skip_nonfinite=True), values)

    def adam_on(*means):
        updates, state = [], adam.init({"a": jnp.zeros([])})
        for mean in means:
            update, state = adam.update({"a": jnp.asarray(mean)}, state)
            updates.append(float(update["a"]))
        return updates

    first, second = adam_on(1.5, 2.5)
    np.testing.assert_allclose(dropped, [0.0, 0.0, first, 0.0, second], rtol=1e-6)
    np.testing.assert_allclose(outside, dropped, rtol=1e-6)
    first, second = adam_on(1.0, 3.0)
    np.testing.assert_allclose(in_place, [0.0, first, 0.0, second, 0.0], rtol=1e-6)
    assert np.all(np.isfinite(dropped + outside + in_place))


def test_multisteps_skip_not_finite_drops_the_micro_batch():
    tx = ga.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=ga.skip_not_finite)
    outputs, state = feed(tx, [1.0, NAN, 3.0])
    assert outputs == [0.0, 0.0, -2.0]
    assert int(state.skip_state["num_not_finite"]) == 0  # of the last call


def test_accumulate_skip_nonfinite_gives_weight_zero_in_place():
    tx = ga.accumulate(optax.sgd(1.0), 2, skip_nonfinite=True)
    outputs, _ = feed(tx, [1.0, float("inf"), 3.0, 5.0])
    assert outputs == [0.0, -1.0, 0.0, -4.0]


def test_count_skipped_alone_skips_nothing():
    # docs/guides/data_parallel.md: count_skipped only says how a skipped
    # micro-batch counts; it takes skip_nonfinite or a skip function to skip.
    alone, _ = feed(
        ga.MultiSteps(optax.sgd(1.0), 3, count_skipped=True), [1.0, NAN, 4.0]
    )
    assert alone[:2] == [0.0, 0.0] and np.isnan(alone[2])
    tx = ga.MultiSteps(optax.sgd(1.0), 3, skip_nonfinite=True, count_skipped=True)
    skipped, state = feed(tx, [1.0, NAN, 4.0])
    assert skipped == [0.0, 0.0, -2.5]  # the NaN counts with weight 0
    assert bool(tx.has_updated(state))


def test_zero_weight_micro_batch_may_hold_nan():
    outputs, _ = feed(ga.MultiSteps(optax.sgd(1.0), 2), [NAN, 6.0], weights=[0, 3])
    assert outputs == [0.0, -6.0]


def test_clip_by_global_norm_reports_a_nan_norm_and_passes_nan_on():
    tx = ga.clip_by_global_norm(1.0)
    updates, state = tx.update({"a": jnp.array([NAN, 1.0])}, tx.init(None))
    assert np.isnan(float(state.global_norm)) and bool(state.clipped)
    assert np.isnan(np.asarray(updates["a"])).all()


def test_clip_keeps_nan_and_clips_inf():
    updates, _ = ga.clip(1.0).update({"a": jnp.array([NAN, jnp.inf, -jnp.inf])}, None)
    np.testing.assert_array_equal(updates["a"], [NAN, 1.0, -1.0])


def test_average_across_devices_spreads_nan_unless_its_weight_is_zero():
    averager = ga.average_across_devices("d")
    grads = jnp.ones((N,)).at[0].set(NAN)

    def average(g, w):
        return averager.update({"a": g}, averager.init(None), weight=w)[0]["a"]

    weighted = jax.pmap(average, axis_name="d")(grads, jnp.ones((N,)).at[0].set(0))
    np.testing.assert_array_equal(weighted, np.ones(N))
    plain = jax.pmap(lambda g: average(g, None), axis_name="d")(grads)
    assert np.isnan(np.asarray(plain)).all()


def test_ternary_quantize_scale_of_zero_and_nonfinite_tensors():
    codes, scale = ga.ternary_quantize(jnp.zeros(8), jax.random.key(0))
    assert float(scale) == 0.0 and not np.asarray(codes).any()
    codes, scale = ga.ternary_quantize(jnp.ones(8).at[3].set(jnp.inf))
    assert np.isnan(float(scale))
    assert np.isnan(np.asarray(ga.ternary_dequantize(codes, scale))).all()


def test_ternarize_passes_nan_on_and_keeps_its_residual():
    tx = ga.ternarize(0, stochastic=False, min_size=1)
    params = {"a": jnp.zeros(4)}
    state = tx.init(params)
    _, state = tx.update({"a": jnp.array([1.0, 2.0, 3.0, 4.0])}, state)
    residual = np.asarray(state.residual["a"])
    updates, state = tx.update({"a": jnp.array([1.0, NAN, 3.0, 4.0])}, state)
    assert np.isnan(np.asarray(updates["a"])).all()
    np.testing.assert_array_equal(state.residual["a"], residual)


def test_ternary_accumulate_spoils_one_window():
    tx = ga.ternary_accumulate(optax.sgd(1.0), 2, min_size=1, clip_sigma=None)
    params = {"a": jnp.zeros(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    window = [jnp.array([1.0, NAN, 1.0, 1.0]), jnp.ones(4)]
    for grads in window:
        updates, state = update({"a": grads}, state, params)
    assert np.isnan(np.asarray(updates["a"])).all()
    for grads in [jnp.ones(4), jnp.ones(4)]:
        updates, state = update({"a": grads}, state, params)
    # Codes of a constant tensor are exact: sign 1 with probability 1.
    np.testing.assert_array_equal(updates["a"], -np.ones(4))


def test_microbatched_value_and_grad_drops_zero_weight_nan_micro_batches():
    def loss_fn(w, batch):
        mask = batch["mask"]
        return jnp.sum(mask * (w * batch["x"]) ** 2) / jnp.sum(mask)  # 0/0: NaN

    grad_fn = ga.microbatched_value_and_grad(
        loss_fn, 2, weight_fn=lambda mb: mb["mask"].sum()
    )
    # Strided split: micro-batch 0 holds examples 0 and 2, micro-batch 1
    # holds examples 1 and 3, which are both padding.
    batch = {"x": jnp.array([1.0, 5.0, 3.0, 7.0]), "mask": jnp.array([1, 0, 1, 0.0])}
    loss, grad = grad_fn(jnp.asarray(2.0), batch)
    assert float(loss) == 20.0  # (4 + 36) / 2
    assert float(grad) == 20.0  # d/dw of (w^2 (1 + 9)) / 2 at w = 2
