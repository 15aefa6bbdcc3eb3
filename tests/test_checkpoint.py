"""Every state saves and restores with orbax-checkpoint mid-window, and the
resumed run is bit-identical to the uninterrupted one.

Each case runs STEPS jitted updates without interruption, then again with a
save after SAVE_AT steps (mid-window), a restore against the abstract target
``jax.eval_shape(tx.init, params)`` of a transformation built anew from the
same configuration (as a new process would) and the remaining steps. All
leaves of params and state must be equal bit for bit, with the same
NamedTuple types, shapes and dtypes.

Measured: every state type round-trips, including ``optax.MaskedNode``
leaves (the ternary states' uncompressed leaves), ``()`` empty states, bool
and uint32 (PRNG key data) leaves, and bfloat16 params.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

STEPS = 11
SAVE_AT = 5  # with every_k = 3: one window emitted, two micro-steps into the next


# Inputs are NumPy arrays and the only JAX computations are jitted: on a
# busy CPU every eager op costs a compilation of its own (~0.3 s each).


def _params(dtype=jnp.float32) -> dict[str, np.ndarray]:
    # "w" has 768 elements, enough for the ternary transformations to compress
    # it; "b" (12 elements) stays uncompressed: both code paths are saved.
    rng = np.random.default_rng(0)
    return {
        "b": rng.normal(size=(12,)).astype(dtype),
        "w": rng.normal(size=(64, 12)).astype(dtype),
    }


def _grads(step: int, params: Any, nan: bool = True) -> Any:
    """Micro-batch gradients; with ``nan``, step 4 (mid-window) holds a NaN."""
    rng = np.random.default_rng(100 + step)

    def leaf(p):
        g = rng.normal(size=p.shape) * (1.0 + step)
        if nan and step == 4:
            g.flat[0] = np.nan
        return g.astype(p.dtype)

    return jax.tree.map(leaf, params)


def _nan_free_grads(step: int, params: Any) -> Any:
    return _grads(step, params, nan=False)


def _weight(step: int) -> np.float32:
    return np.float32(1 + step % 4)


def _vmapped(tx: optax.GradientTransformation, axis_size: int = 4):
    """``tx`` over a named vmap axis: a state per device, as under pmap."""

    def init(params):
        return jax.vmap(tx.init, axis_size=axis_size, in_axes=None)(params)

    def update(grads, state, params=None, *, weight=None):
        # Device d sees (d + 1) * grads with weight (d + 1) * weight.
        device_scales = jnp.arange(1, axis_size + 1, dtype=jnp.float32)

        def per_device(scale, device_state):
            device_grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            return tx.update(device_grads, device_state, params, weight=scale * weight)

        updates, state = jax.vmap(per_device, axis_name="devices")(device_scales, state)
        # The averaged updates are the same on every device.
        return jax.tree.map(lambda u: u[0], updates), state

    return optax.GradientTransformationExtraArgs(init, update)


class Case(NamedTuple):
    make_tx: Callable[[], Any]  # called anew for the restore target
    grads: Callable[[int, Any], Any]  # grads(step, params)
    dtype: Any = jnp.float32  # of params and gradients
    weighted: bool = True  # pass weight= to update


CASES: dict[str, Case] = {
    "multisteps_adam": Case(
        lambda: ga.MultiSteps(optax.adam(1e-2), every_k_schedule=3), _nan_free_grads
    ),
    "multisteps_adam_bfloat16": Case(
        lambda: ga.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
        _nan_free_grads,
        dtype=jnp.bfloat16,
    ),
    "multisteps_skip_not_finite": Case(
        lambda: ga.MultiSteps(
            optax.sgd(0.1, momentum=0.9),
            every_k_schedule=3,
            should_skip_update_fn=ga.skip_not_finite,
        ),
        _grads,
    ),
    "multisteps_schedule": Case(
        lambda: ga.MultiSteps(
            optax.adam(1e-2), every_k_schedule=lambda step: 3 + step % 2
        ),
        _nan_free_grads,
        weighted=False,
    ),
    # The statistics' states by name (the noise scale's NoiseScaleState) and
    # the adaptive window's size.
    "multisteps_noise_scale_adaptive": Case(
        lambda: ga.MultiSteps(
            optax.adam(1e-2),
            ga.adaptive_every_k(1, k_min=2, k_max=4),
            track_noise_scale=True,
            noise_scale_estimator="all",
        ),
        _nan_free_grads,
    ),
    "chain_clip_accumulate": Case(
        lambda: optax.chain(
            ga.clip_by_global_norm(5.0), ga.accumulate(optax.adam(1e-2), 3)
        ),
        _nan_free_grads,
    ),
    "chain_clip_clip_adam": Case(
        lambda: optax.chain(
            ga.clip(2.0), ga.clip_by_global_norm(5.0), optax.adam(1e-2)
        ),
        _nan_free_grads,
        weighted=False,
    ),
    "ternarize": Case(
        lambda: optax.chain(ga.ternarize(seed=7), optax.sgd(0.1)),
        _nan_free_grads,
        weighted=False,
    ),
    "ternarize_deterministic_no_feedback": Case(
        lambda: optax.chain(
            ga.ternarize(seed=7, stochastic=False, error_feedback=False, min_size=0),
            optax.sgd(0.1),
        ),
        _nan_free_grads,
        weighted=False,
    ),
    # Also covers plain ternary_accumulate: the same state, plus skip_state.
    "ternary_accumulate_skip": Case(
        lambda: ga.ternary_accumulate(
            optax.adam(1e-2), 3, seed=5, should_skip_update_fn=ga.skip_not_finite
        ),
        _grads,
    ),
    # Fragments of different shapes: w's 64 rows in blocks of 22, 21, 21,
    # each with its own outer momentum; one syncs on every step.
    "diloco_fragments_of_rows": Case(
        lambda: ga.diloco(
            optax.adam(1e-2),
            3,
            outer=optax.sgd(0.5, momentum=0.9),
            fragments=3,
            fragment_axis=0,
        ),
        _nan_free_grads,
    ),
    "multisteps_ternary_average_vmapped": Case(
        lambda: _vmapped(
            ga.MultiSteps(
                optax.chain(
                    ga.ternary_average_across_devices("devices", seed=2),
                    optax.sgd(0.1, momentum=0.9),
                ),
                every_k_schedule=3,
            )
        ),
        _nan_free_grads,
    ),
}


def _stepper(tx, weighted: bool) -> Callable[..., Any]:
    @jax.jit
    def step(params, state, grads, weight):
        kwargs = {"weight": weight} if weighted else {}
        updates, state = tx.update(grads, state, params, **kwargs)
        return optax.apply_updates(params, updates), state

    return step


def _run(step, params, state, grads_fn, steps):
    # Committed inputs from the start: jit would compile again for the
    # committed arrays it returns after the first step.
    params, state = jax.device_put((params, state), jax.devices()[0])
    for i in steps:
        params, state = step(params, state, grads_fn(i, params), _weight(i))
    return params, state


def _assert_bitwise_equal(actual: Any, expected: Any) -> None:
    """Same tree (NamedTuple types included), shapes, dtypes and bits."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, want), have in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0],
        jax.tree.leaves(actual),
        strict=True,
    ):
        np.testing.assert_array_equal(
            np.asarray(have),
            np.asarray(want),
            err_msg=jax.tree_util.keystr(path),
            strict=True,  # shapes and dtypes too
        )


def _window_fill(state: Any) -> list[int]:
    """mini_step of every accumulation state inside ``state``."""
    fills = []

    def visit(node):
        if isinstance(node, ga.MultiStepsState):
            fills.append(np.asarray(node.mini_step).ravel().tolist())
        return node

    jax.tree.map(visit, state, is_leaf=lambda n: isinstance(n, ga.MultiStepsState))
    return fills


def _save_and_restore(path, params, state, make_tx) -> tuple[Any, Any]:
    """Round trip through orbax; the target is abstract, as in a new process."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()
    tx = make_tx()
    target = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params)
    restored = checkpointer.restore(path, target)
    checkpointer.close()
    # The treedef holds the NamedTuple classes: restoring against the abstract
    # target gives back MultiStepsState, TernaryState, ... not dicts.
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    return restored["params"], restored["opt_state"]


def _assert_resume_is_bit_identical(case, tmp_path, fresh_transformation):
    make_tx, grads_fn, dtype, weighted = CASES[case]
    params = _params(dtype)
    tx = make_tx()
    # One compiled step for all three runs: compiling is most of the cost.
    step = _stepper(tx, weighted)
    initial = jax.jit(tx.init)(params)
    expected = _run(step, params, initial, grads_fn, range(STEPS))

    saved = _run(step, params, initial, grads_fn, range(SAVE_AT))
    fills = _window_fill(saved[1])
    assert all(fill and min(fill) > 0 for fill in fills), f"not mid-window: {fills}"
    restored = _save_and_restore(tmp_path / "ckpt", *saved, make_tx)
    del saved
    if fresh_transformation:
        step = _stepper(make_tx(), weighted)
    resumed = _run(step, *restored, grads_fn, range(SAVE_AT, STEPS))
    _assert_bitwise_equal(resumed, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_mid_window_is_bit_identical(case, tmp_path):
    _assert_resume_is_bit_identical(case, tmp_path, fresh_transformation=False)


@pytest.mark.parametrize(
    "case", ["multisteps_skip_not_finite", "chain_clip_accumulate"]
)
def test_resume_with_a_fresh_transformation_is_bit_identical(case, tmp_path):
    """A new process builds a new transformation: no Python-side state."""
    _assert_resume_is_bit_identical(case, tmp_path, fresh_transformation=True)


# --- unreduced windows --------------------------------------------------------


PER_DEVICE = {
    "MultiSteps": lambda: ga.MultiSteps(optax.adam(0.1), 3, unreduced_axes="data"),
    # Its window is stacked per device, its weight a term.
    "ternary_accumulate": lambda: ga.ternary_accumulate(
        optax.adam(0.1), 3, unreduced_axes="data", min_size=16
    ),
}


REPLICATED = P()


def _per_device_run(
    make_tx, mesh, state=None, start=0, stop=5, spec=REPLICATED, dtype=jnp.float32
):
    """Steps ``start``..``stop`` of a per-device window on ``mesh`` (a
    ``local_value_and_grad`` step) of a ``(64, 8)`` param split ``spec`` in
    ``dtype``: the params and state after them."""
    rs = np.random.RandomState(0)
    xs = rs.randn(stop, 32, 64).astype(np.float32)
    with jax.set_mesh(mesh):
        tx = make_tx()
        grad_fn = ga.local_value_and_grad(
            lambda p, x: jnp.mean((x.astype(dtype) @ p["w"]).astype(jnp.float32) ** 2),
            "data",
        )

        @jax.jit
        def step(params, state, x):
            _, grads = grad_fn(params, x)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        params = {"w": jax.device_put(jnp.full((64, 8), 0.1, dtype), spec)}
        state = jax.jit(tx.init)(params) if state is None else state
        for i in range(start, stop):
            params, state = jax.block_until_ready(
                step(params, state, jax.device_put(xs[i], P("data")))
            )
        return params, state


@pytest.mark.parametrize("make", sorted(PER_DEVICE))
def test_a_per_device_state_saves_as_it_is_and_resumes_bitwise(make, tmp_path):
    """No unreduced array in the state: orbax saves it mid-window, and the
    restored run is the uninterrupted one, bit for bit."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    make_tx = PER_DEVICE[make]
    expected, _ = _per_device_run(make_tx, mesh)
    params, state = _per_device_run(make_tx, mesh, stop=2)  # mid-window
    assert not any(ga._tree.unreduced_axes(leaf) for leaf in jax.tree.leaves(state))
    assert state.acc_weight.shape == (8,)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "raw", state)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "raw", state)
    resumed, _ = _per_device_run(make_tx, mesh, state=restored, start=2)
    np.testing.assert_array_equal(resumed["w"], expected["w"])


def _mesh_of(devices: int) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (devices,),
        ("data",),
        axis_types=(AxisType.Explicit,),
        devices=jax.devices()[:devices],
    )


def test_a_float_window_resumes_on_another_number_of_devices():
    """Saved on 8 devices mid-window, restored as host arrays on 4: the
    rows are summed on the first call and the window goes on."""
    make_tx = PER_DEVICE["MultiSteps"]
    expected, _ = _per_device_run(make_tx, _mesh_of(8))
    _, state = _per_device_run(make_tx, _mesh_of(8), stop=2)
    host = jax.device_get(state)
    assert host.acc_grads["w"].shape == (8 * 64, 8)
    params, state = _per_device_run(make_tx, _mesh_of(4), state=host, start=2)
    assert state.acc_grads["w"].shape == (4 * 64, 8)
    np.testing.assert_allclose(params["w"], expected["w"], rtol=1e-5, atol=1e-7)


def test_a_tensor_parallel_bfloat16_window_saves_and_resumes_on_2d_meshes(tmp_path):
    """On `data` 4 x `model` 2, bfloat16 params split over `model`: the
    window's rows keep the split (one (64, 4) float32 block per device),
    orbax saves and restores the state as it is, and the run goes on
    bitwise; restored as host arrays on `data` 2 x `model` 2, the rows are
    summed on the first call and the window goes on, split again."""
    make_tx = PER_DEVICE["MultiSteps"]
    on_8 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    on_4 = jax.make_mesh(
        (2, 2),
        ("data", "model"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices()[:4],
    )
    run = functools.partial(
        _per_device_run, make_tx, spec=P(None, "model"), dtype=jnp.bfloat16
    )
    expected, _ = run(on_8)
    _, state = run(on_8, stop=2)
    window = state.acc_grads["w"]
    assert (window.shape, window.dtype) == ((4 * 64, 8), jnp.float32)
    assert window.sharding.spec == P("data", "model")
    assert window.addressable_shards[0].data.shape == (64, 4)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "raw", state)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "raw", state)
    resumed, _ = run(on_8, state=restored, start=2)
    assert resumed["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(resumed["w"], expected["w"])
    moved, state = run(on_4, state=jax.device_get(state), start=2)
    assert state.acc_grads["w"].sharding.spec == P("data", "model")
    np.testing.assert_allclose(
        moved["w"].astype(np.float32),
        expected["w"].astype(np.float32),
        rtol=1e-2,
        atol=2e-3,  # bfloat16 near 0; a dropped window moves adam's by 0.1
    )


def test_a_per_device_ternary_window_refuses_another_number_of_devices():
    make_tx = PER_DEVICE["ternary_accumulate"]
    _, state = _per_device_run(make_tx, _mesh_of(8), stop=2)
    with pytest.raises(
        ValueError,
        match=r"state\.acc_grads\S* holds the windows of 8 devices.*4 devices",
    ):
        _per_device_run(make_tx, _mesh_of(4), state=jax.device_get(state), start=2)


def test_unreduced_axes_docstring_says_what_to_checkpoint():
    doc = " ".join(ga.MultiSteps.__init__.__doc__.split())
    unreduced_axes = doc[doc.index("unreduced_axes:") : doc.index("window_reduction:")]
    assert "the state is saved as it is" in unreduced_axes
    reduce_window = " ".join(ga.MultiSteps.reduce_window.__doc__.split())
    assert "shaped like the params" in reduce_window
