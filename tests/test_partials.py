"""Per-device terms keep a tensor-parallel split (`gradaccum_jax._partials`).

On a ``data`` x ``model`` mesh with a param split ``P(None, "model")``, the
once-per-window step (per-device terms over ``data``) must gather nothing
over ``model`` that the plain ``jax.grad`` step of the same layout does not
gather, whatever part reads the terms (the noise scale's per-micro-batch
norms, the ternary window reduction); and the window kept on each device of
an Auto mesh must hold the param's split, not a replicated copy of it.
Read from the compiled program (`gradaccum_jax.measure.collectives`,
``memory_analysis``): the leaves are large enough (256 x 512) that a gather
would show.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax.measure import collectives

MESH_SHAPE = (2, 4)  # data x model
TENSOR_PARALLEL = P(None, "model")
SHAPE = (256, 512)
ROWS = 16  # examples per micro-batch, split over data


def _mesh(axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(axis_type,) * 2)


def _loss(w, x):
    return jnp.mean(jnp.square(x @ w))


def _device_terms(axis_type: AxisType):
    """The gradient as per-device terms over ``data``, the model split kept:
    unreduced (params marked reduced over ``data``, JAX's own rule) on an
    Explicit mesh, stacked (`local_value_and_grad`) on an Auto one."""
    if axis_type == AxisType.Explicit:

        def grad(w, x):
            reduced = jax.sharding.reshard(w, P(*TENSOR_PARALLEL, reduced={"data"}))
            return jax.grad(_loss)(reduced, x)

        return grad
    return lambda w, x: ga.local_value_and_grad(_loss, "data")(w, x)[1]


def _compiled_step(axis_type: AxisType, per_device: bool, **options):
    """A donated train step (gradient, update, apply) compiled on the mesh,
    with its arguments."""
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        w = jax.device_put(
            jnp.full(SHAPE, 0.01, jnp.float32), NamedSharding(mesh, TENSOR_PARALLEL)
        )
        x = jax.device_put(
            jnp.ones((ROWS, SHAPE[0]), jnp.float32), NamedSharding(mesh, P("data"))
        )
        if per_device:
            opt = ga.MultiSteps(optax.sgd(0.1), 2, unreduced_axes="data", **options)
            grad = _device_terms(axis_type)
        else:
            opt = ga.MultiSteps(optax.sgd(0.1), 2, **options)
            grad = jax.grad(_loss)

        def step(w, state, x):
            updates, state = opt.update(grad(w, x), state, w)
            return optax.apply_updates(w, updates), state

        state = opt.init(w)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(w, state, x).compile()
        return compiled, state


def _gathers(compiled) -> list[tuple[str, ...]]:
    return sorted(c.shapes for c in collectives(compiled) if c.kind == "all-gather")


PARTS = {
    "noise-scale-sampled": dict(track_noise_scale=True),
    "noise-scale-all": dict(track_noise_scale=True, noise_scale_estimator="all"),
}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("part", sorted(PARTS))
def test_noise_scale_terms_gather_nothing_the_plain_step_does_not(axis_type, part):
    plain, _ = _compiled_step(axis_type, False, **PARTS[part])
    per_device, _ = _compiled_step(axis_type, True, **PARTS[part])
    assert _gathers(per_device) == _gathers(plain) == []
    # Each device's norm reads its block: one scalar sum over `model`.
    model_reduces = [
        c
        for c in collectives(per_device, _mesh(axis_type))
        if c.kind == "all-reduce" and c.axes == ("model",)
    ]
    assert model_reduces and all(c.nbytes <= 4 for c in model_reduces)


def test_ternary_window_reduction_codes_each_device_block_on_an_explicit_mesh():
    """Each device codes its own block of a tensor-parallel term: nothing is
    gathered over ``model``. (On an Auto mesh the split is the compiler's,
    not in the types, and each device codes its whole term:
    `gradaccum_jax._partials.Stacked.over_terms`.)"""
    options = dict(window_reduction=ga.ternary_window_reduction(0))
    plain, _ = _compiled_step(AxisType.Explicit, False)
    per_device, _ = _compiled_step(AxisType.Explicit, True, **options)
    assert _gathers(per_device) == _gathers(plain) == []


def test_the_stacked_window_of_an_auto_mesh_keeps_the_model_split():
    """A (16, 32) param split P(None, "model") over 4 devices: each device
    keeps a (16, 8) block of the window's rows, its term, as on an Explicit
    mesh, through init and a jitted step; the step's argument
    bytes are the plain step's but for the per-device scalars."""
    mesh = _mesh(AxisType.Auto)
    opt = ga.MultiSteps(optax.sgd(0.1), 2, unreduced_axes="data")
    plain_opt = ga.MultiSteps(optax.sgd(0.1), 2)
    with jax.set_mesh(mesh):
        w = jax.device_put(
            jnp.ones((16, 32), jnp.float32), NamedSharding(mesh, TENSOR_PARALLEL)
        )
        x = jax.device_put(
            jnp.ones((ROWS, 16), jnp.float32), NamedSharding(mesh, P("data"))
        )
        state = opt.init(w)
        assert state.acc_grads.addressable_shards[0].data.shape == (16, 8)
        grad = _device_terms(AxisType.Auto)

        def step(w, state, x):
            updates, state = opt.update(grad(w, x), state, w)
            return optax.apply_updates(w, updates), state

        def plain_step(w, state, x):
            updates, state = plain_opt.update(jax.grad(_loss)(w, x), state, w)
            return optax.apply_updates(w, updates), state

        compiled = jax.jit(step).lower(w, state, x).compile()
        w, state = jax.jit(step)(w, state, x)
        jax.block_until_ready(state)
        assert state.acc_grads.addressable_shards[0].data.shape == (16, 8)
        plain = jax.jit(plain_step).lower(w, plain_opt.init(w), x).compile()
    extra = (
        compiled.memory_analysis().argument_size_in_bytes
        - plain.memory_analysis().argument_size_in_bytes
    )
    # The window weight and mini-step counters: a few stacked scalars.
    assert 0 <= extra <= 64
    np.testing.assert_allclose(
        jax.device_get(state.acc_grads).reshape(-1, 16, 32).sum(0),  # its rows
        jax.device_get(jax.grad(_loss)(jnp.ones((16, 32)), jnp.ones((ROWS, 16)))),
        rtol=1e-6,
    )
