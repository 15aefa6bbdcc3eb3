"""`diloco`: DiLoCo and Streaming DiLoCo on pmap, shard_map and jit + mesh.

Against data-parallel SGD (sync every step, outer SGD with learning rate 1),
against the plain inner optimizer (one worker), and against a hand-written
NumPy DiLoCo (Adam inner, Nesterov outer, several workers, H = 4); the
compiled HLO's all-reduces say where the communication is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

N = 8  # devices, workers on 1-D layouts


def _params(dtype=np.float32):
    rs = np.random.RandomState(0)
    return {
        "w": (rs.randn(16, 8) * 0.5).astype(dtype),
        "b": (rs.randn(8) * 0.5).astype(dtype),
        "v": (rs.randn(8, 4) * 0.5).astype(dtype),
    }


def _grads(workers, steps, dtype=np.float32, seed=1):
    """Per-worker gradients: ``steps`` dicts of arrays shaped (workers, ...)."""
    rs = np.random.RandomState(seed)
    return [
        {
            name: rs.randn(workers, *p.shape).astype(dtype)
            for name, p in _params(dtype).items()
        }
        for _ in range(steps)
    ]


def _max_error(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# --- the three layouts, each run as its user would ---------------------------


def run_pmap(opt, params, grads_seq, weights=None):
    """Per-device params under ``jax.pmap``; returns the final stacked params."""
    stacked = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
    state = jax.pmap(opt.init)(stacked)

    @functools.partial(jax.pmap, axis_name="data")
    def step(params, state, grads, weight):
        updates, state = opt.update(grads, state, params, weight=weight)
        return optax.apply_updates(params, updates), state

    for i, grads in enumerate(grads_seq):
        weight = np.ones(N, np.float32) if weights is None else weights[i]
        stacked, state = jax.block_until_ready(step(stacked, state, grads, weight))
    return stacked, state


def run_shard_map(opt, params, grads_seq, weights=None):
    """Per-device params under ``jax.shard_map`` (blocks of one worker)."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    stacked = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
    first = functools.partial(jax.tree.map, lambda x: x[0])
    again = functools.partial(jax.tree.map, lambda x: x[None])

    def body(params, grads, weight, state=None):
        params, grads = first(params), first(grads)
        state = opt.init(params) if state is None else first(state)
        updates, state = opt.update(grads, state, params, weight=weight[0])
        return again(optax.apply_updates(params, updates)), again(state)

    with jax.set_mesh(mesh):
        spec = P("data")
        stacked = jax.device_put(stacked, jax.NamedSharding(mesh, spec))
        init = jax.jit(
            jax.shard_map(
                lambda p: again(opt.init(first(p))), in_specs=spec, out_specs=spec
            )
        )
        state = init(stacked)
        step = jax.jit(jax.shard_map(body, in_specs=spec, out_specs=spec))
        for i, grads in enumerate(grads_seq):
            weight = np.ones(N, np.float32) if weights is None else weights[i]
            grads, weight = jax.device_put(
                (grads, weight), jax.NamedSharding(mesh, spec)
            )
            stacked, state = jax.block_until_ready(step(stacked, grads, weight, state))
    return stacked, state


LAYOUTS = {
    "1d-explicit": ((N,), ("data",), AxisType.Explicit, None),
    "1d-auto": ((N,), ("data",), AxisType.Auto, None),
    # Tensor-parallel params: w by columns, v by rows (Megatron's split).
    "2d-tp": (
        (4, 2),
        ("data", "model"),
        AxisType.Explicit,
        {"w": P(None, "model"), "b": P("model"), "v": P("model", None)},
    ),
}


def stacked_mesh(layout):
    shape, axes, axis_type, _ = LAYOUTS[layout]
    return jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))


def run_stacked(opt, params, grads_seq, layout="1d-explicit", weights=None):
    """Workers stacked on a leading axis under ``jax.jit`` over a mesh."""
    mesh = stacked_mesh(layout)
    specs = LAYOUTS[layout][3] or jax.tree.map(lambda _: P(), params)
    with jax.set_mesh(mesh):
        placed = jax.tree.map(
            lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec)),
            params,
            specs,
        )
        stacked = ga.stack_workers(placed, "data")
        state = ga.stack_workers(jax.jit(opt.init)(placed), "data")

        @jax.jit
        def step(params, state, grads, weight):
            updates, state = opt.update(grads, state, params, weight=weight)
            return optax.apply_updates(params, updates), state

        for i, grads in enumerate(grads_seq):
            grads = jax.tree.map(
                lambda g, p: jax.device_put(
                    g, jax.NamedSharding(mesh, p.sharding.spec)
                ),
                grads,
                stacked,
            )
            weight = None if weights is None else weights[i]
            stacked, state = jax.block_until_ready(step(stacked, state, grads, weight))
        return stacked, state, step.lower(stacked, state, grads, weight).compile()


# --- equivalences ------------------------------------------------------------


def _data_parallel_sgd(params, grads_seq, lr):
    """Plain SGD on the workers' mean gradient, in float32."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    for grads in grads_seq:
        params = jax.tree.map(
            lambda p, g: p - lr * np.asarray(g, np.float32).mean(0), params, grads
        )
    return params


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "path", ["pmap", "shard_map", "1d-explicit", "1d-auto", "2d-tp"]
)
def test_sync_every_step_with_outer_sgd_1_is_data_parallel_sgd(path, dtype):
    params = _params(dtype)
    workers = 4 if path == "2d-tp" else N
    grads_seq = _grads(workers, 3, dtype)
    opt = ga.diloco(optax.sgd(0.1), 1, outer=optax.sgd(1.0), axis_name="data")
    if path == "pmap":
        stacked, _ = run_pmap(opt, params, grads_seq)
    elif path == "shard_map":
        stacked, _ = run_shard_map(opt, params, grads_seq)
    else:
        stacked, _, _ = run_stacked(opt, params, grads_seq, path)
    expected = _data_parallel_sgd(params, grads_seq, 0.1)
    tolerance = 1e-6 if dtype == np.float32 else 2e-2
    for d in range(workers):
        got = jax.tree.map(lambda x, d=d: np.asarray(x)[d], stacked)
        assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(
            lambda x: np.dtype(dtype), params
        )
        assert _max_error(got, expected) < tolerance, (path, d)
    # Every worker continues from the same anchor: bitwise equal rows.
    for leaf in jax.tree.leaves(stacked):
        leaf = np.asarray(leaf)
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def test_stacked_params_keep_their_tensor_parallel_sharding():
    params = _params()
    stacked, state, _ = run_stacked(
        ga.diloco(optax.adam(0.1), 2, axis_name="data"), params, _grads(4, 2), "2d-tp"
    )
    assert jax.typeof(stacked["w"]).sharding.spec == P("data", None, "model")
    assert jax.typeof(state.anchor["v"]).sharding.spec == P("data", "model", None)


def test_one_worker_with_outer_sgd_1_is_the_inner_optimizer():
    params = _params()
    opt = ga.diloco(optax.adam(0.05), 3, outer=optax.sgd(1.0))
    reference = optax.adam(0.05)
    state, ref_state = opt.init(params), reference.init(params)
    got, want = params, params
    step = jax.jit(opt.update)
    for grads in _grads(1, 10):  # three cycles and a third of one
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = step(grads, state, got)
        got = optax.apply_updates(got, updates)
        ref_updates, ref_state = reference.update(grads, ref_state, want)
        want = optax.apply_updates(want, ref_updates)
    assert _max_error(got, want) < 1e-6
    assert int(state.cycle_step) == 1
    assert _max_error(state.anchor, want) > 1e-3  # mid-cycle: anchor behind


def _numpy_diloco(params, grads_seq, *, lr, sync_every, outer_lr, momentum):
    """DiLoCo by hand: Adam per worker, Nesterov SGD on the mean outer grad."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    names = sorted(params)
    anchor = {k: params[k].astype(np.float64) for k in names}
    workers = next(iter(grads_seq[0].values())).shape[0]
    local = [{k: anchor[k].copy() for k in names} for _ in range(workers)]
    mu = [{k: np.zeros_like(anchor[k]) for k in names} for _ in range(workers)]
    nu = [{k: np.zeros_like(anchor[k]) for k in names} for _ in range(workers)]
    velocity = {k: np.zeros_like(anchor[k]) for k in names}
    for t, grads in enumerate(grads_seq):
        for w in range(workers):
            for k in names:
                g = grads[k][w].astype(np.float64)
                mu[w][k] = b1 * mu[w][k] + (1 - b1) * g
                nu[w][k] = b2 * nu[w][k] + (1 - b2) * g * g
                m_hat = mu[w][k] / (1 - b1 ** (t + 1))
                v_hat = nu[w][k] / (1 - b2 ** (t + 1))
                local[w][k] = local[w][k] - lr * m_hat / (np.sqrt(v_hat) + eps)
        if (t + 1) % sync_every == 0:
            for k in names:
                delta = np.mean([anchor[k] - local[w][k] for w in range(workers)], 0)
                velocity[k] = momentum * velocity[k] + delta
                anchor[k] = anchor[k] - outer_lr * (delta + momentum * velocity[k])
                for w in range(workers):
                    local[w][k] = anchor[k].copy()
    return anchor, local


def test_matches_a_hand_written_diloco_with_adam_and_nesterov():
    params = _params()
    grads_seq = _grads(N, 10)
    opt = ga.diloco(optax.adam(0.01), 4, axis_name="data")  # default outer
    stacked, state = run_pmap(opt, params, grads_seq)
    anchor, local = _numpy_diloco(
        params, grads_seq, lr=0.01, sync_every=4, outer_lr=0.7, momentum=0.9
    )
    for d in range(N):
        got_anchor = jax.tree.map(lambda x, d=d: np.asarray(x)[d], state.anchor)
        assert _max_error(got_anchor, anchor) < 2e-5
        got = jax.tree.map(lambda x, d=d: np.asarray(x)[d], stacked)
        assert _max_error(got, local[d]) < 2e-5
    # Mid-cycle the workers have drifted apart.
    assert _max_error(local[0], local[1]) > 1e-3


def test_stacked_path_matches_pmap_with_adam_and_nesterov():
    params = _params()
    grads_seq = _grads(N, 6)
    opt = ga.diloco(optax.adam(0.01), 4, axis_name="data")
    by_pmap, _ = run_pmap(opt, params, grads_seq)
    stacked, state, _ = run_stacked(opt, params, grads_seq)
    assert _max_error(by_pmap, stacked) < 1e-6
    with jax.set_mesh(stacked_mesh("1d-explicit")):
        anchor = ga.anchor_params(state)
    assert jax.tree.map(np.shape, anchor) == jax.tree.map(np.shape, params)
    np.testing.assert_array_equal(
        np.asarray(anchor["w"]), np.asarray(state.anchor["w"])[0]
    )


# --- communication -----------------------------------------------------------

PARAM_F32_BYTES = sum(4 * np.size(p) for p in _params().values())


def _param_sized(reductions, fraction=0.5):
    return [r for r in reductions if r.nbytes >= fraction * PARAM_F32_BYTES]


@pytest.mark.parametrize("layout", ["1d-explicit", "1d-auto"])
def test_sync_is_one_all_reduce_in_the_loop_and_nothing_else_runs_every_step(layout):
    _, _, compiled = run_stacked(
        ga.diloco(optax.adam(0.01), 4, axis_name="data"),
        _params(),
        _grads(N, 1),
        layout,
    )
    reductions = ga.all_reduces(compiled)
    assert [r for r in reductions if r.place == "entry"] == []
    big = _param_sized(reductions)
    assert len(big) == 1 and big[0].place == "while-body"
    # The params in float32, and one scalar: the presence of weight.
    assert PARAM_F32_BYTES <= big[0].nbytes <= PARAM_F32_BYTES + 8


def test_pmap_sync_all_reduce_is_in_the_loop():
    opt = ga.diloco(optax.adam(0.01), 4, axis_name="data")
    params = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), _params())
    state = jax.pmap(opt.init)(params)
    step = jax.pmap(lambda p, s, g: opt.update(g, s, p), axis_name="data")
    compiled = step.lower(params, state, _grads(N, 1)[0]).compile()
    reductions = ga.all_reduces(compiled)
    assert [r for r in reductions if r.place == "entry"] == []
    big = _param_sized(reductions)
    assert len(big) == 1 and big[0].place == "while-body"
