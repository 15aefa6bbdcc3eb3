"""Tensor parallelism kept by the per-device paths.

`local_value_and_grad` (with the once-per-window accumulator) and
`microbatched_value_and_grad(data_axis=)` take each device's gradient over
the data axis only. Read from the compiled HLO: on a 2-D ``data`` x
``model`` mesh they gather nothing that the plain ``jax.grad`` step of the
same layout does not gather (a tensor-parallel param is never gathered over
``model``), and their gradients keep the model split. The reference
configuration of ``benchmarks/bench_scale.py`` (0.81B params, 64 devices)
is compiled in a process of its own.
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
from helpers import compiled_reference

LAYERS, WIDTH, HIDDEN, ROWS, K = 2, 32, 128, 16, 2
SPECS = {"w1": P(None, None, "model"), "w2": P(None, "model", None)}


def _loss(params, x):
    """Scanned residual MLP blocks, the row-parallel product laid out as ``h``
    on an Explicit mesh (as the reference configuration)."""

    def block(h, weights):
        w1, w2 = weights
        hidden = jax.nn.relu(h @ w1)
        spec = jax.typeof(h).sharding.spec
        if spec:  # Explicit: the product over `model` shards sums across them
            out = jnp.matmul(hidden, w2, out_sharding=P(spec[0], None))
        else:
            out = hidden @ w2
        return h + out, None

    h, _ = jax.lax.scan(block, x, (params["w1"], params["w2"]))
    return jnp.mean(h**2)


def _mesh(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def _inputs(mesh, rows=ROWS):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = {"w1": (LAYERS, WIDTH, HIDDEN), "w2": (LAYERS, HIDDEN, WIDTH)}
    params = {
        name: jax.device_put(
            jax.random.normal(key, shapes[name]) / 8, NamedSharding(mesh, SPECS[name])
        )
        for key, name in zip(keys[:2], sorted(shapes), strict=True)
    }
    x = jax.device_put(
        jax.random.normal(keys[2], (rows, WIDTH)), NamedSharding(mesh, P("data"))
    )
    return params, x


def _step(tx, grad_fn):
    def step(params, state, x):
        grads = grad_fn(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _path(name):
    """(transformation, gradient function, rows per call) of a path."""
    adam = optax.adam(1e-3)
    if name == "plain":
        return ga.MultiSteps(adam, K), jax.grad(_loss), ROWS
    if name == "once per window":
        grad_fn = ga.local_value_and_grad(_loss, "data")
        tx = ga.MultiSteps(adam, K, unreduced_axes="data")
        return tx, lambda p, x: grad_fn(p, x)[1], ROWS
    unreduced = name == "microbatched, unreduced"
    grad_fn = ga.microbatched_value_and_grad(
        _loss, K, data_axis="data", unreduced_grads=unreduced
    )
    tx = ga.MultiSteps(adam, 1, unreduced_axes="data" if unreduced else ())
    return tx, lambda p, x: grad_fn(p, x)[1], K * ROWS


def _gathers(name, axis_type):
    """The all-gathers (their result shapes) of one jitted train step."""
    mesh = _mesh(axis_type)
    tx, grad_fn, rows = _path(name)
    with jax.set_mesh(mesh):
        params, x = _inputs(mesh, rows)
        state = tx.init(params)
        compiled = jax.jit(_step(tx, grad_fn)).lower(params, state, x).compile()
    return sorted(
        shape
        for c in collectives(compiled, mesh)
        if c.kind == "all-gather"
        for shape in c.shapes
    )


@pytest.mark.parametrize(
    "name, axis_type",
    [
        ("once per window", AxisType.Explicit),
        ("once per window", AxisType.Auto),
        ("microbatched", AxisType.Explicit),
        ("microbatched", AxisType.Auto),
        ("microbatched, unreduced", AxisType.Explicit),
    ],
)
def test_gathers_nothing_the_plain_step_does_not(name, axis_type):
    plain = _gathers("plain", axis_type)
    found = _gathers(name, axis_type)
    # Each tensor-parallel param would show as a gather of its whole
    # (LAYERS, WIDTH, HIDDEN) or (LAYERS, HIDDEN, WIDTH) block.
    assert [shape for shape in found if shape not in plain] == [], found


def test_the_gradients_keep_the_model_split():
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        params, x = _inputs(mesh)
        loss, grads = jax.jit(ga.local_value_and_grad(_loss, "data"))(params, x)
        (_, mean_grads) = jax.jit(
            ga.microbatched_value_and_grad(_loss, K, data_axis="data")
        )(params, x)
        summed = jax.jit(lambda g: jax.sharding.reshard(g, SPECS))(grads)
        expected = jax.jit(jax.grad(_loss))(params, x)
    for name, spec in SPECS.items():
        assert jax.typeof(grads[name]).sharding.spec == P(*spec, unreduced={"data"})
        assert jax.typeof(mean_grads[name]).sharding.spec == spec
        np.testing.assert_allclose(summed[name], expected[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(
            mean_grads[name], expected[name], rtol=1e-5, atol=1e-7
        )


# --- the reference configuration of benchmarks/bench_scale.py, 64 devices ---

PLAIN = "ga.MultiSteps + jax.grad"
OPTAX = "optax.MultiSteps + jax.grad"
ONCE = "once per window (local_value_and_grad)"
MICROBATCHED = "microbatched_value_and_grad(data_axis=)"


def test_reference_configuration_keeps_tensor_parallelism(tmp_path):
    """On ``data`` 8 x ``model`` 8: no all-gather on either path; the
    once-per-window path's one window-sized all-reduce inside the emission
    loop, its argument memory the plain path's, its temporaries bounded."""
    results = compiled_reference(tmp_path, OPTAX, PLAIN, ONCE, MICROBATCHED)
    for path in (ONCE, MICROBATCHED):
        assert "error" not in results[path], results[path]
        kinds = [c["kind"] for c in results[path]["collectives"]]
        assert "all-gather" not in kinds, path
    once, plain = results[ONCE], results[PLAIN]
    window = 2 * 24 * 2048 * 8192 // 8 * 4  # float32 gradients on one device
    emitted = [c for c in once["collectives"] if c["trips"] == [None]]
    assert [(c["kind"], c["axes"]) for c in emitted] == [("all-reduce", ["data"])]
    assert window <= emitted[0]["nbytes"] < window + 64
    assert once["argument_bytes"] == plain["argument_bytes"]
    # At most optax's temporaries, and the plain path's plus one window
    # (the reduced window, next to the per-device one, at the emission).
    assert once["temp_bytes"] <= results[OPTAX]["temp_bytes"]
    assert once["temp_bytes"] <= plain["temp_bytes"] + window


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_the_loss_can_sum_over_the_data_axis(axis_type):
    """As the docstring of `local_value_and_grad` says: a psum over the data
    axis inside the loss, of a scalar broadcast to the axis size."""
    mesh = _mesh(axis_type)

    def loss(w, x):
        total = jax.lax.psum(jnp.broadcast_to(jnp.sum(x), (2,)), "data")[0]
        return jnp.mean(x * w) + total * jnp.sum(w)

    x_host = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    with jax.set_mesh(mesh):
        x = jax.device_put(x_host, NamedSharding(mesh, P("data")))
        _, grads = jax.jit(ga.local_value_and_grad(loss))(jnp.ones(2), x)
        if axis_type == AxisType.Explicit:
            grads = jax.jit(lambda g: jax.sharding.reshard(g, P()))(grads)
        else:
            grads = grads.sum(0)
    # Each device's term, 1/2 of its gradient: its mean of x / 2 plus the sum.
    halves = np.split(x_host, 2)
    expected = sum((rows.mean(0) / 2 + x_host.sum()) / 2 for rows in halves)
    np.testing.assert_allclose(grads, expected, rtol=1e-6)
