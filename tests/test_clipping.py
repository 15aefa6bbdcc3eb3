"""Tests for clip_by_global_norm, clip and global_norm."""

from __future__ import annotations

import types
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.transforms import _clipping as optax_clipping
from optax.transforms import _clipping_test as optax_clipping_test

import gradaccum_jax as ga
from helpers import EAGER_AND_JIT

# Run every body eagerly and compiled: tracing can change dtypes and
# Python-side branching that eager execution hides.

# ||(3, 4, 12)|| = 13.
GRADS = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}


# --- optax's own tests against ours -----------------------------------------

# optax's tests that exercise the transformations we re-implement; the rest
# of optax's ClippingTest tests optax-only functions and is switched off.
_OPTAX_TESTS_OF_OURS = ("test_clip", "test_clip_by_global_norm")
_OURS_IN_OPTAX_NAMESPACE = types.SimpleNamespace(
    **{
        **vars(optax_clipping),
        "clip": ga.clip,
        "clip_by_global_norm": ga.clip_by_global_norm,
    }
)


def _only_tests_of_ours() -> dict[str, None]:
    names = [n for n in dir(optax_clipping_test.ClippingTest) if n.startswith("test")]
    missing = set(_OPTAX_TESTS_OF_OURS) - set(names)
    # If optax renames its tests this must fail loudly, not pass vacuously.
    assert not missing, f"optax's ClippingTest no longer has {sorted(missing)}"
    return {n: None for n in names if n not in _OPTAX_TESTS_OF_OURS}


class TestOptaxClippingAgainstOurs(optax_clipping_test.ClippingTest):
    """optax's test_clip and test_clip_by_global_norm, run on our functions.

    optax's test module calls everything through its module global
    `_clipping`; it is rebound for the duration of each test only.
    """

    locals().update(_only_tests_of_ours())

    def setUp(self):
        super().setUp()
        patcher = mock.patch.object(
            optax_clipping_test, "_clipping", _OURS_IN_OPTAX_NAMESPACE
        )
        patcher.start()
        self.addCleanup(patcher.stop)
        assert optax_clipping_test._clipping.clip_by_global_norm is (
            ga.clip_by_global_norm
        )


def test_optax_tests_are_collected_for_ours_only():
    collected = [
        n
        for n in dir(TestOptaxClippingAgainstOurs)
        if n.startswith("test") and callable(getattr(TestOptaxClippingAgainstOurs, n))
    ]
    assert sorted(collected) == sorted(_OPTAX_TESTS_OF_OURS)


# --- clip_by_global_norm -----------------------------------------------------


@EAGER_AND_JIT
def test_clip_by_global_norm_records_pre_clip_norm_and_clipped(compile_fn):
    clipper = ga.clip_by_global_norm(5.0)
    updates, state = compile_fn(clipper.update)(GRADS, clipper.init(GRADS))
    chex.assert_trees_all_close(
        updates,
        {"a": jnp.array([15.0 / 13.0, 20.0 / 13.0]), "b": jnp.array([60.0 / 13.0])},
        rtol=1e-6,
    )
    np.testing.assert_allclose(ga.global_norm(updates), 5.0, rtol=1e-6)
    assert isinstance(state, ga.ClipByGlobalNormState)
    assert float(state.global_norm) == 13.0
    assert bool(state.clipped) is True


@EAGER_AND_JIT
@pytest.mark.parametrize(
    ("max_norm", "clipped"),
    # optax's predicate is `norm < max_norm`: a norm equal to max_norm is
    # "clipped" (scaled by 13 / 13, a no-op up to rounding).
    [(14.0, False), (13.0, True), (1e6, False)],
)
def test_clip_by_global_norm_boundary(compile_fn, max_norm, clipped):
    clipper = ga.clip_by_global_norm(max_norm)
    updates, state = compile_fn(clipper.update)(GRADS, clipper.init(GRADS))
    chex.assert_trees_all_close(updates, GRADS, rtol=1e-7)
    assert float(state.global_norm) == 13.0
    assert bool(state.clipped) is clipped


@EAGER_AND_JIT
@pytest.mark.parametrize("max_norm", [0.5, 5.0, 13.0, 20.0])
def test_clip_by_global_norm_is_bit_identical_to_optax_for_float32(
    compile_fn, max_norm
):
    keys = jax.random.split(jax.random.key(0), 3)
    grads = {
        "kernel": 3.0 * jax.random.normal(keys[0], (7, 5)),
        "bias": jax.random.normal(keys[1], (5,)),
        "nested": [jax.random.normal(keys[2], (2, 3, 4))],
    }
    ours = ga.clip_by_global_norm(max_norm)
    theirs = optax.clip_by_global_norm(max_norm)
    our_updates, _ = compile_fn(ours.update)(grads, ours.init(grads))
    their_updates, _ = compile_fn(theirs.update)(grads, theirs.init(grads))
    chex.assert_trees_all_equal(our_updates, their_updates)
    chex.assert_trees_all_equal_dtypes(our_updates, grads)


def test_clip_by_global_norm_state_dtypes_match_between_init_and_update():
    clipper = ga.clip_by_global_norm(1.0)
    grads = {"w": jnp.ones((3,), jnp.bfloat16), "b": jnp.ones((2,), jnp.float16)}
    init_state = clipper.init(grads)
    _, new_state = clipper.update(grads, init_state)
    assert jax.tree.structure(init_state) == jax.tree.structure(new_state)
    chex.assert_trees_all_equal_shapes_and_dtypes(init_state, new_state)
    assert init_state.global_norm.dtype == jnp.float32
    assert init_state.clipped.dtype == jnp.bool_
    assert init_state.global_norm.shape == init_state.clipped.shape == ()
    assert float(init_state.global_norm) == 0.0
    assert bool(init_state.clipped) is False


def test_clip_by_global_norm_state_is_a_stable_scan_carry():
    clipper = ga.clip_by_global_norm(1.0)
    # Step i has gradient (i, 0): norm i, clipped from i = 1 on.
    steps = jnp.stack([jnp.arange(4.0), jnp.zeros(4)], axis=1).astype(jnp.bfloat16)

    def step(state, grads):
        updates, state = clipper.update(grads, state)
        return state, (updates, state)

    last, (updates, states) = jax.lax.scan(step, clipper.init(steps[0]), steps)
    np.testing.assert_array_equal(states.global_norm, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(states.clipped, [False, True, True, True])
    np.testing.assert_array_equal(
        updates.astype(jnp.float32), [[0, 0], [1, 0], [1, 0], [1, 0]]
    )
    assert updates.dtype == jnp.bfloat16
    assert float(last.global_norm) == 3.0


@EAGER_AND_JIT
def test_clip_by_global_norm_computes_bfloat16_norm_in_float32(compile_fn):
    # 300 leaves of 100 ones: norm sqrt(30000) = 173.205. Summed in bfloat16
    # (as optax does) the per-leaf sums and the running total round to 8
    # mantissa bits and give 181.
    grads = [jnp.ones((100,), jnp.bfloat16)] * 300
    assert float(optax.tree.norm(grads)) == 181.0
    clipper = ga.clip_by_global_norm(17.320508)
    updates, state = compile_fn(clipper.update)(grads, clipper.init(grads))
    assert state.global_norm.dtype == jnp.float32
    np.testing.assert_allclose(state.global_norm, 173.20508, rtol=1e-7)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in updates)
    # Each element becomes 1 * 17.320508 / 173.20508 = 0.1, rounded once to
    # bfloat16 (0.10009765625), not 1 * 17.32 / 181 = 0.0957.
    np.testing.assert_array_equal(updates[0], jnp.full((100,), 0.1, jnp.bfloat16))
    # 0.10009765625 * sqrt(30000): within bfloat16 rounding of max_norm.
    # Summed in float32 in another order (an H100 gave 17.337414) it moves by
    # a few float32 ulps; summed in bfloat16 it would move by about 1e-3.
    np.testing.assert_allclose(ga.global_norm(updates), 17.337416, rtol=1e-6)


@EAGER_AND_JIT
def test_clip_by_global_norm_float16_norm_does_not_overflow(compile_fn):
    # 300**2 = 90000 > 65504, the float16 maximum: optax's norm is inf.
    grads = {"w": jnp.full((3,), 300.0, jnp.float16)}
    assert not np.isfinite(float(optax.tree.norm(grads)))
    clipper = ga.clip_by_global_norm(1.0)
    updates, state = compile_fn(clipper.update)(grads, clipper.init(grads))
    np.testing.assert_allclose(state.global_norm, 300.0 * np.sqrt(3.0), rtol=1e-7)
    assert bool(state.clipped) is True
    assert updates["w"].dtype == jnp.float16
    np.testing.assert_allclose(
        updates["w"].astype(np.float32), np.full(3, 1 / np.sqrt(3.0)), rtol=1e-3
    )


def test_clip_by_global_norm_accepts_none_state_as_optax_does():
    _, state = ga.clip_by_global_norm(1.0).update(GRADS, None)
    assert float(state.global_norm) == 13.0


def test_clip_by_global_norm_under_pmap_clips_each_device_by_its_own_norm():
    clipper = ga.clip_by_global_norm(1.0)
    # Device i holds gradient (i, 0): norm i.
    grads = jnp.stack([jnp.arange(8.0), jnp.zeros(8)], axis=1)
    updates, state = jax.pmap(clipper.update)(grads, jax.pmap(clipper.init)(grads))
    np.testing.assert_array_equal(state.global_norm, np.arange(8.0))
    np.testing.assert_array_equal(state.clipped, [False] + [True] * 7)
    np.testing.assert_array_equal(updates[:, 0], [0.0] + [1.0] * 7)


# --- clip --------------------------------------------------------------------


@EAGER_AND_JIT
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_is_elementwise(compile_fn, dtype):
    clipper = ga.clip(1.5)
    grads = {"w": jnp.array([-3.0, -1.0, 0.5, 1.5, 2.0], dtype)}
    updates, state = compile_fn(clipper.update)(grads, clipper.init(grads))
    assert updates["w"].dtype == dtype
    np.testing.assert_array_equal(
        updates["w"].astype(jnp.float32), [-1.5, -1.0, 0.5, 1.5, 1.5]
    )
    assert state == optax.EmptyState()


# --- global_norm -------------------------------------------------------------


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        (GRADS, 13.0),
        ({"x": jnp.array([3.0, 4.0], jnp.bfloat16)}, 5.0),
        ((jnp.array([[6.0]], jnp.float16), jnp.array([8.0])), 10.0),
        ([], 0.0),
    ],
)
def test_global_norm_is_float32(tree, expected):
    norm = ga.global_norm(tree)
    assert norm.dtype == jnp.float32
    assert norm.shape == ()
    assert float(norm) == expected


def test_global_norm_of_complex_leaves_uses_the_modulus():
    # |3 + 4i| = 5, as optax.tree.norm.
    norm = ga.global_norm({"z": jnp.array([3.0 + 4.0j])})
    assert norm.dtype == jnp.float32
    assert float(norm) == 5.0


# --- errors ------------------------------------------------------------------


@pytest.mark.parametrize("make", [ga.clip_by_global_norm, ga.clip])
def test_threshold_accepts_ints_and_scalar_arrays(make):
    assert make(2) is not None
    assert make(np.float32(2.0)) is not None
    assert make(jnp.array(2.0)) is not None


# --- clipping and accumulation ----------------------------------------------

# Two windows of k = 2 micro-batches.
MICRO_BATCH_GRADS = [[3.0, 4.0], [0.0, -1.0], [0.3, 0.4], [-2.0, 0.0]]


def _clip_the_window():
    """The clipper inside the accumulated optimizer sees each window's mean."""
    opt = ga.MultiSteps(optax.chain(ga.clip_by_global_norm(1.0), optax.adam(0.1)), 2)
    return opt, lambda opt_state: opt_state.inner_opt_state[0]


def _clip_each_micro_batch():
    """The clipper before the accumulation sees every micro-batch."""
    opt = optax.chain(ga.clip_by_global_norm(1.0), ga.accumulate(optax.adam(0.1), 2))
    return opt, lambda opt_state: opt_state[0]


def _run_micro_batches(make_opt):
    """Returns per micro-batch: the updates, the clipper's norm and flag."""
    opt, clip_state_of = make_opt()
    params = {"w": jnp.zeros(2)}
    opt_state = opt.init(params)
    update = jax.jit(opt.update)
    updates, norms, clipped = [], [], []
    for grads in MICRO_BATCH_GRADS:
        step_updates, opt_state = update({"w": jnp.array(grads)}, opt_state, params)
        updates.append(step_updates["w"])
        norms.append(float(clip_state_of(opt_state).global_norm))
        clipped.append(bool(clip_state_of(opt_state).clipped))
    return np.stack(updates), norms, clipped


def test_multisteps_of_clip_chain_clips_the_window_gradient():
    updates, norms, clipped = _run_micro_batches(_clip_the_window)
    # Window 1: mean (1.5, 1.5), norm 2.1213, clipped to (0.7071, 0.7071).
    # Window 2: mean (-0.85, 0.2), norm 0.8732, not clipped. The clipper runs
    # only at the emitting steps; its state keeps the last window's norm.
    np.testing.assert_allclose(
        norms, [0.0, 1.5 * np.sqrt(2.0), 1.5 * np.sqrt(2.0), 0.8732125], rtol=1e-6
    )
    assert clipped == [False, True, True, False]
    np.testing.assert_allclose(
        updates,
        [[0.0, 0.0], [-0.09999933, -0.09999933], [0.0, 0.0], [0.01437878, -0.08473536]],
        rtol=1e-5,
    )


def test_clip_before_accumulate_clips_each_micro_batch():
    updates, norms, clipped = _run_micro_batches(_clip_each_micro_batch)
    # (3, 4) -> (0.6, 0.8); (0, -1) has norm 1, not < 1, so it counts as
    # clipped (by 1 / 1); (0.3, 0.4) passes; (-2, 0) -> (-1, 0). Window
    # means (0.3, -0.1) and (-0.35, 0.2): the first update's second
    # coordinate has the opposite sign of the window-clipped one above.
    np.testing.assert_allclose(norms, [5.0, 1.0, 0.5, 2.0], rtol=1e-6)
    assert clipped == [True, True, False, True]
    np.testing.assert_allclose(
        updates,
        [[0.0, 0.0], [-0.09999933, 0.09999933], [0.0, 0.0], [0.01291668, -0.03660998]],
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    ("make_opt", "clipped_window_means"),
    [
        (_clip_the_window, [[0.70710677, 0.70710677], [-0.85, 0.2]]),
        (_clip_each_micro_batch, [[0.3, -0.1], [-0.35, 0.2]]),
    ],
    ids=["window", "micro_batch"],
)
def test_both_placements_equal_adam_on_the_hand_clipped_means(
    make_opt, clipped_window_means
):
    updates, _, _ = _run_micro_batches(make_opt)
    adam = optax.adam(0.1)
    adam_state = adam.init({"w": jnp.zeros(2)})
    for window, grads in enumerate(clipped_window_means):
        expected, adam_state = adam.update({"w": jnp.array(grads)}, adam_state)
        np.testing.assert_array_equal(updates[2 * window], [0.0, 0.0])
        np.testing.assert_allclose(updates[2 * window + 1], expected["w"], rtol=1e-5)


def test_logged_window_norm_is_the_last_emitted_windows_between_emissions():
    # docs/guides/data_parallel.md: log grad_norm when has_updated is true; on
    # other calls the state still holds the previous window's norm (0.0
    # before the first window), since the clipper runs only at emission.
    tx = ga.MultiSteps(optax.chain(ga.clip_by_global_norm(1.0), optax.sgd(1.0)), 2)
    params = {"a": jnp.zeros([])}
    state = tx.init(params)
    logged = []
    for g in (3.0, 4.0, 10.0, 20.0):
        _, state = jax.jit(tx.update)({"a": jnp.asarray(g)}, state, params)
        clip_state = state.inner_opt_state[0]
        logged.append(
            (
                float(clip_state.global_norm),
                bool(clip_state.clipped),
                bool(tx.has_updated(state)),
            )
        )
    assert logged == [
        (0.0, False, False),
        (3.5, True, True),
        (3.5, True, False),
        (15.0, True, True),
    ]


# --- injected (traced) thresholds ---------------------------------------------


@pytest.mark.parametrize(
    ("make", "argument"),
    [(ga.clip_by_global_norm, "max_norm"), (ga.clip, "max_delta")],
)
def test_threshold_injected_as_a_schedule_works_under_jit(make, argument):
    # optax.inject_hyperparams calls the constructor inside the traced
    # update with the threshold as a tracer: there is nothing concrete to
    # check, and the value must pass through (it used to fail in float()).
    tx = optax.inject_hyperparams(make)(**{argument: lambda step: 1.0 + step})
    grads = {"w": jnp.array([3.0, 4.0])}  # norm 5
    state = tx.init(grads)
    update = jax.jit(tx.update)
    updates, state = update(grads, state)
    expected = optax.inject_hyperparams(getattr(optax, make.__name__))(
        **{argument: lambda step: 1.0 + step}
    )
    expected_updates, _ = jax.jit(expected.update)(grads, expected.init(grads))
    np.testing.assert_array_equal(updates["w"], expected_updates["w"])
    updates, state = update(grads, state)  # threshold 2 now
    if make is ga.clip_by_global_norm:
        np.testing.assert_allclose(updates["w"], [1.2, 1.6], rtol=1e-6)
    else:
        np.testing.assert_array_equal(updates["w"], [2.0, 2.0])
