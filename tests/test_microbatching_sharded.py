"""microbatched_value_and_grad on sharded parameters under ``jax.jit``.

Tensor-parallel (``P(None, "model")``), FSDP (``P("data", None)``) and
both (``P("data", "model")``) parameters on an Explicit ``data`` x ``model``
mesh, and FSDP placement on a 1-D Auto mesh, with and without ``data_axis``,
with ``unreduced_grads`` and with ``gather_params_once=False``.
Each case compiles once and compares with ``jax.value_and_grad`` on the
whole batch on one device. One parameter leaf is bfloat16: it
is accumulated in float32 and its gradient comes back in bfloat16.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from gradaccum_jax import microbatched_value_and_grad
from gradaccum_jax._tree import reduce_unreduced
from gradaccum_jax.measure import all_reduce_nbytes

BATCH, IN_DIM, OUT_DIM, NUM_MICROBATCHES = 32, 8, 4, 2


def loss_fn(params, batch):
    # The bfloat16 leaf `v` runs its matmul in bfloat16, as a mixed-precision
    # model would; the loss itself is float32.
    x = batch["x"]
    hidden = x @ params["w"] + (x.astype(jnp.bfloat16) @ params["v"]).astype(x.dtype)
    return jnp.mean((jnp.tanh(hidden + params["b"]) - batch["y"]) ** 2)


def make_params():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((IN_DIM, OUT_DIM)).astype(np.float32) * 0.3,
        # Multiples of 1/16 in [-1/2, 1/2], and inputs in {-1, 0, 1}: every
        # partial sum of `x @ v` fits bfloat16's 8 significant bits, so the
        # forward pass is exact whatever the matmul's shape and order (XLA:CPU
        # sums a whole-batch bfloat16 matmul and a device's block
        # differently, a rounding apart).
        "v": (rng.integers(-8, 9, (IN_DIM, OUT_DIM)) / 16).astype(jnp.bfloat16),
        "b": rng.standard_normal(OUT_DIM).astype(np.float32),
    }


def make_batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.integers(-1, 2, (BATCH, IN_DIM)).astype(np.float32),
        "y": rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32),
    }


@functools.cache
def whole_batch_reference():
    """Loss and gradients of the whole batch on one device, unsharded."""
    return jax.jit(jax.value_and_grad(loss_fn))(make_params(), make_batch())


def scan_carry_dtypes(jaxpr):
    """The dtypes of the scan carries (the accumulators) anywhere in
    ``jaxpr``, inside ``shard_map`` too."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            start = eqn.params["num_consts"]
            carry = eqn.invars[start : start + eqn.params["num_carry"]]
            found |= {var.aval.dtype for var in carry}
        for value in eqn.params.values():
            if isinstance(value, jax.extend.core.ClosedJaxpr):
                value = value.jaxpr
            if isinstance(value, jax.extend.core.Jaxpr):
                found |= scan_carry_dtypes(value)
    return found


EXPLICIT_2D = ((4, 2), ("data", "model"), (AxisType.Explicit,) * 2)
AUTO_1D = ((8,), ("data",), (AxisType.Auto,))
# Where each layout puts the matrices `w` and `v`; `b` stays replicated.
LAYOUTS = {
    "tensor-parallel": (EXPLICIT_2D, P(None, "model")),
    "fsdp": (EXPLICIT_2D, P("data", None)),
    "fsdp-tensor-parallel": (EXPLICIT_2D, P("data", "model")),
    "auto-fsdp": (AUTO_1D, P("data", None)),
}
MODES = {
    "no-data-axis": {},
    "data-axis": {"data_axis": "data"},
    "unreduced": {"data_axis": "data", "unreduced_grads": True},
    "gather-per-microbatch": {"data_axis": "data", "gather_params_once": False},
}
CASES = [
    pytest.param(layout, mode, id=f"{layout}-{mode}")
    for layout, mode in [
        ("tensor-parallel", "no-data-axis"),
        ("tensor-parallel", "data-axis"),
        ("tensor-parallel", "unreduced"),
        ("fsdp", "no-data-axis"),
        ("fsdp", "data-axis"),
        ("fsdp", "unreduced"),
        # Reduce-scattered over `data` in every micro-batch, still split
        # over `model`.
        ("fsdp-tensor-parallel", "gather-per-microbatch"),
        # Unreduced arrays are a type of Explicit sharding: not on Auto.
        ("auto-fsdp", "no-data-axis"),
        ("auto-fsdp", "data-axis"),
    ]
]


def place(params, batch, matrix_spec):
    """``params`` and ``batch`` on the current mesh: the matrices laid out
    as ``matrix_spec``, the batch sharded over ``data``."""
    specs = {"w": matrix_spec, "v": matrix_spec, "b": P()}
    params = {name: jax.device_put(leaf, specs[name]) for name, leaf in params.items()}
    return params, jax.device_put(batch, P("data"))


def expected_spec(param_spec, mode):
    """The gradient's sharding: the parameter's, except that unreduced
    gradients are whole along ``data`` (an axis they are summed over)."""
    if mode != "unreduced":
        return param_spec
    partitions = [None if entry == "data" else entry for entry in param_spec]
    return P(*partitions, unreduced={"data"})


@pytest.mark.parametrize("layout, mode", CASES)
def test_sharded_params_match_the_whole_batch(layout, mode):
    (mesh_shape, axis_names, axis_types), matrix_spec = LAYOUTS[layout]
    mesh = jax.make_mesh(mesh_shape, axis_names, axis_types=axis_types)
    fn = microbatched_value_and_grad(loss_fn, NUM_MICROBATCHES, **MODES[mode])
    with jax.set_mesh(mesh):
        params, batch = place(make_params(), make_batch(), matrix_spec)
        compiled = jax.jit(fn).lower(params, batch).compile()
        loss, grads = compiled(params, batch)
        # The bfloat16 gradient is summed in float32, like the others.
        carry = scan_carry_dtypes(jax.make_jaxpr(fn)(params, batch).jaxpr)
        assert carry == {jnp.dtype(jnp.float32)}
        if axis_types[0] == AxisType.Explicit:
            for name in grads:
                param_spec = jax.typeof(params[name]).sharding.spec
                assert jax.typeof(grads[name]).sharding.spec == expected_spec(
                    param_spec, mode
                ), name
        if mode == "gather-per-microbatch":
            assert "reduce-scatter" in compiled.as_text()
        if mode == "unreduced":
            # Only scalars are all-reduced (the loss and the total weight;
            # with tensor parallelism, the loss's sum over `model` too): fewer
            # bytes than the smallest gradient, b's (OUT_DIM float32).
            assert all_reduce_nbytes(compiled) < 4 * OUT_DIM
            grads = jax.jit(reduce_unreduced)(grads)
    chex.assert_trees_all_equal_dtypes(grads, make_params())
    expected_loss, expected_grads = whole_batch_reference()
    # The float32 leaves match tightly. `v`'s gradient is a sum over the
    # batch rounded to bfloat16, here once per micro-batch (then summed in
    # float32 and rounded again): equal to a bfloat16 rounding or two.
    chex.assert_trees_all_close(
        (loss, grads["w"], grads["b"]),
        (expected_loss, expected_grads["w"], expected_grads["b"]),
        rtol=1e-5,
        atol=1e-6,
    )
    chex.assert_trees_all_close(
        grads["v"].astype(jnp.float32),
        expected_grads["v"].astype(jnp.float32),
        rtol=2e-2,
        atol=1e-3,
    )


@pytest.mark.parametrize(
    "layout, mode",
    [
        ("tensor-parallel", "data-axis"),
        ("tensor-parallel", "unreduced"),
        ("fsdp-tensor-parallel", "gather-per-microbatch"),
    ],
)
def test_a_float16_accumulator_of_heavy_micro_batches_does_not_overflow(layout, mode):
    """Micro-batches of 10,000 tokens each: a float16 sum of the weights
    (20,000 per device, 160,000 in all) or of the weighted gradients
    overflows at 65504. The gradients are kept as a running mean in float16
    (sent in float16 too), the weights and the loss in float32."""
    (mesh_shape, axis_names, axis_types), matrix_spec = LAYOUTS[layout]
    mesh = jax.make_mesh(mesh_shape, axis_names, axis_types=axis_types)
    fn = microbatched_value_and_grad(
        loss_fn,
        NUM_MICROBATCHES,
        weight_fn=lambda micro_batch: 10_000.0,
        accumulator_dtype=jnp.float16,
        **MODES[mode],
    )
    with jax.set_mesh(mesh):
        params, batch = place(make_params(), make_batch(), matrix_spec)
        loss, grads = jax.jit(fn)(params, batch)
        carry = scan_carry_dtypes(jax.make_jaxpr(fn)(params, batch).jaxpr)
        if mode == "unreduced":
            grads = jax.jit(reduce_unreduced)(grads)
    expected_loss, expected_grads = whole_batch_reference()
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    # Equal weights: the mean of the micro-batches' gradients, within
    # float16's rounding of each micro-batch's share.
    for name in ("w", "b"):
        np.testing.assert_allclose(
            grads[name], expected_grads[name], rtol=2e-3, atol=2e-4, err_msg=name
        )
    assert carry == {jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)}
