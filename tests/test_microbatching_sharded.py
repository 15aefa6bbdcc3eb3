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
from gradaccum_jax.measure import all_reduce_nbytes, collectives
from helpers import scan_carries

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
            found |= {var.aval.dtype for var in scan_carries(eqn)}
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
        # Reduce-scattered over `data` in every micro-batch.
        ("fsdp", "gather-per-microbatch"),
        # Split over `model` too: gathered once per step (below).
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
            per_microbatch = "reduce-scatter" in compiled.as_text()
            assert per_microbatch == (layout == "fsdp")
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


def _loss_of_arguments(params, x, scale, y, key):
    """A loss written ``(params, x, scale, y, key)``, as multi-slice pages
    write theirs: the inputs and labels are separate arguments, with a
    constant and a PRNG key among them."""
    noise = 1e-3 * jax.random.normal(key, x.shape[:1])
    return scale * jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2 + noise)


@pytest.mark.parametrize("data_axis", [None, "dcn"])
def test_batch_argnums_splits_each_batch_argument(data_axis):
    """``batch_argnums=(1, 3)`` splits x and y into micro-batches, passes the
    constant whole and gives micro-batch i the key folded with i: the loss
    and gradients of the whole batch, on one device and over `dcn`."""
    params = jax.tree.map(jnp.asarray, make_params())
    batch = make_batch()
    x, y = batch["x"], batch["y"][:, 0]
    key = jax.random.key(4)
    grad_fn = microbatched_value_and_grad(
        lambda p, x, scale, y, key: _loss_of_arguments(
            {"w": p["w"][:, 0], "b": p["b"][0]}, x, scale, y, key
        ),
        NUM_MICROBATCHES,
        batch_argnums=(1, 3),
        key_argnum=4,
        data_axis=data_axis,
    )
    args = (x, jnp.float32(2.0), y, key)
    if data_axis is None:
        value, grads = jax.jit(grad_fn)(params, *args)
    else:
        mesh = jax.make_mesh((8,), ("dcn",), axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            placed = [jax.device_put(a, P("dcn")) for a in (x, y)]
            value, grads = jax.jit(grad_fn)(
                jax.device_put(params, P()), placed[0], args[1], placed[1], key
            )

    def whole(p):  # each micro-batch's noise from its own folded key
        parts = [
            _loss_of_arguments(
                {"w": p["w"][:, 0], "b": p["b"][0]},
                x[i::NUM_MICROBATCHES],
                2.0,
                y[i::NUM_MICROBATCHES],
                jax.random.fold_in(key, i),
            )
            for i in range(NUM_MICROBATCHES)
        ]
        return sum(parts) / NUM_MICROBATCHES

    expected_value, expected_grads = jax.value_and_grad(whole)(params)
    if data_axis is None:  # the noise differs per device's fold otherwise
        np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    chex.assert_trees_all_close(
        jax.tree.map(lambda g: g.astype(jnp.float32), grads),
        jax.tree.map(lambda g: g.astype(jnp.float32), expected_grads),
        rtol=1e-5,
        atol=1e-6,
    )


def test_an_unsplit_argument_split_like_the_batch_is_refused():
    """With ``data_axis``, an argument after the batch that ``batch_argnums``
    does not name but whose leading axis is split over `data_axis` (the
    labels of ``loss_fn(params, x, y)``) is refused, naming its position;
    it died inside the loss with a broadcasting TypeError."""
    mesh = jax.make_mesh((8,), ("dcn",), axis_types=(AxisType.Explicit,))
    batch = make_batch()
    grad_fn = microbatched_value_and_grad(
        lambda p, x, y: jnp.mean((x @ p["w"] - y) ** 2),
        NUM_MICROBATCHES,
        data_axis="dcn",
    )
    with jax.set_mesh(mesh):
        x, y = (jax.device_put(batch[k], P("dcn")) for k in ("x", "y"))
        params = jax.device_put({"w": make_params()["w"]}, P())
        with pytest.raises(ValueError, match=r"argument 2 has its leading axis split"):
            jax.jit(grad_fn)(params, x, y)


def _scanned_fsdp_tp_step(gather_params_once):
    """The 0.81B reference's blocks in small, made FSDP + tensor parallel
    (`w1` P(None, "data", "model"), `w2` P(None, "model", "data"), three
    scanned layers), on `data` 4 x `model` 2: compiled, with the
    collectives over `model` of that step and of plain ``jax.grad``."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def loss(params, x):
        rows = jax.typeof(x).sharding.spec[0]

        def layer(h, w):
            u = jnp.tanh(jnp.matmul(h, w[0], out_sharding=P(rows, "model")))
            return jnp.matmul(u, w[1], out_sharding=P(rows, None)), None

        h, _ = jax.lax.scan(layer, x, (params["w1"], params["w2"]))
        return jnp.mean(h**2)

    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        params = {
            "w1": jax.device_put(
                rng.standard_normal((3, 64, 128)).astype(np.float32) * 0.1,
                P(None, "data", "model"),
            ),
            "w2": jax.device_put(
                rng.standard_normal((3, 128, 64)).astype(np.float32) * 0.1,
                P(None, "model", "data"),
            ),
        }
        x = jax.device_put(rng.standard_normal((32, 64)).astype(np.float32), P("data"))
        fn = microbatched_value_and_grad(
            loss, 2, data_axis="data", gather_params_once=gather_params_once
        )
        compiled = jax.jit(fn).lower(params, x).compile()
        grads = jax.jit(fn)(params, x)[1]
        plain = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
        expected = jax.value_and_grad(loss)(params, x)[1]

    def over_model(c):
        return sorted(
            (op.kind, op.nbytes) for op in collectives(c, mesh) if "model" in op.axes
        )

    chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-7)
    return compiled, over_model(compiled), over_model(plain)


def test_params_split_over_model_too_are_gathered_once_per_step():
    """``gather_params_once=False`` with params split over `data` (FSDP) and
    `model` (tensor parallel): a ``shard_map`` manual over `data` would
    all-gather them over `model` at its boundary (6 gathers here; 1,152 MiB
    a device on the 0.81B reference, 3.19 GiB of temporaries against 1.13):
    they are gathered once per step instead, with no collective over
    `model` that the plain step has not, and the temporaries of True."""
    compiled, over_model, plain_over_model = _scanned_fsdp_tp_step(False)
    once, once_over_model, _ = _scanned_fsdp_tp_step(True)
    assert over_model == once_over_model
    assert {kind for kind, _ in over_model} <= {k for k, _ in plain_over_model}
    assert "all-gather" not in {kind for kind, _ in over_model}
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries <= once.memory_analysis().temp_size_in_bytes
