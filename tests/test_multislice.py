"""Multi-slice layouts: a ``dcn`` x ``data`` x ``model`` mesh.

Slices joined by a slow network (``dcn``), fast links inside (``data``,
``model``): the gradient is reduced over ``data`` on every micro-step and
over ``dcn`` once per window (as float32, or as ternary codes), or DiLoCo
syncs the slices while data parallelism runs inside each. On 8 emulated
devices as 2 x 2 x 2, each recipe is checked twice: its values against one
device's big-batch computation (or the same recipe with one device per
slice), and its compiled program with `gradaccum_jax.measure.collectives`,
which names each collective's mesh axes and where it runs: over ``dcn``
only inside the emission (or sync) loop, over ``data`` in the entry, on
every call.
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
from gradaccum_jax.measure import collectives
from helpers import compiled_reference

AXES = ("dcn", "data", "model")
K = 2  # micro-batches per window (or inner steps per DiLoCo sync)
ROWS = 32  # rows of one micro-batch, over the whole mesh
FEATURES, HIDDEN = 4, 8


def _mesh(kind: AxisType, shape=(2, 2, 2)) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, AXES, axis_types=(kind,) * 3)


def _loss(explicit: bool):
    """A tensor-parallel MLP's mean squared output: ``w1`` column- and
    ``w2`` row-parallel over ``model``. On an Explicit mesh the row-parallel
    product says where its result lies (split by rows as the batch is)."""

    def loss_fn(params, x):
        h = jnp.tanh(x @ params["w1"])
        if explicit:
            rows = jax.typeof(x).sharding.spec[0]
            out = jnp.matmul(h, params["w2"], out_sharding=P(rows))
        else:
            out = h @ params["w2"]
        return jnp.mean(out**2)

    return loss_fn


def _params(tensor_parallel: bool):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((FEATURES, HIDDEN), np.float32) * 0.5,
        "w2": rng.standard_normal((HIDDEN,), np.float32) * 0.5,
    }
    specs = (
        {"w1": P(None, "model"), "w2": P("model")}
        if tensor_parallel
        else {"w1": P(), "w2": P()}
    )
    return jax.tree.map(jax.device_put, params, specs)


def _batches(count: int = K) -> np.ndarray:
    rng = np.random.default_rng(1)
    return rng.standard_normal((count, ROWS, FEATURES), np.float32)


def _on_slices_and_data(x: np.ndarray) -> jax.Array:
    """A micro-batch split over the slices, and over ``data`` inside each."""
    return jax.device_put(x, P(("dcn", "data")))


def _big_batch_gradient(params, batches: np.ndarray):
    """The gradient of the mean loss over all micro-batches, on one device."""
    host = jax.tree.map(np.asarray, params)
    whole = batches.reshape(-1, FEATURES)
    return jax.jit(jax.grad(_loss(False)))(host, whole)


def _with_spec(tree, **kinds):
    """Each leaf's type with its partitions kept and ``reduced=`` or
    ``unreduced=`` set: a mark, nothing moves."""

    def mark(leaf):
        partitions = jax.typeof(leaf).sharding.spec.partitions
        return jax.sharding.reshard(leaf, P(*partitions, **kinds))

    return jax.tree.map(mark, tree)


def reduced_value_and_grad(loss_fn):
    """The Explicit mesh's recipe: gradients unreduced over ``dcn`` only.

    Params marked reduced over every axis the batch is split over make
    ``jax.grad`` return their gradients unreduced over those axes, with
    nothing communicated; resharding them to unreduced over ``dcn`` alone
    sums them over ``data`` (an all-reduce on the fast links, every
    micro-step) and leaves the sum over ``dcn`` to the window.
    """

    def value_and_grad(params, x):
        local = _with_spec(params, reduced={"dcn", "data"})
        loss, grads = jax.value_and_grad(loss_fn)(local, x)
        return loss, _with_spec(grads, unreduced={"dcn"})

    return value_and_grad


def _grad_fn(recipe: str, explicit: bool):
    loss_fn = _loss(explicit)
    if recipe == "reduced":
        return reduced_value_and_grad(loss_fn)
    return ga.local_value_and_grad(loss_fn, "dcn")


def _window_step(optimizer, grad_fn):
    @jax.jit
    def step(params, opt_state, x):
        _, grads = grad_fn(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _run_window(mesh, optimizer, grad_fn, tensor_parallel, batches):
    """K micro-steps (one window) on ``mesh``: the params and the compiled
    step."""
    with jax.set_mesh(mesh):
        params = _params(tensor_parallel)
        opt_state = optimizer.init(params)
        step = _window_step(optimizer, grad_fn)
        compiled = step.lower(
            params, opt_state, _on_slices_and_data(batches[0])
        ).compile()
        for x in batches:
            params, opt_state = step(params, opt_state, _on_slices_and_data(x))
            jax.block_until_ready(params)
        return params, compiled


def _assert_dcn_once_per_window(compiled, mesh, *, gathers: bool = False):
    """Over ``dcn``: only inside the loop (the window's emission); over
    ``data``: an all-reduce in the entry, on every micro-step."""
    found = collectives(compiled, mesh)
    assert all(op.axes is not None for op in found), found
    over_dcn = [op for op in found if "dcn" in op.axes]
    assert over_dcn, found
    assert {op.place for op in over_dcn} == {"loop"}, over_dcn
    assert any(
        op.kind == "all-reduce" and op.axes == ("data",) and op.place == "entry"
        for op in found
    ), found
    if not gathers:
        assert [op for op in found if op.kind == "all-gather"] == [], found
    return over_dcn


# (mesh kind, how the gradients are taken, tensor-parallel params)
WINDOW_LAYOUTS = [
    pytest.param(AxisType.Explicit, "reduced", True, id="explicit-reduced-tp"),
    pytest.param(AxisType.Explicit, "local", False, id="explicit-local"),
    pytest.param(AxisType.Auto, "local", False, id="auto-local"),
]


@pytest.mark.parametrize("kind, recipe, tensor_parallel", WINDOW_LAYOUTS)
def test_float_window_is_the_big_batch_step_and_crosses_dcn_once(
    kind, recipe, tensor_parallel
):
    mesh = _mesh(kind)
    explicit = kind == AxisType.Explicit
    optimizer = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="dcn")
    batches = _batches()
    params, compiled = _run_window(
        mesh, optimizer, _grad_fn(recipe, explicit), tensor_parallel, batches
    )
    with jax.set_mesh(mesh):
        start = jax.tree.map(np.asarray, _params(tensor_parallel))
    expected = jax.tree.map(
        lambda p, g: p - g, start, _big_batch_gradient(start, batches)
    )
    for name in expected:
        np.testing.assert_allclose(
            params[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name
        )
    if explicit and tensor_parallel:  # the params keep their split
        assert jax.typeof(params["w1"]).sharding.spec == P(None, "model")
    # local_value_and_grad's shard_map, manual over ``dcn`` on an Explicit
    # mesh, gathers the Explicit splits of its inputs at its boundary
    # (jax 0.10.2 closes them in the map's shardings): see the guide.
    over_dcn = _assert_dcn_once_per_window(
        compiled, mesh, gathers=explicit and recipe == "local"
    )
    # One fused all-reduce of the window: both gradients and its weight.
    window = [op for op in over_dcn if op.kind == "all-reduce"]
    assert len(window) == 1, over_dcn
    split = 2 if tensor_parallel else 1
    assert window[0].nbytes == 4 * (FEATURES * HIDDEN + HIDDEN) // split + 4


def test_local_value_and_grad_keeps_the_batch_split_over_data_inside_a_slice():
    # Split over ``dcn`` for the per-slice terms, the batch keeps its
    # ``data`` split inside each slice: every device computes the forward
    # and backward passes of its own rows, not of its slice's whole batch.
    seen = []

    def loss_fn(params, x):
        seen.append(jax.typeof(x).sharding.spec)
        return jnp.mean((x @ params) ** 2)

    with jax.set_mesh(_mesh(AxisType.Explicit)):
        grad_fn = jax.jit(ga.local_value_and_grad(loss_fn, "dcn"))
        _, grads = grad_fn(jnp.ones(FEATURES), _on_slices_and_data(_batches()[0]))
    assert seen == [P("data", None)]
    assert ga._tree.unreduced_axes(grads) == {"dcn"}


@pytest.mark.parametrize(
    "kind, recipe", [(AxisType.Explicit, "reduced"), (AxisType.Auto, "local")]
)
def test_ternary_codes_cross_dcn_once_per_window(kind, recipe):
    # The slices' codes do not depend on how a slice computes its gradient:
    # the same recipe with one device per slice (a 2 x 1 x 1 mesh) gives the
    # same update. Only integer codes and a few scalars cross ``dcn``.
    explicit = kind == AxisType.Explicit
    batches = _batches()

    def run(shape):
        optimizer = ga.MultiSteps(
            optax.sgd(1.0),
            K,
            unreduced_axes="dcn",
            window_reduction=ga.ternary_window_reduction(
                3, clip_sigma=None, min_size=1
            ),
        )
        return _run_window(
            _mesh(kind, shape), optimizer, _grad_fn(recipe, explicit), False, batches
        )

    params, compiled = run((2, 2, 2))
    one_device_per_slice, _ = run((2, 1, 1))
    for name in params:
        np.testing.assert_allclose(
            params[name], one_device_per_slice[name], atol=1e-6, err_msg=name
        )  # float rounding; a code that differed would move an element by
        # a whole scale, about 0.1 here
    over_dcn = _assert_dcn_once_per_window(compiled, _mesh(kind))
    floats = [
        shape
        for op in over_dcn
        for shape in op.shapes
        if shape.startswith("f32") and shape not in ("f32[]", "f32[2]")
    ]
    assert floats == [], over_dcn  # the gradients cross as packed codes
    assert any(shape.startswith("u32") for op in over_dcn for shape in op.shapes)


def _stacked_value_and_grad(loss_fn):
    """The Explicit mesh's DiLoCo gradients: each slice's worker on its own
    rows, data-parallel inside the slice, from ``jax.vmap`` over the stacked
    workers (no ``shard_map``, so nothing is gathered at its boundary)."""

    def value_and_grad(params, x):
        per_worker = jax.sharding.reshard(x.reshape(2, -1, FEATURES), P("dcn", "data"))
        return jax.vmap(jax.value_and_grad(loss_fn))(params, per_worker)

    return value_and_grad


@pytest.mark.parametrize(
    "kind, recipe",
    [
        (AxisType.Explicit, "vmap"),
        (AxisType.Explicit, "worker"),
        (AxisType.Auto, "worker"),
    ],
)
def test_diloco_syncs_the_slices_once_per_cycle(kind, recipe):
    explicit = kind == AxisType.Explicit
    mesh, lr = _mesh(kind), 0.1
    batches = _batches()
    grad_fn = (
        _stacked_value_and_grad(_loss(True))
        if recipe == "vmap"
        else ga.worker_value_and_grad(_loss(explicit), "dcn")
    )
    optimizer = ga.diloco(optax.sgd(lr), K, outer=optax.sgd(1.0), axis_name="dcn")
    with jax.set_mesh(mesh):
        start = _params(False)
        params = ga.stack_workers(start, "dcn")
        opt_state = ga.stack_workers(optimizer.init(start), "dcn")
        step = _window_step(optimizer, grad_fn)
        x = _on_slices_and_data(batches[0])
        compiled = step.lower(params, opt_state, x).compile()
        for x in batches:
            params, opt_state = step(params, opt_state, _on_slices_and_data(x))
            jax.block_until_ready(params)
        anchor = ga.anchor_params(opt_state)
    # Each worker takes K sgd steps on its slice's rows; the outer sgd(1.0)
    # step lands the anchor on the workers' mean.
    host = jax.tree.map(np.asarray, start)
    workers = []
    for rows in np.split(batches, 2, axis=1):  # the slices' rows
        worker = host
        for x in rows:
            grads = _big_batch_gradient(worker, x[None])
            worker = jax.tree.map(lambda p, g: p - lr * g, worker, grads)
        workers.append(worker)
    expected = jax.tree.map(lambda *w: np.mean(w, axis=0), *workers)
    for name in expected:
        np.testing.assert_allclose(anchor[name], expected[name], rtol=1e-5, atol=1e-6)
        for row in np.asarray(params[name]):  # every worker starts from it
            np.testing.assert_allclose(row, expected[name], rtol=1e-5, atol=1e-6)
    # worker_value_and_grad's shard_map gathers its Explicit inputs at its
    # boundary, as local_value_and_grad's does (see above).
    _assert_dcn_once_per_window(compiled, mesh, gathers=explicit and recipe == "worker")


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_microbatched_step_reduces_over_data_per_micro_batch_and_dcn_once(kind):
    # Inside one step: each slice scans its micro-batches, reducing each
    # micro-batch's gradient over ``data``; the slices' sums cross ``dcn``
    # once, after the scan. No row of the batch crosses the slices.
    explicit = kind == AxisType.Explicit
    mesh, batches = _mesh(kind), _batches()
    grad_fn = jax.jit(
        ga.microbatched_value_and_grad(_loss(explicit), K, data_axis="dcn")
    )
    with jax.set_mesh(mesh):
        params = _params(False)
        x = _on_slices_and_data(batches.reshape(-1, FEATURES))
        compiled = grad_fn.lower(params, x).compile()
        _, grads = grad_fn(params, x)
    expected = _big_batch_gradient(params, batches)
    for name in expected:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=1e-6)
    found = collectives(compiled, mesh)
    assert all(op.axes is not None for op in found), found
    over_dcn = [op for op in found if "dcn" in op.axes]
    assert [(op.kind, op.place) for op in over_dcn] == [("all-reduce", "entry")]
    over_data = [op for op in found if op.kind == "all-reduce" and op.axes == ("data",)]
    assert [(op.place, op.trips) for op in over_data] == [("loop", (K,))], found


@pytest.mark.slow
def test_the_benchmarks_multi_slice_rows_measure_the_multi_slice_recipe(tmp_path):
    """``bench_scale.py``'s 1B transformer on `dcn` 2 x `data` 4 x `model` 8:
    its once-per-window paths defer `dcn`, the slow network, and reduce
    over `data` on every micro-step (they deferred `data` and all-reduced
    every micro-step's gradient over `dcn`), so a window sends an eighth of
    what `optax.MultiSteps` sends over `dcn`; the table's column says so."""
    once = "once per window (local_value_and_grad)"
    inside = "microbatched_value_and_grad(data_axis=)"
    rows = compiled_reference(
        tmp_path,
        "optax.MultiSteps + jax.grad",
        once,
        inside,
        config="lm-1b/dcn x data x model",
    )

    def over_dcn(path):
        return [
            (c["kind"], tuple(c["axes"]), c["place"], c["trips"])
            for c in rows[path]["collectives"]
            if "dcn" in c["axes"]
        ]

    # The window's one all-reduce, over `dcn` alone: in the emission loop
    # (a runtime trip count), or after the scan of a whole window.
    assert over_dcn(once) == [("all-reduce", ("dcn",), "loop", [None])]
    assert over_dcn(inside) == [("all-reduce", ("dcn",), "entry", [])]
    optax_bytes = rows["optax.MultiSteps + jax.grad"]["dcn_window_bytes"]
    for path in (once, inside):
        assert 7.9 * rows[path]["dcn_window_bytes"] < optax_bytes
