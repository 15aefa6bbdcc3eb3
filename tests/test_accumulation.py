"""Tests for gradaccum_jax._accumulation: MultiSteps and accumulate.

optax's own MultiSteps tests run against ours in test_optax_compat.py; this
file pins what ours does beyond them.
"""

import copy
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax
from gradaccum_jax import MultiSteps, accumulate
from helpers import EAGER_AND_JIT, compiled_reference, train_step_temp_bytes


def scalar_grads(*values):
    return [{"a": jnp.asarray(v, jnp.float32)} for v in values]


def run(tx, grads_seq, params=None, weights=None, compile_fn=jax.jit, **extra):
    """Feeds a sequence of gradients; returns (list of updates, final state)."""
    params = (
        params if params is not None else jax.tree.map(jnp.zeros_like, grads_seq[0])
    )
    state = tx.init(params)
    update = compile_fn(tx.update)
    outputs = []
    for i, grads in enumerate(grads_seq):
        kwargs = dict(extra)
        if weights is not None:
            kwargs["weight"] = weights[i]
        updates, state = update(grads, state, params, **kwargs)
        outputs.append(updates)
    return outputs, state


def counting_transformation(counter):
    """Identity whose update reports each execution through a host callback."""

    def update_fn(updates, state, params=None):
        jax.debug.callback(lambda: counter.append(1))
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def weight_echo():
    """Returns the `weight` extra argument it receives, shaped like the updates."""

    def update_fn(updates, state, params=None, *, weight=None, **extra_args):
        return jax.tree.map(lambda u: jnp.full_like(u, weight), updates), state

    return optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(), update_fn
    )


@EAGER_AND_JIT
def test_emits_mean_every_k_and_zeros_otherwise(compile_fn):
    opt = MultiSteps(optax.sgd(1.0), 3)
    outputs, state = run(opt, scalar_grads(1, 2, 6, 10, 20, 30), compile_fn=compile_fn)
    np.testing.assert_array_equal(
        [float(u["a"]) for u in outputs], [0, 0, -3, 0, 0, -20]
    )
    assert int(state.gradient_step) == 2
    assert int(state.mini_step) == 0
    assert bool(opt.has_updated(state))


def test_sum_instead_of_mean():
    opt = MultiSteps(optax.scale(1.0), 2, use_grad_mean=False)
    outputs, _ = run(opt, scalar_grads(1.5, 2.25))
    assert float(outputs[1]["a"]) == 3.75


def test_inner_optimizer_runs_only_on_emitting_steps():
    counter = []
    opt = MultiSteps(optax.chain(counting_transformation(counter), optax.sgd(0.1)), 4)
    run(opt, scalar_grads(*range(12)))
    jax.effects_barrier()
    assert len(counter) == 3  # optax.MultiSteps runs it 12 times


def test_inner_optimizer_state_only_advances_at_emission():
    opt = MultiSteps(optax.adam(0.1), 4)
    _, state = run(opt, scalar_grads(1, 2, 3))
    assert int(state.inner_opt_state[0].count) == 0
    _, state = run(opt, scalar_grads(1, 2, 3, 4, 5))
    assert int(state.inner_opt_state[0].count) == 1


def test_nan_micro_batch_spoils_only_its_own_window():
    grads = scalar_grads(1, float("nan"), 3, 4, 5, 6)
    ours, _ = run(MultiSteps(optax.sgd(1.0), 2), grads)
    theirs, _ = run(optax.MultiSteps(optax.sgd(1.0), 2), grads)
    ours = [float(u["a"]) for u in ours]
    assert np.isnan(ours[1])
    np.testing.assert_array_equal(ours[2:], [0.0, -3.5, 0.0, -5.5])
    # optax resets the accumulator by multiplying with 0; 0 * NaN stays NaN.
    assert np.isnan(float(theirs[3]["a"])) and np.isnan(float(theirs[5]["a"]))


def test_has_updated_is_exact_after_a_skipped_step():
    opt = MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=gradaccum_jax.skip_not_finite
    )
    reference = optax.MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
    )
    grads = scalar_grads(1, 2, float("inf"))
    _, state = run(opt, grads)
    _, ref_state = run(reference, grads)
    assert not bool(opt.has_updated(state))
    assert bool(reference.has_updated(ref_state))  # optax's stays True
    assert int(state.skip_state["num_not_finite"]) == 1


def test_skipped_micro_batch_leaves_window_untouched():
    opt = MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=gradaccum_jax.skip_not_finite
    )
    outputs, state = run(opt, scalar_grads(1, float("nan"), 5))
    assert [float(u["a"]) for u in outputs] == [0.0, 0.0, -3.0]
    assert int(state.micro_steps) == 2
    assert int(state.gradient_step) == 1


@EAGER_AND_JIT
def test_weighted_window_equals_big_batch_gradient(compile_fn):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype(np.float32)
    y = rng.normal(size=(10,)).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=(3,)), jnp.float32), "b": jnp.zeros(())}

    def loss(params, x, y):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    sizes = [1, 4, 2, 3]
    bounds = np.cumsum([0, *sizes])
    micro_grads = [
        jax.grad(loss)(params, x[lo:hi], y[lo:hi])
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    outputs, _ = run(
        MultiSteps(optax.identity(), 4),
        micro_grads,
        params,
        weights=sizes,
        compile_fn=compile_fn,
    )
    chex.assert_trees_all_close(outputs[-1], jax.grad(loss)(params, x, y), rtol=1e-6)


def test_zero_total_weight_emits_zeros():
    outputs, _ = run(
        MultiSteps(optax.identity(), 2), scalar_grads(3, 4), weights=[0, 0]
    )
    assert float(outputs[1]["a"]) == 0.0


def test_window_weight_is_passed_to_inner_transformation():
    outputs, _ = run(
        MultiSteps(weight_echo(), 3), scalar_grads(1, 1, 1), weights=[2, 3, 5]
    )
    assert float(outputs[2]["a"]) == 10.0
    outputs, _ = run(MultiSteps(weight_echo(), 3), scalar_grads(1, 1, 1))
    assert float(outputs[2]["a"]) == 3.0


def test_flush_emits_partial_window_mean():
    opt = MultiSteps(optax.sgd(1.0), 4)
    params = {"a": jnp.zeros([], jnp.bfloat16)}
    _, state = run(opt, scalar_grads(2, 4), params, weights=[1, 3])
    updates, state = jax.jit(opt.flush)(state, params)
    assert updates["a"].dtype == jnp.bfloat16
    assert float(updates["a"]) == -3.5
    assert bool(opt.has_updated(state))
    assert opt.stats(state).window_fill == 0
    assert int(state.gradient_step) == 1
    # An empty window emits zeros and leaves the inner optimizer alone.
    updates, state = opt.flush(state, params)
    assert float(updates["a"]) == 0.0
    assert int(state.gradient_step) == 1
    assert not bool(opt.has_updated(state))


def test_reset_drops_the_partial_window():
    opt = MultiSteps(optax.sgd(1.0), 2)
    _, state = run(opt, scalar_grads(100))
    state = opt.reset(state)
    updates, state = opt.update({"a": jnp.asarray(1.0)}, state)
    assert float(updates["a"]) == 0.0
    updates, state = opt.update({"a": jnp.asarray(3.0)}, state)
    assert float(updates["a"]) == -2.0


def test_stats():
    opt = MultiSteps(optax.sgd(1.0), lambda step: jnp.where(step < 1, 2, 3))
    _, state = run(opt, scalar_grads(1, 1, 1), weights=[1, 1, 0.5])
    stats = opt.stats(state)
    assert stats == gradaccum_jax.AccumulationStats(
        micro_steps=3,
        gradient_steps=1,
        window_fill=1,
        window_size=3,
        window_weight=0.5,
        # Not tracked: NaN (compared as NaN below).
        grad_sq_norm=stats.grad_sq_norm,
        noise_trace=stats.noise_trace,
        noise_scale=stats.noise_scale,
    )
    assert all(jnp.isnan(v) for v in stats[5:])
    assert {v.dtype for v in stats} == {jnp.dtype(jnp.int32), jnp.dtype(jnp.float32)}


def test_counters_saturate_instead_of_overflowing():
    opt = MultiSteps(optax.sgd(1.0), 1)
    state = opt.init({"a": jnp.zeros([])})
    top = jnp.iinfo(jnp.int32).max
    state = state._replace(micro_steps=jnp.int32(top), gradient_step=jnp.int32(top))
    _, state = opt.update({"a": jnp.ones([])}, state)
    assert int(state.micro_steps) == top and int(state.gradient_step) == top


def test_accumulate_in_chain_with_clipping_per_micro_batch():
    tx = optax.chain(optax.clip(1.0), accumulate(optax.sgd(1.0), 2))
    outputs, _ = run(tx, scalar_grads(5, -0.5))
    assert float(outputs[1]["a"]) == pytest.approx(-0.25)


def test_accumulate_skip_nonfinite_keeps_windows_of_k_calls():
    # The NaN micro-batch fills its place with weight 0: windows stay aligned
    # with the calls, as devices under pmap need.
    tx = accumulate(optax.sgd(1.0), 2, use_grad_mean=False, skip_nonfinite=True)
    outputs, state = run(tx, scalar_grads(5, float("nan"), -0.5, 1.5))
    assert [float(u["a"]) for u in outputs] == [0.0, -5.0, 0.0, -1.0]
    assert int(state.micro_steps) == 3
    # The mean is over the accepted micro-batches only.
    tx = accumulate(optax.sgd(1.0), 3, skip_nonfinite=True)
    outputs, _ = run(tx, scalar_grads(5, float("inf"), 1))
    assert float(outputs[2]["a"]) == -3.0


def test_zero_weight_micro_batch_with_nan_gradients_adds_nothing():
    outputs, _ = run(
        MultiSteps(optax.sgd(1.0), 2),
        scalar_grads(4, float("nan")),
        weights=[2.0, 0.0],
    )
    assert float(outputs[1]["a"]) == -4.0


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_update_dtypes_match_the_unwrapped_optimizer(grad_dtype, param_dtype):
    inner = optax.adam(1e-2)
    params = {"w": jnp.ones((3,), param_dtype)}
    grads = {"w": jnp.full((3,), 0.5, grad_dtype)}
    expected, _ = inner.update(grads, inner.init(params), params)
    opt = MultiSteps(inner, 2)
    state = opt.init(params)
    for _ in range(2):
        updates, state = jax.jit(opt.update)(grads, state, params)
        assert updates["w"].dtype == expected["w"].dtype
        assert optax.apply_updates(params, updates)["w"].dtype == param_dtype
    assert state.acc_grads["w"].dtype == jnp.float32


@pytest.mark.parametrize(
    "build",
    [
        lambda inner: MultiSteps(inner, 2),
        lambda inner: accumulate(inner, 2),
        # Unclipped, the scale of a constant gradient is its value: exact codes.
        lambda inner: gradaccum_jax.ternary_accumulate(
            inner, 2, min_size=1, clip_sigma=None
        ),
    ],
    ids=["MultiSteps", "accumulate", "ternary_accumulate"],
)
@pytest.mark.parametrize(
    "inner, update_dtype",
    [(optax.sgd(1e-2), jnp.bfloat16), (optax.adam(1e-2), jnp.float32)],
    ids=["sgd", "adam"],
)
def test_bfloat16_gradients_of_float32_params_are_accepted(build, inner, update_dtype):
    # docs/guides/accumulation.md: floating gradients of another dtype pass
    # (as in optax.MultiSteps); the updates come in the inner optimizer's
    # dtype for such gradients and apply_updates casts them to the params'
    # dtype.
    params = {"w": jnp.ones((3,), jnp.float32)}
    grads = {"w": jnp.full((3,), 0.5, jnp.bfloat16)}
    expected, _ = inner.update(grads, inner.init(params), params)
    assert expected["w"].dtype == update_dtype
    tx = build(inner)
    state = tx.init(params)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(grads, state, params)
        assert updates["w"].dtype == update_dtype
    assert bool(tx.has_updated(state))
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-2)
    assert optax.apply_updates(params, updates)["w"].dtype == jnp.float32


def test_accumulator_dtype_and_state_dtypes_are_stable_under_scan():
    opt = MultiSteps(optax.adam(1e-2), 3, accumulator_dtype=jnp.bfloat16)
    params = {"w": jnp.zeros((2,), jnp.float32)}

    def step(state, grads):
        updates, state = opt.update(grads, state, params, weight=2)
        return state, updates

    state, updates = jax.lax.scan(step, opt.init(params), {"w": jnp.ones((7, 2))})
    # A low-precision window is a running mean with its float32 weight.
    assert state.acc_grads.mean["w"].dtype == jnp.bfloat16
    assert state.acc_grads.weight.dtype == jnp.float32
    assert float(state.acc_weight) == float(state.acc_grads.weight) == 2.0
    np.testing.assert_allclose(updates["w"][2], [-1e-2, -1e-2], rtol=1e-3)


def test_gradients_with_another_structure_name_the_leaf():
    opt = MultiSteps(optax.sgd(1.0), 2)
    params = {"dense": {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"missing leaves \[\"\['dense'\]\['b'\]\"\]"):
        opt.update({"dense": {"w": jnp.zeros((2, 3))}}, state, params)
    with pytest.raises(
        ValueError,
        match=re.escape("gradients leaf ['dense']['w'] has shape (3, 2), but params"),
    ):
        opt.update(
            {"dense": {"w": jnp.zeros((3, 2)), "b": jnp.zeros((3,))}}, state, params
        )
    with pytest.raises(
        ValueError, match=re.escape("gradients leaf ['dense']['b'] has shape")
    ):
        opt.update({"dense": {"w": jnp.zeros((2, 3)), "b": jnp.zeros((4,))}}, state)


def test_integer_gradients_are_rejected_with_the_leaf_path():
    opt = MultiSteps(optax.sgd(1.0), 2)
    state = opt.init({"step": jnp.zeros([])})
    with pytest.raises(
        ValueError, match=re.escape("gradients leaf ['step'] has dtype int32")
    ):
        opt.update({"step": jnp.zeros([], jnp.int32)}, state)


def test_bad_weight_and_skip_function_outputs():
    opt = MultiSteps(optax.sgd(1.0), 2)
    state = opt.init({"a": jnp.zeros([])})
    with pytest.raises(ValueError, match=re.escape("`weight` must be a scalar")):
        opt.update({"a": jnp.ones([])}, state, weight=jnp.ones((2,)))
    bad_skip = MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=lambda u, s, p: (jnp.zeros(()), ())
    )
    with pytest.raises(ValueError, match="must return a boolean scalar array"):
        bad_skip.update({"a": jnp.ones([])}, bad_skip.init({"a": jnp.zeros([])}))


def test_custom_window_accumulator_plugs_into_the_engine():
    half_precision = gradaccum_jax.extend.float_accumulator(jnp.float16)
    opt = MultiSteps(optax.identity(), 2, window_accumulator=half_precision)
    outputs, state = run(opt, scalar_grads(1.0, 2.0))
    assert state.acc_grads.mean["a"].dtype == jnp.float16
    assert float(outputs[1]["a"]) == 1.5


def test_non_emitting_step_compiles_the_optimizer_into_the_loop_only():
    """The inner update and the emitting work live in the while body (and in
    the nested 0/1 loop that skips a window of zero weight)."""
    opt = MultiSteps(optax.adam(1e-3), 4)
    params = {"w": jnp.zeros((64,))}
    hlo = jax.jit(opt.update).lower(params, opt.init(params), params).as_text()
    assert hlo.count("stablehlo.while") == 2
    assert "stablehlo.case" not in hlo and "stablehlo.if" not in hlo
    before_the_loop, in_the_emission_loop, in_the_nested_loop = hlo.split(
        "stablehlo.while"
    )
    assert "sqrt" not in before_the_loop + in_the_emission_loop
    assert "sqrt" in in_the_nested_loop


@pytest.mark.parametrize(
    "build",
    [
        lambda: MultiSteps(optax.adam(1e-3), 3, track_noise_scale=True),
        lambda: gradaccum_jax.ternary_accumulate(optax.sgd(0.1), 3, seed=0),
    ],
    ids=["MultiSteps", "ternary_accumulate"],
)
def test_eager_updates_compile_nothing_after_the_first_window(build, caplog):
    """Without jax.jit the emission is a Python branch: a while loop would be
    traced and compiled again on every call (its body closes over new
    arrays), a quarter of a second each time."""
    tx = build()
    params = {"w": jnp.zeros((5,)), "b": jnp.zeros(())}
    grads = {"w": jnp.arange(5.0), "b": jnp.ones(())}
    state = tx.init(params)
    for _ in range(3):  # the first window compiles each eager op once
        updates, state = tx.update(grads, state, params)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for _ in range(6):  # two more windows: micro-steps and emissions
            updates, state = tx.update(grads, state, params)
    assert not [r.message for r in caplog.records if "Compiling" in r.message]
    stats = tx.stats(state)
    assert (int(stats.gradient_steps), int(stats.window_fill)) == (3, 0)
    assert float(jnp.abs(updates["b"])) > 0  # the last call emitted


@pytest.mark.parametrize("wrap_grads", ["argument", "computed in the step"])
def test_donated_train_step_needs_no_parameter_sized_temporaries(wrap_grads):
    """The updates are computed into the window's own buffers (or the dead
    gradients), so the step's temporaries stay far below one parameter-sized
    buffer; optax.MultiSteps with adam needs about three on XLA:CPU (XLA:GPU
    keeps none for either: 288 bytes for optax's on an H100)."""
    params = {"w": jnp.zeros((1 << 16,)), "b": jnp.zeros((1 << 10,))}
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    def make_grads(params, grads):
        return jax.tree.map(lambda p, g: p * g, params, grads)

    def temp_bytes(tx):
        in_step = None if wrap_grads == "argument" else make_grads
        return train_step_temp_bytes(tx, params, in_step)

    ours = temp_bytes(MultiSteps(optax.adam(1e-3), 4).gradient_transformation())
    theirs = temp_bytes(optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation())
    assert ours < 0.05 * param_bytes
    if jax.default_backend() == "cpu":
        assert theirs > 2 * param_bytes


# --- one vocabulary, one object -----------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: accumulate(optax.sgd(1.0), 3),
        lambda: gradaccum_jax.ternary_accumulate(
            optax.sgd(1.0), 3, clip_sigma=None, min_size=1
        ),
        lambda: MultiSteps(optax.sgd(1.0), 3).gradient_transformation(),
    ],
    ids=["accumulate", "ternary_accumulate", "MultiSteps"],
)
def test_every_entry_point_has_the_window_methods(build):
    tx = build()
    assert isinstance(tx, gradaccum_jax.AccumulationTransformation)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert tx.gradient_transformation() is tx
    params = {"a": jnp.zeros((4,))}
    state = tx.init(params)
    # Equal micro-batches: the ternary window's scale never grows, so its
    # codes of a constant vector are exact too.
    for g in (1.0, 1.0):
        _, state = tx.update({"a": jnp.full((4,), g)}, state, params, weight=2.0)
    stats = tx.stats(state)
    assert (int(stats.window_fill), int(stats.window_size)) == (2, 3)
    assert float(stats.window_weight) == 4.0
    assert not bool(tx.has_updated(state))
    updates, flushed = tx.flush(state, params)
    np.testing.assert_allclose(updates["a"], np.full(4, -1.0), rtol=1e-6)
    assert bool(tx.has_updated(flushed))
    assert int(tx.stats(tx.reset(state)).window_fill) == 0


def test_a_transformation_holds_its_engine():
    # It was found through ``update.__self__``: one whose update was not a
    # bound `MultiSteps` method built, then failed on ``flush`` with an
    # AttributeError from inside the library.
    multi_steps = MultiSteps(optax.sgd(1.0), 2)
    init, update = multi_steps.gradient_transformation()
    with pytest.raises(ValueError, match=r"one argument, its engine .*not optax's"):
        gradaccum_jax.AccumulationTransformation(init, lambda u, s, p=None: (u, s))
    with pytest.raises(ValueError, match="engine must be a gradaccum_jax.MultiSteps"):
        gradaccum_jax.AccumulationTransformation(init)

    tx = gradaccum_jax.AccumulationTransformation(multi_steps)
    assert (tx.init, tx.update) == (multi_steps.init, multi_steps.update)
    params = {"a": jnp.zeros((2,))}
    _, state = tx.update({"a": jnp.ones((2,))}, tx.init(params), params)
    # Copies and tree maps keep the engine; leaves and key paths
    # are NamedTuple's.
    for same in (
        copy.deepcopy(tx),
        jax.tree.map(lambda f: f, tx),
    ):
        np.testing.assert_allclose(same.flush(state, params)[0]["a"], [-1.0, -1.0])
    paths = [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tx)
    ]
    assert paths == [".init", ".update"]
    # A construction that bypasses ``__new__`` names the problem.
    with pytest.raises(ValueError, match="built without its engine"):
        tx._replace(update=update).flush(state, params)


def test_accumulate_in_a_chain_still_receives_the_weight():
    tx = optax.chain(optax.identity(), accumulate(optax.sgd(1.0), 2))
    state = tx.init({"a": jnp.zeros(())})
    _, state = tx.update({"a": jnp.float32(1.0)}, state, weight=1.0)
    updates, _ = tx.update({"a": jnp.float32(4.0)}, state, weight=3.0)
    assert float(updates["a"]) == -(1.0 * 1 + 4.0 * 3) / 4


def test_negative_concrete_weight_is_rejected():
    opt = MultiSteps(optax.sgd(1.0), 2)
    state = opt.init({"a": jnp.zeros([])})
    with pytest.raises(
        ValueError, match=re.escape("MultiSteps.update: `weight` must be >= 0")
    ):
        opt.update({"a": jnp.ones([])}, state, weight=-1.0)


def test_negative_traced_weight_makes_the_window_nan():
    outputs, _ = run(
        MultiSteps(optax.sgd(1.0), 2),
        scalar_grads(1.0, 5.0),
        weights=[jnp.float32(-1.0), jnp.float32(-3.0)],
    )
    assert np.isnan(float(outputs[-1]["a"]))


# --- optimizers that reject unknown extra arguments ---------------------------


def _quadratic(params):
    return jnp.sum(jnp.array([1.0, 4.0]) * (params["x"] - jnp.array([1.0, -2.0])) ** 2)


def _lbfgs_run(tx, micro_batches=2, windows=3, **update_kwargs):
    """Steps lbfgs on the quadratic; every micro-batch sees the same gradient."""
    params = {"x": jnp.zeros(2)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        value, grad = jax.value_and_grad(_quadratic)(params)
        updates, state = tx.update(
            grad,
            state,
            params,
            value=value,
            grad=grad,
            value_fn=_quadratic,
            **update_kwargs,
        )
        return optax.apply_updates(params, updates), state

    trajectory = []
    for _ in range(micro_batches * windows):
        params, state = step(params, state)
        trajectory.append(params["x"])
    return np.stack(trajectory)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_lbfgs_with_line_search_runs_wrapped_as_in_optax(weighted):
    # optax's zoom line search hands every extra argument it does not know
    # to value_fn and raises on `weight`; the engine must not force one on it,
    # with or without weights from the caller.
    kwargs = {"weight": jnp.float32(3.0)} if weighted else {}
    ours = _lbfgs_run(MultiSteps(optax.lbfgs(), 2), **kwargs)
    reference = _lbfgs_run(optax.MultiSteps(optax.lbfgs(), 2))
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7)
    # It moves once per window only, and descends: 17 at the start.
    np.testing.assert_array_equal(ours[0], [0.0, 0.0])
    np.testing.assert_array_equal(ours[1], ours[2])
    assert float(_quadratic({"x": ours[-1]})) < 0.2


def test_accumulate_of_lbfgs_runs_in_a_chain():
    tx = optax.chain(optax.identity(), accumulate(optax.lbfgs(), 2))
    ours = _lbfgs_run(tx)
    reference = _lbfgs_run(optax.MultiSteps(optax.lbfgs(), 2))
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7)


def test_inner_optimizer_without_weight_argument_gets_none():
    def update_fn(updates, state, params=None, *, value):
        return jax.tree.map(lambda u: u * value, updates), state

    tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
    outputs, _ = run(MultiSteps(tx, 2), scalar_grads(1, 3), value=2.0)
    assert float(outputs[1]["a"]) == 4.0


def test_other_type_errors_of_the_inner_optimizer_are_not_swallowed():
    def update_fn(updates, state, params=None, **extra_args):
        raise TypeError("something else is wrong")

    tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
    with pytest.raises(TypeError, match="something else is wrong"):
        run(MultiSteps(tx, 2), scalar_grads(1, 3))


# --- misuse at run time -------------------------------------------------------


@pytest.mark.parametrize("method", ["update", "flush", "reset", "stats"])
def test_state_none_says_to_call_init_first(method):
    tx = MultiSteps(optax.sgd(1.0), 2)
    grads = {"a": jnp.ones(())}
    call = {
        "update": lambda: tx.update(grads, None, grads),
        "flush": lambda: tx.flush(None),
        "reset": lambda: tx.reset(None),
        "stats": lambda: tx.stats(None),
    }[method]
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"MultiSteps.{method}: `state` must be the MultiStepsState returned "
            "by `init(params)` (or by the previous update), got NoneType. Call "
            "`init` first"
        ),
    ):
        call()


@EAGER_AND_JIT
@pytest.mark.parametrize("k", [0, -2])
def test_schedule_below_one_counts_as_one(compile_fn, k):
    # A traced k cannot raise; optax stops emitting forever, we emit every
    # micro-batch (a window of 1) and report that window size.
    schedule = lambda step: jnp.where(step < 1, 2, k)  # noqa: E731
    tx = MultiSteps(optax.sgd(1.0), schedule)
    outputs, state = run(tx, scalar_grads(1, 3, 5, 7), compile_fn=compile_fn)
    assert [float(u["a"]) for u in outputs] == [0.0, -2.0, -5.0, -7.0]
    assert int(state.gradient_step) == 3
    assert int(tx.stats(state).window_size) == 1


# --- differentiation through update -------------------------------------------

META_GRADS = jnp.array([[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0], [0.5, 0.5]])


def _unrolled_loss(learning_rate, grads_seq, make_tx):
    """Final loss after 4 micro-steps (2 windows) of injected-lr adam."""
    tx = make_tx(optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate))
    params = {"w": jnp.array([1.0, -1.0])}
    state = tx.init(params)
    for grads in grads_seq:
        # The gradient also depends on the params, so the meta-gradient flows
        # through the params passed to update (adamw's decay reads them).
        updates, state = tx.update({"w": grads + params["w"]}, state, params)
        params = optax.apply_updates(params, updates)
    return jnp.sum(params["w"] ** 2)


WRAPPERS = {
    "MultiSteps": lambda opt: MultiSteps(opt, 2),
    "accumulate": lambda opt: accumulate(opt, 2),
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_meta_gradients_through_update_match_optax(wrapper, jit):
    # A 0/1-trip while loop has no reverse-mode derivative; run_if
    # differentiates as a cond, which optax.MultiSteps uses.
    grad_fn = jax.grad(_unrolled_loss, argnums=(0, 1))
    if jit:
        grad_fn = jax.jit(grad_fn, static_argnums=2)
    ours = grad_fn(0.1, META_GRADS, WRAPPERS[wrapper])
    reference = grad_fn(0.1, META_GRADS, lambda opt: optax.MultiSteps(opt, 2))
    chex.assert_trees_all_close(ours, reference, rtol=1e-5, atol=1e-7)
    # Both arguments matter: the pins are not vacuous zeros.
    assert abs(float(ours[0])) > 0.1
    assert float(jnp.min(jnp.abs(ours[1]))) > 1e-3


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_forward_mode_through_update_matches_optax(wrapper):
    def loss_of_lr(make_tx):
        return lambda lr: _unrolled_loss(lr, META_GRADS, make_tx)

    ours = jax.jvp(loss_of_lr(WRAPPERS[wrapper]), (0.1,), (1.0,))
    reference = jax.jvp(
        loss_of_lr(lambda opt: optax.MultiSteps(opt, 2)), (0.1,), (1.0,)
    )
    chex.assert_trees_all_close(ours, reference, rtol=1e-5)


# --- windows of zero weight ---------------------------------------------------


@pytest.mark.parametrize(
    "inner",
    [optax.adam(0.1), optax.adamw(0.1, weight_decay=0.5)],
    ids=["adam", "adamw"],
)
def test_zero_weight_window_does_not_step_the_inner_optimizer(inner):
    tx = MultiSteps(inner, 2)
    params = {"a": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for grads in ([1.0, 2.0], [3.0, -1.0]):  # one real window: moments != 0
        updates, state = update({"a": jnp.array(grads)}, state, params, weight=1.0)
        params = optax.apply_updates(params, updates)
    params_before, inner_before = params, state.inner_opt_state
    for grads in ([5.0, 5.0], [jnp.nan, 1.0]):
        updates, state = update({"a": jnp.array(grads)}, state, params, weight=0.0)
        params = optax.apply_updates(params, updates)
        np.testing.assert_array_equal(updates["a"], [0.0, 0.0])
    # Without the rule adam emitted its momentum (-0.067) and counted a step.
    chex.assert_trees_all_equal(params, params_before)
    chex.assert_trees_all_equal(state.inner_opt_state, inner_before)
    assert not bool(tx.has_updated(state))
    assert int(state.mini_step) == 0  # the window closed
    assert int(state.gradient_step) == 2
    # The next window steps again, from the kept moments.
    updates, state = update({"a": jnp.ones(2)}, state, params, weight=1.0)
    updates, state = update({"a": jnp.ones(2)}, state, params, weight=1.0)
    assert bool(tx.has_updated(state))
    assert int(state.inner_opt_state[0].count) == 2


def test_all_nan_window_under_skip_nonfinite_does_not_step_adam():
    tx = accumulate(optax.adam(0.1), 2, skip_nonfinite=True)
    params = {"a": jnp.zeros(2)}
    state = tx.init(params)
    for grads in ([1.0, 2.0], [3.0, -1.0], [jnp.nan, 1.0], [jnp.inf, 0.0]):
        updates, state = tx.update({"a": jnp.array(grads)}, state, params)
    np.testing.assert_array_equal(updates["a"], [0.0, 0.0])
    assert int(state.inner_opt_state[0].count) == 1
    assert not bool(tx.has_updated(state))


# --- complex params (optax supports them) -----------------------------------


@pytest.mark.parametrize(
    ("accumulator_dtype", "window_dtype"),
    [
        (jnp.float32, jnp.complex64),
        # No complex bfloat16: the window keeps complex64, never a real part.
        (jnp.bfloat16, jnp.complex64),
    ],
)
@pytest.mark.parametrize("make", ["MultiSteps", "accumulate"])
def test_complex_gradients_accumulate_exactly(make, accumulator_dtype, window_dtype):
    tx = getattr(gradaccum_jax, make)(
        optax.sgd(1.0), 2, accumulator_dtype=accumulator_dtype
    )
    params = {"w": jnp.array([1 + 2j, 3 - 1j], jnp.complex64)}
    grads = [
        {"w": jnp.array([1 + 2j, 0 + 3j], jnp.complex64)},
        {"w": jnp.array([1 + 2j, 0 + 3j], jnp.complex64)},
        {"w": jnp.array([3 - 2j, 4 + 1j], jnp.complex64)},
    ]
    outputs, state = run(tx, grads[:2], params)
    # sgd(1) on the window's mean: minus it, imaginary part included.
    np.testing.assert_array_equal(outputs[1]["w"], np.array([-1 - 2j, -0 - 3j]))
    assert outputs[1]["w"].dtype == jnp.complex64
    state_leaves = jax.tree.leaves(state.acc_grads)
    assert jnp.dtype(window_dtype) in {leaf.dtype for leaf in state_leaves}
    updates, state = tx.update(grads[2], state, params)
    updates, _ = tx.flush(state, params)
    np.testing.assert_allclose(updates["w"], np.array([-3 + 2j, -4 - 1j]), rtol=1e-2)


def test_complex_gradients_noise_scale_uses_the_squared_modulus():
    tx = MultiSteps(
        optax.sgd(0.0),
        2,
        track_noise_scale=True,
        noise_scale_decay=0.0,
        noise_scale_estimator="all",
    )
    params = {"w": jnp.zeros(2, jnp.complex64)}
    # As real vectors [re, im]: g1 = (1, 2, 0, 3), g2 = (3, 0, -2, 1).
    grads = [
        {"w": jnp.array([1 + 2j, 0 + 3j], jnp.complex64)},
        {"w": jnp.array([3 + 0j, -2 + 1j], jnp.complex64)},
    ]
    _, state = run(tx, grads, params)
    stats = tx.stats(state)
    real = np.array([[1.0, 2.0, 0.0, 3.0], [3.0, 0.0, -2.0, 1.0]])
    # Two micro-batches of weight 1: |G|^2 = |g_bar|^2 - tr/2, tr = A/1 - 2|g_bar|^2
    a = np.sum(real**2) / 2  # mean of the micro-batch squared norms
    mean_sq = np.sum(real.mean(0) ** 2)
    trace = 2 * (a - mean_sq)
    np.testing.assert_allclose(stats.noise_trace, trace, rtol=1e-6)
    np.testing.assert_allclose(stats.grad_sq_norm, mean_sq - trace / 2, rtol=1e-6)


# --- an inner state holding a typed PRNG key ----------------------------------

KEYED_WRAPPERS = {
    "MultiSteps": lambda opt: MultiSteps(opt, 2),
    "accumulate": lambda opt: accumulate(opt, 2),
    # Constant micro-batches: the ternary window's codes are exact.
    "ternary_accumulate": lambda opt: gradaccum_jax.ternary_accumulate(
        opt, 2, clip_sigma=None, min_size=1
    ),
}
# Windows of equal micro-batches, then a partial window (for `flush`).
KEYED_GRADS = [{"w": jnp.full((4,), g)} for g in (1.0, 1.0, 3.0, 3.0, 2.0)]


def _noisy_sgd():
    # A typed key (jax.random.key), whose concrete arrays have no `astype`.
    return optax.noisy_sgd(0.1, key=jax.random.key(0))


@EAGER_AND_JIT
@pytest.mark.parametrize("wrapper", sorted(KEYED_WRAPPERS))
def test_typed_prng_key_in_the_inner_state_matches_optax(wrapper, compile_fn):
    tx = KEYED_WRAPPERS[wrapper](_noisy_sgd())
    params = {"w": jnp.arange(4.0)}
    outputs, state = run(tx, KEYED_GRADS, params, compile_fn=compile_fn)
    flushed, flushed_state = compile_fn(tx.flush)(state, params)
    # optax's MultiSteps given the last micro-batch twice: a window whose mean
    # is the flushed partial window's.
    reference, _ = run(
        optax.MultiSteps(_noisy_sgd(), 2), [*KEYED_GRADS, KEYED_GRADS[-1]], params
    )
    for ours, theirs in zip([*outputs, flushed], reference, strict=True):
        np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-6, atol=1e-7)
    # The noise is there: the emitted updates are not minus lr times the mean.
    assert float(jnp.max(jnp.abs(flushed["w"] + 0.2))) > 1e-3
    key = jax.tree.leaves(flushed_state.inner_opt_state)[-1]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert int(tx.stats(flushed_state).gradient_steps) == 3


@EAGER_AND_JIT
def test_gradients_through_update_with_a_typed_prng_key_match_optax(compile_fn):
    def final_loss(params, make_tx):
        tx = make_tx(_noisy_sgd())
        state = tx.init(params)
        for grads in KEYED_GRADS[:2]:
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return jnp.sum(params["w"] ** 2)

    def grad_fn(make_tx):
        return compile_fn(jax.grad(lambda params: final_loss(params, make_tx)))

    params = {"w": jnp.arange(4.0)}
    ours = grad_fn(KEYED_WRAPPERS["MultiSteps"])(params)
    reference = grad_fn(lambda opt: optax.MultiSteps(opt, 2))(params)
    chex.assert_trees_all_close(ours, reference, rtol=1e-6)
    assert float(jnp.min(jnp.abs(ours["w"]))) > 0.1


@pytest.mark.slow  # compiles at scale (64 emulated devices), about 10 s
def test_a_window_reduced_once_holds_its_sum_and_updates_in_place(tmp_path):
    """The 0.81B-param reference of benchmarks/bench_scale.py (`data` 8 x
    `model` 8, adam, k=8, donated): a window of per-device terms, reduced
    once at its emission, computes the updates in its reduced sum's
    buffers, and the update slots the emission carries are the dead
    micro-batch gradients' buffers. Its temporaries stay within one leaf's
    share (0.1875 GiB) of the plain path's, which reduces every micro-step
    (0.767 GiB, the plain path's 0.408 plus a whole window, before)."""
    paths = (
        "ga.MultiSteps + jax.grad",
        "once per window (local_value_and_grad)",
        "ternary window",
    )
    results = compiled_reference(tmp_path, *paths)
    plain = results[paths[0]]
    leaf = 4 * 24 * 2048 * 8192 // 8  # one float32 weight over `model` 8
    for path in paths[1:]:
        assert "error" not in results[path], results[path]
        # The same arguments (but for a ternary window's 8-byte counter).
        arguments = results[path]["argument_bytes"] - plain["argument_bytes"]
        assert 0 <= arguments <= 8, path
        assert results[path]["temp_bytes"] <= plain["temp_bytes"] + leaf, path
        assert results[path]["temp_bytes"] < 0.6 * 2**30, path
