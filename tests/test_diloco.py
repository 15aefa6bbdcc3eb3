"""`diloco`: DiLoCo and Streaming DiLoCo on pmap, shard_map and jit + mesh.

Against data-parallel SGD (sync every step, outer SGD with learning rate 1),
against the plain inner optimizer (one worker), and against a hand-written
NumPy DiLoCo (Adam inner, Nesterov outer, several workers, H = 4); the
compiled HLO's all-reduces say where the communication is.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from helpers import (
    assert_no_unreduced_or_reduced,
    compiled_reference,
    entry_arrays,
    init_as_users_do,
    moved_arrays,
)

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


def run_shard_map(
    opt, params, grads_seq, weights=None, grad_fn=None, axis_type=AxisType.Explicit
):
    """Per-device params under ``jax.shard_map`` (blocks of one worker) on a
    1-D mesh of ``axis_type``.

    ``grad_fn(params, data)``: each worker's gradient where it stands, from
    its block of each ``grads_seq`` entry; None: the entries are the
    gradients."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(axis_type,))
    stacked = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
    first = functools.partial(jax.tree.map, lambda x: x[0])
    again = functools.partial(jax.tree.map, lambda x: x[None])

    def body(params, grads, weight, state=None):
        params, grads = first(params), first(grads)
        if grad_fn is not None:
            grads = grad_fn(params, grads)
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
    # The same on axes the compiler partitions.
    "2d-auto-tp": (
        (4, 2),
        ("data", "model"),
        AxisType.Auto,
        {"w": P(None, "model"), "b": P("model"), "v": P("model", None)},
    ),
    # The reference of the 2-D layouts: every worker's params whole on
    # each of its 2 devices.
    "2d-replicated": ((4, 2), ("data", "model"), AxisType.Explicit, None),
    # Each worker a group of 2 devices sharing its params FSDP-style (by
    # rows, over the inner axis; HSDP's layout), the workers over "data".
    "2d-fsdp": (
        (4, 2),
        ("data", "fsdp"),
        AxisType.Explicit,
        {"w": P("fsdp", None), "b": P("fsdp"), "v": P("fsdp", None)},
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
        state = ga.stack_workers(init_as_users_do(opt.init, placed), "data")

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
            assert_no_unreduced_or_reduced((stacked, state), f"diloco on {layout}")
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
    "path",
    ["pmap", "shard_map", "1d-explicit", "1d-auto", "2d-tp", "2d-auto-tp", "2d-fsdp"],
)
def test_sync_every_step_with_outer_sgd_1_is_data_parallel_sgd(path, dtype):
    params = _params(dtype)
    workers = 4 if path.startswith("2d") else N
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


@pytest.mark.parametrize("layout", ["2d-tp", "2d-auto-tp", "2d-fsdp"])
def test_stacked_params_keep_their_sharding_within_a_worker(layout):
    params = _params()
    stacked, state, _ = run_stacked(
        ga.diloco(optax.adam(0.1), 2, axis_name="data"), params, _grads(4, 2), layout
    )
    specs = LAYOUTS[layout][3]
    for name in params:
        # The worker axis first, then the leaf's own split within a worker
        # (the concrete arrays' sharding: Auto axes are not in the types).
        want = jax.NamedSharding(stacked_mesh(layout), P("data", *specs[name]))
        for where, leaf in [
            ("params", stacked[name]),
            ("anchor", state.anchor[name]),
            ("adam mu", state.inner_state[0].mu[name]),
        ]:
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (
                name,
                where,
                leaf.sharding.spec,
            )


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


@pytest.mark.parametrize(
    "layout", ["1d-explicit", "1d-auto", "2d-tp", "2d-auto-tp", "2d-fsdp"]
)
def test_sync_is_one_all_reduce_in_the_loop_and_nothing_else_runs_every_step(layout):
    workers = 4 if layout.startswith("2d") else N
    _, _, compiled = run_stacked(
        ga.diloco(optax.adam(0.01), 4, axis_name="data"),
        _params(),
        _grads(workers, 1),
        layout,
    )
    reductions = ga.measure.all_reduces(compiled)
    assert [r for r in reductions if r.place == "entry"] == []
    # A device's block of the params in float32 (half of them with the
    # tensor-parallel or FSDP split over an inner axis of 2), and one
    # scalar: the presence of weight.
    expected = PARAM_F32_BYTES // (2 if layout.startswith("2d") else 1)
    big = [r for r in reductions if r.nbytes >= expected // 2]
    assert len(big) == 1 and big[0].place == "while-body"
    assert expected <= big[0].nbytes <= expected + 8


def test_pmap_sync_all_reduce_is_in_the_loop():
    opt = ga.diloco(optax.adam(0.01), 4, axis_name="data")
    params = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), _params())
    state = jax.pmap(opt.init)(params)
    step = jax.pmap(lambda p, s, g: opt.update(g, s, p), axis_name="data")
    compiled = step.lower(params, state, _grads(N, 1)[0]).compile()
    reductions = ga.measure.all_reduces(compiled)
    assert [r for r in reductions if r.place == "entry"] == []
    big = _param_sized(reductions)
    assert len(big) == 1 and big[0].place == "while-body"


# --- ternary outer reduction -------------------------------------------------


def _big_params():
    """Leaves large enough to be ternary-compressed (>= 256 elements)."""
    rs = np.random.RandomState(3)
    return {
        "w": (rs.randn(64, 32) * 0.5).astype(np.float32),
        "v": (rs.randn(32, 32) * 0.5).astype(np.float32),
        "b": (rs.randn(32) * 0.5).astype(np.float32),
    }


def _big_grads(steps, seed=4, workers=N):
    rs = np.random.RandomState(seed)
    return [
        {
            k: rs.randn(workers, *p.shape).astype(np.float32)
            for k, p in _big_params().items()
        }
        for _ in range(steps)
    ]


def _ternary_diloco(sync_every=2, fragments=1):
    return ga.diloco(
        optax.sgd(0.1),
        sync_every,
        axis_name="data",
        outer_reduction=ga.ternary_average_across_devices("data", seed=0),
        fragments=fragments,
    )


def test_ternary_outer_reduction_moves_a_seventh_of_the_bytes():
    params = _big_params()
    f32_bytes = sum(4 * p.size for p in params.values())
    _, _, compiled = run_stacked(
        ga.diloco(optax.sgd(0.1), 2, axis_name="data"), params, _big_grads(1)
    )
    plain = ga.measure.all_reduces(compiled)
    _, _, compiled = run_stacked(_ternary_diloco(), params, _big_grads(1))
    ternary = ga.measure.all_reduces(compiled)
    for reductions in (plain, ternary):
        assert all(r.place == "while-body" for r in reductions), reductions
    plain_bytes = sum(r.nbytes for r in plain)
    ternary_bytes = sum(r.nbytes for r in ternary)
    assert f32_bytes <= plain_bytes <= f32_bytes + 16
    # 7 codes per uint32 word on 8 workers, plus the scales and b (exact).
    assert ternary_bytes < plain_bytes / 6
    assert ternary_bytes > plain_bytes / 8


def test_a_ternary_sync_draws_its_random_bits_only_when_it_runs():
    """The element indices the random bits hash depend on nothing the sync
    loop carries; left so, XLA hoists them out of the loop, and a uint32
    array the size of each compressed leaf is written on every call (5 ms
    a call at 4.7M params on CPU)."""
    params = _big_params()
    _, _, compiled = run_stacked(_ternary_diloco(), params, _big_grads(1))
    smallest_compressed = min(p.size for p in params.values() if p.size >= 256)
    big = [
        (line, size)
        for line, size in entry_arrays(compiled, "u32")
        if size >= smallest_compressed
    ]
    assert big == []


def test_ternary_outer_reduction_is_the_same_on_pmap_and_stacked_and_keeps_residuals():
    params, grads_seq = _big_params(), _big_grads(4)
    by_pmap, pmap_state = run_pmap(_ternary_diloco(), params, grads_seq)
    stacked, state, _ = run_stacked(_ternary_diloco(), params, grads_seq)
    for a, b in zip(jax.tree.leaves(by_pmap), jax.tree.leaves(stacked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    (reduction_state,) = state.reduction_states
    # The fragment's leaves in the params' order (b, v, w): w is the third.
    residual = np.asarray(reduction_state.residual[2])
    assert residual.shape == (N, 64, 32)
    # Each worker keeps its own clipping error: non-zero and different.
    assert np.abs(residual).max() > 0
    assert np.abs(residual[0] - residual[1]).max() > 0
    # The PRNG counter advanced once per sync (two syncs of H = 2).
    np.testing.assert_array_equal(np.asarray(reduction_state.key)[:, 1], 2)
    # The anchor is close to the exact DiLoCo's: unbiased codes with error
    # feedback, about the mean.
    exact, _ = run_pmap(
        ga.diloco(optax.sgd(0.1), 2, axis_name="data"), params, grads_seq
    )
    error = _max_error(by_pmap, exact)
    assert 0 < error < 0.5


def test_ternary_fragments_draw_their_own_random_bits():
    """Each fragment's reduction state has its own seed word: one shared seed
    would round every fragment's leaves with the same bits."""
    params = _big_params()
    single = ga.ternary_average_across_devices("data", seed=0).init(
        [jnp.zeros(3), jnp.ones([])]
    )
    state = _ternary_diloco(sync_every=4, fragments=3).init(params)
    keys = np.stack([np.asarray(r.key) for r in state.reduction_states])
    assert keys.dtype == np.uint32 and keys.shape == (3, 2)
    # Fragment 0 keeps the reduction's own (seed, step); the others derive
    # distinct seed words from it; every step word starts at 0.
    np.testing.assert_array_equal(keys[0], np.asarray(single.key))
    assert len(set(keys[:, 0].tolist())) == 3
    np.testing.assert_array_equal(keys[:, 1], 0)


def test_ternary_residual_is_used_by_the_next_sync():
    """Zeroing the residuals between syncs changes the next sync's result."""
    params, grads_seq = _big_params(), _big_grads(4)
    opt = _ternary_diloco()
    stacked, state, _ = run_stacked(opt, params, grads_seq[:2])
    mesh = stacked_mesh("1d-explicit")
    with jax.set_mesh(mesh):
        (reduction_state,) = state.reduction_states
        zeroed = reduction_state._replace(
            residual=jax.tree.map(jnp.zeros_like, reduction_state.residual)
        )
        cleared = state._replace(reduction_states=(zeroed,))
        step = jax.jit(lambda p, s, g: opt.update(g, s, p))
        results = []
        for start in (state, cleared):
            p, s = stacked, start
            for grads in grads_seq[2:]:
                grads = jax.device_put(grads, jax.NamedSharding(mesh, P("data")))
                updates, s = step(p, s, grads)
                p = optax.apply_updates(p, updates)
            results.append(np.asarray(p["w"]))
    assert np.abs(results[0] - results[1]).max() > 1e-4


def _keeping_diloco(keep_unsent, error_feedback=True):
    """Top-k 5 % outer gradients (w and v coded, b sent exactly), an outer
    SGD step of 1, each worker keeping ``keep_unsent`` of what it did not
    send."""
    return ga.diloco(
        optax.sgd(0.1),
        2,
        outer=optax.sgd(1.0),
        axis_name="data",
        outer_reduction=ga.compressed_average_across_devices(
            "data", ga.codecs.topk(0.05), error_feedback=error_feedback
        ),
        keep_unsent=keep_unsent,
    )


def _run_path(path, opt, params, grads_seq, weights):
    if path == "shard_map":
        return run_shard_map(opt, params, grads_seq, weights)
    stacked, state, _ = run_stacked(opt, params, grads_seq, path, weights)
    return stacked, state


@pytest.mark.parametrize(
    ("path", "dtype"),
    [
        pytest.param("shard_map", np.float32, id="shard_map"),
        pytest.param("1d-explicit", np.float32, id="1d-explicit"),
        pytest.param("2d-auto-tp", np.float32, id="2d-auto-tp"),
        pytest.param("2d-tp", jnp.bfloat16, id="2d-tp-bf16"),
        pytest.param("2d-fsdp", jnp.bfloat16, id="2d-fsdp-bf16"),
        pytest.param("2d-replicated", np.float32, id="2d-replicated"),
    ],
)
def test_keep_unsent_moves_that_part_of_the_residual_into_each_worker(path, dtype):
    """After a sync with ``keep_unsent=0.5`` the anchor is the one without it
    (the same codes were sent), each worker's residual is half of what it
    would be, and the worker stands half of its unsent outer gradient (its
    residual over its share of the mean, weight / total) off the anchor:
    nothing unsent is lost. A worker that saw nothing (share 0) and a
    leaf sent exactly keep nothing: they sit on the anchor. bfloat16
    params hold the offset to their rounding."""
    workers = N if path in ("shard_map", "1d-explicit") else 4
    as_dtype = functools.partial(jax.tree.map, lambda x: np.asarray(x).astype(dtype))
    params = as_dtype(_big_params())
    grads_seq = [as_dtype(g) for g in _big_grads(2, workers=workers)]
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"atol": 2e-2}
    weights = [np.arange(workers, dtype=np.float32)] * 2  # worker 0 sees nothing
    share = weights[0] / weights[0].sum()
    (p0, s0), (p1, s1) = (
        _run_path(path, _keeping_diloco(keep), params, grads_seq, weights)
        for keep in (0.0, 0.5)
    )
    for a, b in zip(
        jax.tree.leaves(s0.anchor), jax.tree.leaves(s1.anchor), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    anchor = jax.tree.map(lambda x: np.asarray(x, np.float32), s1.anchor)
    p0, p1 = jax.tree.map(lambda x: np.asarray(x, np.float32), (p0, p1))
    # The fragment's list is (b, v, w): b is sent exactly, no residual.
    r0 = [np.asarray(r) for r in s0.reduction_states[0].residual[1:3]]
    r1 = [np.asarray(r) for r in s1.reduction_states[0].residual[1:3]]
    for name, before, after in zip(("v", "w"), r0, r1, strict=True):
        assert np.abs(before[1:]).min(axis=(1, 2)).max() == 0  # entries sent
        assert np.abs(before[1:]).max(axis=(1, 2)).min() > 0  # and not sent
        np.testing.assert_array_equal(after, before - 0.5 * before)
        offset = anchor[name] - p1[name]
        expected = np.zeros_like(before)
        expected[1:] = 0.5 * before[1:] / share[1:, None, None]
        assert np.abs(expected).max() > 0.1
        np.testing.assert_allclose(offset, expected, **tolerance)
        # What the worker kept and what its residual keeps add up to all
        # it did not send.
        np.testing.assert_allclose(
            after[1:] + share[1:, None, None] * offset[1:], before[1:], **tolerance
        )
        # Without keep_unsent every worker is on the anchor.
        np.testing.assert_allclose(p0[name], anchor[name], **tolerance)
    np.testing.assert_allclose(p1["b"], anchor["b"], **tolerance)


def test_keep_unsent_changes_where_the_workers_take_their_gradients():
    """The part a worker keeps goes into its next outer gradient through its
    params, so with gradients that do not depend on the params (and an sgd
    inner step) the next sync sends what it would have sent without it and
    lands on the same anchor (to rounding); what changes is where each
    worker takes its gradients. With a quadratic loss per worker the
    anchors after two cycles differ, and between syncs the workers stand
    apart."""
    params, grads_seq = _big_params(), _big_grads(4)
    fixed = [run_shard_map(_keeping_diloco(k), params, grads_seq) for k in (0, 0.5)]
    np.testing.assert_allclose(
        np.asarray(fixed[0][1].anchor["w"]),
        np.asarray(fixed[1][1].anchor["w"]),
        atol=1e-6,
    )
    # Each worker's gradient that of |params - target_d|^2 / 2.
    targets = _big_grads(1) * 4
    (p0, s0), (p1, s1) = (
        run_shard_map(
            _keeping_diloco(k),
            params,
            targets,
            grad_fn=functools.partial(jax.tree.map, jnp.subtract),
        )
        for k in (0, 0.5)
    )
    w0, w1 = np.asarray(p0["w"]), np.asarray(p1["w"])
    assert np.abs(w0[0] - w0[1]).max() < 1e-6  # on the anchor
    assert np.abs(w1[1] - w1[2]).max() > 1e-3
    moved = np.abs(np.asarray(s0.anchor["w"]) - np.asarray(s1.anchor["w"])).max()
    assert moved > 1e-3, moved


def test_keep_unsent_needs_a_reduction_that_keeps_a_residual():
    with pytest.raises(
        ValueError, match=r"`keep_unsent` 0.5 needs an `outer_reduction`"
    ):
        ga.diloco(optax.sgd(0.1), 2, axis_name="data", keep_unsent=0.5)
    with pytest.raises(ValueError, match=r"state keeps none \(CodecState\)"):
        _keeping_diloco(0.5, error_feedback=False).init(_big_params())
    # With error feedback the state keeps a residual for w (the list is
    # b, v, w; b is sent exactly); keep_unsent=0 needs no reduction at all.
    (kept,) = _keeping_diloco(0.5).init(_big_params()).reduction_states
    assert np.shape(kept.residual[2]) == (64, 32)
    plain = ga.diloco(optax.sgd(0.1), 2, axis_name="data", keep_unsent=0)
    assert plain.init(_big_params()).reduction_states == (optax.EmptyState(),)


# The 2-D layouts of `_big_params`: w (64 x 32) and v (32 x 32) compressed,
# split over the inner axis by columns, by rows, or FSDP-style.
BIG_2D_SPECS = {
    "2d-tp": {"w": P(None, "model"), "v": P("model", None), "b": P("model")},
    "2d-auto-tp": {"w": P(None, "model"), "v": P("model", None), "b": P("model")},
    "2d-fsdp": {"w": P("fsdp", None), "v": P("fsdp", None), "b": P("fsdp")},
}


def _word_bytes(codes, per_word=10):
    """The bytes of ``codes`` packed whole, ``per_word`` (4 workers) a word."""
    return -(-codes // per_word) * 4


def _integer_moves(compiled):
    """Collectives that move ternary codes, their packed words or their sums
    between devices (all-reduces sum them, and are not counted)."""
    return [move for move in moved_arrays(compiled) if move[1] in ("s8", "u32", "s32")]


@pytest.mark.parametrize("layout", ["2d-tp", "2d-auto-tp", "2d-fsdp"])
def test_ternary_outer_reduction_on_a_2d_mesh_keeps_the_codes_split(
    layout, monkeypatch
):
    """Params split over an inner mesh axis: each device codes, packs and
    sends its own block of the outer gradient, and the result is the one of
    replicated params: the random bits hash each element's global index, so
    the codes are the same; the scales, reductions over a split leaf, may
    differ in their last bit."""
    params, grads_seq = _big_params(), _big_grads(4, workers=4)
    monkeypatch.setitem(LAYOUTS, layout, (*LAYOUTS[layout][:3], BIG_2D_SPECS[layout]))
    stacked, state, compiled = run_stacked(_ternary_diloco(), params, grads_seq, layout)
    want, want_state, replicated = run_stacked(
        _ternary_diloco(), params, grads_seq, "2d-replicated"
    )
    # Two syncs (H = 2): a code off by one would move an element by ~0.1.
    for name in params:
        np.testing.assert_allclose(
            np.asarray(stacked[name]), np.asarray(want[name]), rtol=0, atol=2e-6
        )
    (residual,), (want_residual,) = (
        [s.residual for s in st.reduction_states] for st in (state, want_state)
    )
    # The fragment's leaves in the params' order (b, v, w), then presence;
    # b, below min_size, has no residual.
    for name, index in (("v", 1), ("w", 2)):
        got, wanted = residual[index], want_residual[index]
        np.testing.assert_allclose(np.asarray(got), np.asarray(wanted), atol=2e-6)
        spec = P("data", *BIG_2D_SPECS[layout][name])
        assert got.sharding.is_equivalent_to(
            jax.NamedSharding(stacked_mesh(layout), spec), got.ndim
        ), (name, got.sharding.spec)
    assert _integer_moves(compiled) == []
    # Each device sends the words of its half of w and v: half the words
    # of replicated params (10 codes a word with 4 workers, each block
    # padded to whole words), plus the scales and the exact leaves.
    codes_bytes = [r.nbytes for r in ga.measure.all_reduces(compiled)]
    replicated_bytes = [r.nbytes for r in ga.measure.all_reduces(replicated)]
    assert max(replicated_bytes) == _word_bytes(64 * 32) + _word_bytes(32 * 32)
    assert max(codes_bytes) == _word_bytes(64 * 32 // 2) + _word_bytes(32 * 32 // 2)
    # Over `model`, each split leaf's sum of squares; and in both programs
    # the collectives compiled in the loop that reads the largest
    # magnitudes, which runs only where a sum of squares overflowed: 732
    # bytes against 1384.
    assert (sum(codes_bytes), sum(replicated_bytes)) == (732, 1384)


# --- Streaming DiLoCo: fragments ---------------------------------------------


def _layers(count=4, size=(32, 32)):
    rs = np.random.RandomState(5)
    return {
        f"layer{i}": (rs.randn(*size) * 0.5).astype(np.float32) for i in range(count)
    }


def test_fragments_split_leaves_by_bytes_deterministically():
    from gradaccum_jax._diloco import _fragments

    leaves = [np.zeros(s, np.float32) for s in (100, 10, 60, 50, 30, 5)]
    fragments = _fragments.assign(leaves, 2, None)
    assert fragments == _fragments.assign(leaves, 2, None)
    groups = tuple(tuple(piece.leaf for piece in f) for f in fragments)
    assert all(piece.axis is None for f in fragments for piece in f)
    assert sorted(i for g in groups for i in g) == list(range(6))
    totals = [sum(leaves[i].size for i in g) for g in groups]
    assert totals == [130, 125]  # LPT: 100+30 | 60+50+10+5
    assert groups == ((0, 4), (1, 2, 3, 5))
    assert _fragments.sync_offsets(4, 2) == (1, 3)
    assert _fragments.sync_offsets(6, 3) == (1, 3, 5)
    assert _fragments.sync_offsets(5, 1) == (4,)


@pytest.mark.parametrize("fragments", [2, 4])
def test_each_fragment_sync_moves_its_share_of_the_params(fragments):
    params = _layers()
    f32_bytes = sum(4 * p.size for p in params.values())
    grads = [{k: np.ones((N, *p.shape), np.float32) for k, p in params.items()}]
    opt = ga.diloco(optax.sgd(0.1), 4, axis_name="data", fragments=fragments)
    _, state, compiled = run_stacked(opt, params, grads)
    big = [r for r in ga.measure.all_reduces(compiled) if r.nbytes > 64]
    assert [r.place for r in big] == ["while-body"] * fragments
    for reduction in big:
        share = f32_bytes // fragments
        assert share <= reduction.nbytes <= share + 8
    assert len(state.outer_states) == fragments


def _numpy_streaming_diloco(params, grads_seq, *, lr, sync_at, sync_every):
    """DiLoCo with SGD inside and SGD(1) outside, leaf k synced at sync_at[k]."""
    anchor = {k: v.astype(np.float64) for k, v in params.items()}
    workers = next(iter(grads_seq[0].values())).shape[0]
    local = [{k: v.copy() for k, v in anchor.items()} for _ in range(workers)]
    for t, grads in enumerate(grads_seq):
        for w in range(workers):
            for k in anchor:
                local[w][k] = local[w][k] - lr * grads[k][w]
        for k in anchor:
            if t % sync_every == sync_at[k]:
                anchor[k] = np.mean([local[w][k] for w in range(workers)], 0)
                for w in range(workers):
                    local[w][k] = anchor[k].copy()
    return anchor, local


def test_streaming_diloco_matches_a_hand_written_reference():
    params = _layers()
    grads_seq = [
        {k: v[:, :32, :32] for k, v in g.items()} for g in _grads_like(params, 9)
    ]
    opt = ga.diloco(
        optax.sgd(0.1), 4, outer=optax.sgd(1.0), axis_name="data", fragments=2
    )
    stacked, state = run_pmap(opt, params, grads_seq)
    from gradaccum_jax._diloco import _fragments

    names = sorted(params)
    fragments = _fragments.assign([params[k] for k in names], 2, None)
    offsets = _fragments.sync_offsets(4, 2)
    sync_at = {
        names[piece.leaf]: offsets[f]
        for f, fragment in enumerate(fragments)
        for piece in fragment
    }
    assert sorted(sync_at.values()) == [1, 1, 3, 3]
    anchor, local = _numpy_streaming_diloco(
        params, grads_seq, lr=0.1, sync_at=sync_at, sync_every=4
    )
    for d in range(N):
        got = jax.tree.map(lambda x, d=d: np.asarray(x)[d], stacked)
        assert _max_error(got, local[d]) < 1e-5
        assert (
            _max_error(
                jax.tree.map(lambda x, d=d: np.asarray(x)[d], state.anchor), anchor
            )
            < 1e-5
        )


def _grads_like(params, steps, seed=6):
    rs = np.random.RandomState(seed)
    return [
        {k: rs.randn(N, *p.shape).astype(np.float32) for k, p in params.items()}
        for _ in range(steps)
    ]


# --- weights -----------------------------------------------------------------


def _weighted_reference(params, grads_seq, weights, *, lr, sync_every):
    """SGD inside (a zero-weight call moves nothing), the weighted mean outside."""
    anchor = {k: v.astype(np.float64) for k, v in params.items()}
    local = [{k: v.copy() for k, v in anchor.items()} for _ in range(N)]
    cycle = np.zeros(N)
    for t, (grads, weight) in enumerate(zip(grads_seq, weights, strict=True)):
        cycle += weight
        for w in range(N):
            if weight[w] != 0:
                for k in anchor:
                    local[w][k] = local[w][k] - lr * grads[k][w]
        if (t + 1) % sync_every == 0:
            if cycle.sum() != 0:
                for k in anchor:
                    anchor[k] = (
                        sum(cycle[w] * local[w][k] for w in range(N) if cycle[w])
                        / cycle.sum()
                    )
            local = [{k: v.copy() for k, v in anchor.items()} for _ in range(N)]
            cycle = np.zeros(N)
    return anchor, local


@pytest.mark.parametrize("path", ["pmap", "stacked"])
def test_outer_gradient_is_the_cycle_weighted_mean_over_workers(path):
    params, grads_seq = _params(), _grads(N, 6)
    rs = np.random.RandomState(7)
    weights = [rs.randint(0, 50, N).astype(np.float32) for _ in range(6)]
    weights[1][2] = weights[4][2] = 0.0
    # Worker 5 sees nothing in the first cycle: it must not pull the anchor,
    # even with NaN gradients.
    for t in range(3):
        weights[t][5] = 0.0
        grads_seq[t]["w"][5] = np.nan
    opt = ga.diloco(optax.sgd(0.1), 3, outer=optax.sgd(1.0), axis_name="data")
    if path == "pmap":
        stacked, state = run_pmap(opt, params, grads_seq, weights)
    else:
        stacked, state, _ = run_stacked(opt, params, grads_seq, weights=weights)
    anchor, local = _weighted_reference(
        params, grads_seq, weights, lr=0.1, sync_every=3
    )
    for d in range(N):
        got = jax.tree.map(lambda x, d=d: np.asarray(x)[d], stacked)
        assert np.all(np.isfinite(np.asarray(got["w"])))
        assert _max_error(got, local[d]) < 1e-5
    np.testing.assert_array_equal(np.asarray(state.cycle_weights), 0.0)


def test_zero_total_weight_leaves_the_anchor_and_outer_momentum_in_place():
    params, grads_seq = _params(), _grads(N, 4)
    weights = [np.ones(N, np.float32)] * 2 + [np.zeros(N, np.float32)] * 2
    opt = ga.diloco(optax.sgd(0.1), 2, axis_name="data")  # Nesterov outer
    _, after_one = run_pmap(opt, params, grads_seq[:2], weights[:2])
    stacked, after_two = run_pmap(opt, params, grads_seq, weights)
    for a, b in zip(
        jax.tree.leaves((after_one.anchor, after_one.outer_states)),
        jax.tree.leaves((after_two.anchor, after_two.outer_states)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Momentum is non-zero: the outer optimizer would have moved the anchor.
    assert np.abs(np.asarray(jax.tree.leaves(after_two.outer_states)[0])).max() > 0
    assert _max_error(stacked, after_two.anchor) == 0


def test_a_zero_weight_call_keeps_the_inner_state():
    params = _params()
    grads = {k: np.full(p.shape, np.nan, np.float32) for k, p in params.items()}
    opt = ga.diloco(optax.adam(0.1), 4)
    state = opt.init(params)
    updates, new_state = jax.jit(opt.update)(grads, state, params, weight=0.0)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    for a, b in zip(
        jax.tree.leaves(state.inner_state),
        jax.tree.leaves(new_state.inner_state),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(new_state.cycle_step) == 1


# --- tensor parallelism kept -------------------------------------------------------


def _tp_loss(params, x):
    """A Megatron MLP: w1 by columns, w2 by rows, its product summed over
    `model` into rows laid out as ``x``'s."""
    hidden = jax.nn.relu(x @ params["w1"])
    rows = P(jax.typeof(x).sharding.spec[0], None)
    return jnp.mean(jnp.matmul(hidden, params["w2"], out_sharding=rows) ** 2)


def _moves(compiled):
    """Each collective but the all-reduces: (kind, mesh axes, place)."""
    mesh = stacked_mesh("2d-tp")
    return [
        (c.kind, c.axes, c.place)
        for c in ga.measure.collectives(compiled, mesh)
        if c.kind != "all-reduce"
    ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tensor_parallel_params_are_not_gathered(dtype):
    """On `data` 4 x `model` 2 (Explicit), a DiLoCo train step on stacked
    workers with tensor-parallel params (worker_value_and_grad, then the
    update) gathers nothing, as the plain step of the same layout; every
    call's all-reduces are the row-parallel product's, over `model`, and
    the sync's over `data` runs in its loop."""
    mesh = stacked_mesh("2d-tp")
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    shapes = {"w1": (256, 512), "w2": (512, 256)}

    def abstract(shape, spec, leaf_dtype=dtype):
        return jax.ShapeDtypeStruct(
            shape, leaf_dtype, sharding=jax.NamedSharding(mesh, spec)
        )

    def spec_of(leaf):
        return leaf.sharding.spec if leaf.sharding is not None else P()

    def stacked(leaf):
        return abstract((4, *leaf.shape), P("data", *spec_of(leaf)), leaf.dtype)

    x = abstract((32, 256), P("data", None), jnp.float32)
    one = {k: abstract(shapes[k], specs[k]) for k in specs}
    opt = ga.diloco(optax.adam(0.01), 4, axis_name="data")
    grad_fn = ga.worker_value_and_grad(_tp_loss, "data")

    def step(params, state, x):
        _, grads = grad_fn(params, x)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain_step(params, state, x):
        grads = jax.grad(_tp_loss)(params, x)
        updates, state = optax.adam(0.01).update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        state = jax.eval_shape(opt.init, one)
        state = jax.tree.map(lambda s: abstract(s.shape, spec_of(s), s.dtype), state)
        params, state = jax.tree.map(stacked, (one, state))
        compiled = (
            jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x).compile()
        )
        plain_state = jax.eval_shape(optax.adam(0.01).init, one)
        plain = jax.jit(plain_step).lower(one, plain_state, x).compile()
    assert _moves(plain) == []
    assert _moves(compiled) == []
    reductions = ga.measure.collectives(compiled, mesh)
    assert {c.axes for c in reductions if c.place == "entry"} == {("model",)}
    assert {c.axes for c in reductions if c.place == "loop"} == {("data",)}
    # A device's float32 share of a worker's params (the sync's arithmetic
    # is float32 whatever their dtype): the inner updates and the sync's
    # all-reduce buffer, measured 2.0x; a leaf gathered would add its whole.
    share = sum(np.prod(s) for s in shapes.values()) * 4 // 2
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2.1 * share, (temp, share)


def _codec_diloco_step(reduction, mesh, keep_unsent=0.0):
    """A compiled diloco update on stacked workers over `data`, tensor
    parallel over `model`: two Megatron leaves and a scanned one, large
    enough to be coded, and a bias split over `model` (no dimension left
    whole). Returns it and the float32 outer gradient's bytes per device."""
    specs = {
        "w1": P(None, "model"),
        "w2": P("model", None),
        "layers": P(None, None, "model"),
        "bias": P("model"),
    }
    shapes = {"w1": (256, 512), "w2": (512, 256), "layers": (4, 64, 128)}
    shapes["bias"] = (1024,)
    workers = mesh.shape["data"]

    def abstract(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=jax.NamedSharding(mesh, spec)
        )

    def stacked(leaf):
        spec = leaf.sharding.spec if leaf.sharding is not None else P()
        return abstract((workers, *leaf.shape), P("data", *spec), leaf.dtype)

    opt = ga.diloco(
        optax.adam(0.01),
        4,
        axis_name="data",
        outer_reduction=reduction,
        keep_unsent=keep_unsent,
    )

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        one = {k: abstract(shapes[k], specs[k]) for k in specs}
        if mesh.axis_types[0] == AxisType.Explicit:
            state = jax.eval_shape(opt.init, one)
        else:
            # On Auto axes the types carry no split: `init` reads it from
            # placed params (kept in the state for a codec), and its
            # results are laid out like them, as a user's eager `init`.
            placed = {
                k: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding)
                for k, s in one.items()
            }
            state = jax.tree.map(
                lambda a: abstract(a.shape, a.sharding.spec, a.dtype), opt.init(placed)
            )
        params, state = jax.tree.map(stacked, (one, state))
        compiled = (
            jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
        )
    model = mesh.shape["model"]
    return compiled, sum(4 * np.prod(s) for s in shapes.values()) // model


@pytest.mark.parametrize(
    ("codec", "axis_type"),
    [
        ("ternary", AxisType.Explicit),
        ("int8", AxisType.Explicit),
        ("e2m1", AxisType.Auto),
        ("topk", AxisType.Explicit),
        ("topk", AxisType.Auto),
        ("topk-reduce-scatter", AxisType.Explicit),
        ("topk-reduce-scatter", AxisType.Auto),
    ],
    ids=[
        "ternary-explicit",
        "int8-explicit",
        "e2m1-auto",
        "topk-explicit",
        "topk-auto",
        "topk-reduce-scatter-explicit",
        "topk-reduce-scatter-auto",
    ],
)
def test_a_codec_outer_reduction_keeps_tensor_parallel_leaves_split(codec, axis_type):
    """On `data` 2 x `model` 4, a diloco update whose outer_reduction sends
    codes gathers nothing, as the float32 outer mean does not: each device
    codes, packs and sends its own block of every tensor-parallel leaf
    (ternary: 13 codes a word over 2 workers, about 1/13 of the float32
    bytes of a device's blocks), and its temporaries are those of the
    float32 path plus about one float32 buffer of a device's blocks
    (measured 1.36x), not the gathered params'. On Auto axes, as `init`
    saw the params split (before, XLA moved the codes over `model`).
    Top-k's payloads are gathered over `data`, the summed axis, and its
    TopK runs on each device's blocks (XLA's partitioner gathered the
    operand of a TopK split over the workers or `model`: float32 blocks,
    whole, to every device)."""
    mesh = _tp_mesh(axis_type)
    reduction = {
        "ternary": lambda: ga.ternary_average_across_devices("data", seed=0),
        "int8": lambda: ga.compressed_average_across_devices(
            "data", ga.codecs.quantized(bits=8)
        ),
        "e2m1": lambda: ga.compressed_average_across_devices(
            "data", ga.codecs.quantized(bits=4)
        ),
        "topk": lambda: ga.compressed_average_across_devices(
            "data", ga.codecs.topk(0.01)
        ),
        "topk-reduce-scatter": lambda: ga.compressed_average_across_devices(
            "data", ga.codecs.topk(0.01, collective="reduce_scatter")
        ),
    }[codec]()
    compiled, f32_share = _codec_diloco_step(reduction, mesh)
    plain, _ = _codec_diloco_step(None, mesh)
    for program in (compiled, plain):
        moves = ga.measure.collectives(program, mesh)
        gathers = [c for c in moves if c.kind != "all-reduce"]
        if codec.startswith("topk") and program is compiled:  # over `data`
            assert {c.axes for c in gathers} == {("data",)}, gathers
            # All it receives: the uint16 entries and float32 scales of 1 %
            # of each block (3,128 bytes, 1/95 of the float32 share), not
            # widened, and nothing decoded moves. Through the owners the
            # all-to-all and the all-gather each move both workers' shards'
            # payloads (3,140 bytes in all; 7,512 when XLA unpacked the
            # words before the all-to-all, sending int32 and float32).
            assert sum(c.nbytes for c in moves) <= f32_share / 50, moves
            if codec == "topk-reduce-scatter":
                sent = {s.split("[")[0] for c in gathers for s in c.shapes}
                assert sent == {"u16", "f32"}, gathers
        else:
            assert gathers == []
    found = ga.measure.collectives(compiled, mesh)
    assert {c.place for c in found} == {"loop"}
    coded = max(c.nbytes for c in found if c.axes == ("data",))
    if codec == "ternary":
        assert coded <= f32_share / 12, (coded, f32_share)
    temp = compiled.memory_analysis().temp_size_in_bytes
    plain_temp = plain.memory_analysis().temp_size_in_bytes
    # Top-k adds its padded chunks and the dense sum decoded from both
    # workers' payloads: about 3.4 such buffers (measured).
    buffers = 4 if codec.startswith("topk") else 1.5
    assert temp <= plain_temp + buffers * f32_share, (temp, plain_temp, f32_share)


@pytest.mark.parametrize(
    "axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"]
)
def test_keep_unsent_on_tensor_parallel_leaves_adds_a_scalar_and_a_buffer(axis_type):
    """``keep_unsent`` sends what the sync sends without it, plus the worker's
    weight (4 bytes, in the all-reduce the reduction makes anyway: the
    total weight converts a residual into the worker's units), keeps every
    block where it lies, and its temporaries grow by less than two float32
    buffers of a device's blocks (1.78 here, 1.9 on bench_scale.py's 0.81B
    reference, see the low-communication guide; about one before the sync
    without it lost its byte masks and shared zeros)."""
    mesh = _tp_mesh(axis_type)

    def reduction():
        return ga.compressed_average_across_devices(
            "data", ga.codecs.topk(0.01, collective="reduce_scatter")
        )

    plain, f32_share = _codec_diloco_step(reduction(), mesh)
    keeping, _ = _codec_diloco_step(reduction(), mesh, keep_unsent=0.5)

    def moves(program):
        return [
            (c.kind, c.axes, c.nbytes, c.place)
            for c in ga.measure.collectives(program, mesh)
        ]

    before, after = moves(plain), moves(keeping)
    grown = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert grown == [
        (("all-reduce", ("data",), 8, "loop"), ("all-reduce", ("data",), 12, "loop"))
    ], grown
    temp = keeping.memory_analysis().temp_size_in_bytes
    plain_temp = plain.memory_analysis().temp_size_in_bytes
    assert plain_temp < temp <= plain_temp + 2 * f32_share, (temp, plain_temp)


@functools.cache
def test_an_outer_reduction_of_your_own_receives_the_leaf_layouts():
    """diloco tells its outer_reduction where each leaf lies over the axes
    its workers' map makes Auto, as an extra argument of ``update``
    (``leaf_layouts=``, as optax passes extras), not through module state:
    a reduction of the user's own, wrapping a codec's, gets them and hands
    them on, and its step is the built-in one's (each device codes its own
    block: nothing gathered over ``model``)."""
    told = []
    inner = ga.compressed_average_across_devices("data", ga.codecs.quantized(bits=8))

    def update(updates, state, params=None, **extra):
        told.append(extra.get("leaf_layouts"))
        return inner.update(updates, state, params, **extra)

    own = optax.GradientTransformationExtraArgs(inner.init, update)
    mesh = _tp_mesh()
    compiled, _ = _codec_diloco_step(own, mesh)
    builtin, _ = _codec_diloco_step(inner, mesh)
    # One entry per leaf in the order the updates flatten (bias, layers,
    # w1, w2), then the presence scalar diloco adds: whole.
    assert told[-1] == [
        ("model",),
        (None, None, "model"),
        (None, "model"),
        ("model", None),
        (),
    ]
    collectives = ga.measure.collectives
    assert [(c.kind, c.axes, c.nbytes) for c in collectives(compiled, mesh)] == [
        (c.kind, c.axes, c.nbytes) for c in collectives(builtin, mesh)
    ]
    assert not [c for c in collectives(compiled, mesh) if c.kind == "all-gather"]


def _tp_mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


@functools.cache
def _per_call_arrays(codec, axis_type):
    """The arrays of at least 1,024 elements (dtype, elements) that the
    compiled step of `_codec_diloco_step` on `_tp_mesh(axis_type)` makes
    outside the sync's loop (``None``: the float32 outer mean), the loop's
    results left out; the step's collectives that run there; whether it
    sorts there."""
    reduction = (
        None if codec is None else ga.compressed_average_across_devices("data", codec)
    )
    mesh = _tp_mesh(axis_type)
    compiled, _ = _codec_diloco_step(reduction, mesh)
    arrays = sorted(
        (line.split("= ", 1)[1].split("[", 1)[0], size)
        for line, size in entry_arrays(compiled, r"\w+")
        if size >= 1024 and "get-tuple-element(" not in line
    )
    every_call = [
        (c.kind, c.axes)
        for c in ga.measure.collectives(compiled, mesh)
        if c.place == "entry"
    ]
    entry = compiled.as_text().split("\nENTRY ", 1)[1].split("\n}\n", 1)[0]
    return arrays, every_call, " sort(" in entry or "TopK" in entry


# Every codec on Explicit axes and on Auto ones. On Auto axes each device
# codes its block as `init` saw the params split; before, the codecs coded
# whole leaves there, and for packed codes XLA split the padded planes of
# the packing over `model` and hoisted each device's padding mask (an iota
# compared with the partition id, a pred the size of a leaf's block) out
# of the loop, where it was made on every call.
@pytest.mark.parametrize(
    ("codec", "axis_type"),
    [
        (ga.codecs.quantized(bits=4), AxisType.Explicit),
        (ga.codecs.topk(0.01), AxisType.Explicit),
        (ga.codecs.powersgd(2), AxisType.Explicit),
        (ga.codecs.topk(0.01), AxisType.Auto),
        (ga.codecs.powersgd(2), AxisType.Auto),
        (ga.codecs.quantized(bits=4), AxisType.Auto),
        (ga.codecs.topk(0.01, collective="reduce_scatter"), AxisType.Explicit),
        (ga.codecs.topk(0.01, collective="reduce_scatter"), AxisType.Auto),
        (
            ga.codecs.topk(0.5, bits=1, collective="reduce_scatter"),
            AxisType.Explicit,
        ),
        (ga.codecs.topk(0.5, bits=1, collective="reduce_scatter"), AxisType.Auto),
    ],
    ids=[
        "e2m1-explicit",
        "topk-explicit",
        "powersgd-explicit",
        "topk-auto",
        "powersgd-auto",
        "e2m1-auto",
        "topk-reduce-scatter-explicit",
        "topk-reduce-scatter-auto",
        "topk-1-bit-map-reduce-scatter-explicit",
        "topk-1-bit-map-reduce-scatter-auto",
    ],
)
def test_a_call_that_does_not_sync_makes_what_float32_diloco_makes(codec, axis_type):
    """A codec's work runs in the sync's loop only: outside it (on every
    call, synced or not) a diloco step with a codec's outer_reduction
    makes the same arrays as with the float32 mean, and no collective and
    no sort run there, on stacked workers with tensor-parallel leaves
    (Auto axes inside the map, or an Auto mesh). Two escaped before: the
    element indices of the random bits of a leaf's blocks (uint32 arrays
    the size of each coded leaf, hoisted out of the loop) and PowerSGD's
    Q, laid out split over `model` by the loop and all-gathered after it."""
    arrays, every_call, sorts = _per_call_arrays(codec, axis_type)
    plain_arrays, plain_every_call, _ = _per_call_arrays(None, axis_type)
    assert arrays == plain_arrays
    assert every_call == plain_every_call == []
    assert not sorts


def test_worker_rows_keep_their_split_over_an_inner_data_axis():
    """Workers over `dcn` (2), each 4 devices of data parallelism: a batch
    split over ("dcn", "data") stays split over `data` within a worker (no
    gather of rows), each worker's gradient is its rows' (all-reduced over
    its `data` devices, as the plain data-parallel step does)."""
    mesh = jax.make_mesh((2, 4), ("dcn", "data"), axis_types=(AxisType.Explicit,) * 2)
    rs = np.random.RandomState(9)
    params = {"w": rs.randn(4, 3).astype(np.float32)}
    x = rs.randn(16, 4).astype(np.float32)
    fn = jax.jit(
        ga.worker_value_and_grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2), "dcn")
    )
    with jax.set_mesh(mesh):
        stacked = ga.stack_workers(params, "dcn")
        rows = jax.device_put(x, P(("dcn", "data")))
        loss, grads = fn(stacked, rows)
        compiled = fn.lower(stacked, rows).compile()
    found = ga.measure.collectives(compiled, mesh)
    assert [(c.kind, c.axes) for c in found] == [("all-reduce", ("data",))] * len(found)
    assert found
    for d in range(2):
        want_loss, want = jax.value_and_grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2))(
            params, x[8 * d : 8 * d + 8]
        )
        np.testing.assert_allclose(np.asarray(loss)[d], want_loss, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grads["w"])[d], want["w"], rtol=1e-5)


# --- fragments of scanned layers ------------------------------------------------


def _scanned_params(layers=8):
    """Two scanned leaves: a leading layer axis, as ``jax.lax.scan`` takes."""
    rs = np.random.RandomState(5)
    return {
        "w1": (rs.randn(layers, 16, 32) * 0.5).astype(np.float32),
        "w2": (rs.randn(layers, 32, 16) * 0.5).astype(np.float32),
    }


def _scanned_grads(steps, workers, layers=8):
    rs = np.random.RandomState(6)
    return [
        {k: rs.randn(workers, *p.shape).astype(np.float32) for k, p in params.items()}
        for params in [_scanned_params(layers)] * steps
    ]


def _largest_sync(compiled):
    """Bytes of the largest collective of the sync loops, on one device."""
    return max(c.nbytes for c in ga.measure.collectives(compiled) if c.place == "loop")


SCANNED_2D_SPECS = {"w1": P(None, None, "model"), "w2": P(None, "model", None)}


# Pairwise: each layout with one outer reduction, each reduction on a 2-D
# (tensor-parallel) layout; Explicit and Auto both meet the ternary codes.
@pytest.mark.parametrize(
    ("layout", "ternary"),
    [
        ("1d-explicit", False),
        ("2d-tp", True),
        ("2d-auto-tp", False),
        ("2d-auto-tp", True),
    ],
    ids=["1d-explicit-f32", "2d-tp-ternary", "2d-auto-tp-f32", "2d-auto-tp-ternary"],
)
def test_fragments_of_scanned_layers_each_sync_a_quarter_of_the_bytes(
    layout, ternary, monkeypatch
):
    """Two scanned leaves of 8 layers, 4 fragments of 2 layers each: every
    sync moves at most 0.3x the bytes of a sync of the whole model."""
    params = _scanned_params()
    if layout != "1d-explicit":
        monkeypatch.setitem(LAYOUTS, layout, (*LAYOUTS[layout][:3], SCANNED_2D_SPECS))
    workers = 4 if layout.startswith("2d") else N

    def opt(fragments):
        reduction = ga.ternary_average_across_devices("data", 0) if ternary else None
        return ga.diloco(
            optax.adam(0.01),
            4,
            axis_name="data",
            outer_reduction=reduction,
            fragments=fragments,
            fragment_axis=0,
        )

    grads = _scanned_grads(1, workers)
    _, whole_state, whole = run_stacked(opt(1), params, grads, layout)
    _, state, split = run_stacked(opt(4), params, grads, layout)
    assert _largest_sync(split) <= 0.3 * _largest_sync(whole)
    if not ternary:  # the float32 sync: exactly the block of 2 layers and presence
        per_device = PARAM_BYTES_SCANNED // (2 if layout.startswith("2d") else 1)
        assert _largest_sync(whole) == per_device + 4
        assert _largest_sync(split) == per_device // 4 + 4
    # Each fragment's outer state holds its 2 layers of each leaf.
    assert len(state.outer_states) == 4 and len(whole_state.outer_states) == 1
    for outer_state in state.outer_states:
        mu = outer_state[0].trace
        assert [np.shape(m) for m in mu] == [(workers, 2, 16, 32), (workers, 2, 32, 16)]


PARAM_BYTES_SCANNED = sum(p.nbytes for p in _scanned_params().values())


def test_fragments_of_layers_are_whole_leaf_fragments_of_the_layer_blocks():
    """Splitting a scanned leaf's 5 layers into blocks of 3 and 2 is the same
    DiLoCo as two leaves holding those blocks (the outer step is
    elementwise), to rounding (XLA fuses the two programs' arithmetic
    differently); the states hold the same pieces, in the same order."""
    params = {"w": _scanned_params(layers=5)["w1"]}
    blocks = {"a": params["w"][:3], "b": params["w"][3:]}
    grads_seq = [{"w": g["w1"]} for g in _scanned_grads(5, N, layers=5)]
    block_grads = [{"a": g["w"][:, :3], "b": g["w"][:, 3:]} for g in grads_seq]
    split = ga.diloco(
        optax.adam(0.05), 2, axis_name="data", fragments=2, fragment_axis=0
    )
    whole = ga.diloco(optax.adam(0.05), 2, axis_name="data", fragments=2)
    got, got_state, _ = run_stacked(split, params, grads_seq)
    want, want_state, _ = run_stacked(whole, blocks, block_grads)
    joined = np.concatenate([np.asarray(want["a"]), np.asarray(want["b"])], axis=1)
    np.testing.assert_allclose(np.asarray(got["w"]), joined, rtol=0, atol=1e-6)
    for a, b in zip(
        jax.tree.leaves(got_state.outer_states),
        jax.tree.leaves(want_state.outer_states),
        strict=True,
    ):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_fragment_axis_pytree_keeps_small_leaves_whole_and_balances_them():
    params = {
        "embed": np.ones((10, 4), np.float32),  # 160 bytes, whole
        "layers": {"w": np.ones((6, 4, 4), np.float32)},  # 64 bytes a layer
        "norm": np.ones((4,), np.float32),
    }
    opt = ga.diloco(
        optax.sgd(0.1),
        4,
        fragments=3,
        fragment_axis={"embed": None, "layers": 0, "norm": None},
    )
    state = opt.init(params)
    # Fragment f: layers [2f, 2f + 2); the embedding and the norm go to the
    # fragments with the fewest bytes so far, largest first.
    shapes = [[np.shape(x) for x in outer[0].trace] for outer in state.outer_states]
    assert shapes == [[(10, 4), (2, 4, 4)], [(2, 4, 4), (4,)], [(2, 4, 4)]]


@pytest.mark.parametrize("layout", ["2d-tp"])
def test_a_fragment_axis_sharded_over_a_mesh_axis_is_refused_by_name(layout):
    mesh = stacked_mesh(layout)
    opt = ga.diloco(optax.sgd(0.1), 4, fragments=2, fragment_axis=0)
    with jax.set_mesh(mesh):
        params = {
            "w": jax.device_put(np.ones((4, 8), np.float32), P("model", None)),
        }
        with pytest.raises(
            ValueError, match=r"param \['w'\] .* sharded over 'model' along axis 0"
        ):
            opt.init(params)
    with pytest.raises(ValueError, match=r"splits param \['w'\] of shape \(4, 8\)"):
        ga.diloco(optax.sgd(0.1), 8, fragments=5, fragment_axis=0).init(
            {"w": np.ones((4, 8), np.float32)}
        )
    with pytest.raises(ValueError, match=r"`fragment_axis` must be .* prefix"):
        ga.diloco(optax.sgd(0.1), 4, fragments=2, fragment_axis={"v": 0}).init(
            {"w": np.ones((4, 8), np.float32)}
        )


def test_reference_configuration_syncs_blocks_of_layers_without_gathers(tmp_path):
    """The 0.81B-param reference of benchmarks/bench_scale.py (24 scanned
    layers, tensor parallel over `model`, `data` 8 x `model` 8, in a
    process of its own): DiLoCo with float32 outer gradients gathers
    nothing, and with 4 fragments of 6 layers each sync moves a quarter
    of the bytes of a sync of the whole model."""
    paths = ("diloco float32, F=1", "diloco float32, F=4")
    results = compiled_reference(tmp_path, *paths)
    largest = {}
    for path in paths:
        assert "error" not in results[path], results[path]
        found = results[path]["collectives"]
        assert {c["kind"] for c in found} == {"all-reduce"}, path
        largest[path] = max(c["nbytes"] for c in found if c["trips"] == [None])
    # Each block of 6 layers: 1/4 of a device's float32 share, plus presence.
    assert largest[paths[1]] == (largest[paths[0]] - 4) // 4 + 4


# --- checkpoints ---------------------------------------------------------------


def _round_trip(tree, like):
    """A checkpoint: to host numpy and back, with the original shardings."""
    saved = jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), saved, like)


@pytest.mark.parametrize("keep_unsent", [0.0, 0.5], ids=["ternary", "ternary-keep"])
def test_checkpoint_mid_cycle_resumes_bitwise(keep_unsent):
    """Ternary outer gradients (their residuals per worker), two fragments;
    with ``keep_unsent`` the workers also stand apart after a sync."""
    params, grads_seq = _big_params(), _big_grads(7)
    opt = ga.diloco(
        optax.adam(0.01),
        3,
        axis_name="data",
        outer_reduction=ga.ternary_average_across_devices("data", seed=1),
        fragments=2,
        keep_unsent=keep_unsent,
    )
    straight, straight_state, _ = run_stacked(opt, params, grads_seq)
    mesh = stacked_mesh("1d-explicit")
    first, state, _ = run_stacked(opt, params, grads_seq[:4])  # mid-cycle
    assert int(np.asarray(state.cycle_step)[0]) == 1
    first, state = _round_trip((first, state), (first, state))
    with jax.set_mesh(mesh):
        step = jax.jit(lambda p, s, g: opt.update(g, s, p))
        for grads in grads_seq[4:]:
            grads = jax.device_put(grads, jax.NamedSharding(mesh, P("data")))
            updates, state = step(first, state, grads)
            first = optax.apply_updates(first, updates)
    for a, b in zip(
        jax.tree.leaves((straight, straight_state)),
        jax.tree.leaves((first, state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- the outer state in host memory -------------------------------------------

# The fields `offload_outer_state=True` keeps in host memory.
OFFLOADED = ("anchor", "outer_states", "reduction_states")


def _topk_diloco(offload, fragments=2, keep_unsent=0.0):
    """Adam inner, a top-k outer mean whose residual every leaf keeps."""
    return ga.diloco(
        optax.adam(0.05),
        2,
        axis_name="data",
        outer_reduction=ga.compressed_average_across_devices(
            "data", ga.codecs.topk(0.25, min_size=1), seed=0
        ),
        fragments=fragments,
        keep_unsent=keep_unsent,
        offload_outer_state=offload,
    )


def _memory_kinds(state, shardings=None):
    """Per field of a `DiLoCoState` that holds arrays, the memory kinds of
    its arrays (or of ``shardings``, a tree of the state's shardings)."""
    tree = state if shardings is None else shardings
    kinds = {}
    for field, part in zip(state._fields, tree, strict=True):
        if leaves := jax.tree.leaves(part):
            kinds[field] = {getattr(x, "sharding", x).memory_kind for x in leaves}
    return kinds


def _expected_kinds(state, offload=True):
    """`_memory_kinds` of a state made with ``offload_outer_state=offload``."""
    return {
        field: {"pinned_host" if offload and field in OFFLOADED else "device"}
        for field in _memory_kinds(state)
    }


def _assert_bitwise(have, want):
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("path", "dtype"),
    [
        ("shard_map", np.float32),
        ("1d-explicit", np.float32),
        ("1d-auto", np.float32),
        ("2d-tp", np.float32),
        ("2d-tp", jnp.bfloat16),
        ("2d-auto-tp", np.float32),
        ("2d-fsdp", np.float32),
    ],
    ids=lambda x: x if isinstance(x, str) else np.dtype(x).name,
)
def test_an_offloaded_outer_state_lives_in_host_memory_with_the_same_bits(path, dtype):
    """``offload_outer_state=True``: the anchor, the outer momenta and the
    top-k residuals are ``pinned_host`` arrays, in the compiled step's
    input and output shardings as well as in the state it returns (the
    inner state stays in device memory); two cycles of two fragments with
    a residual on every leaf give the same params and state bitwise."""
    params = jax.tree.map(lambda x: x.astype(dtype), _params())
    workers = LAYOUTS[path][0][0] if path in LAYOUTS else N
    grads_seq = _grads(workers, 5, dtype)
    if path == "shard_map":
        want = run_shard_map(_topk_diloco(False), params, grads_seq)
        have = run_shard_map(_topk_diloco(True), params, grads_seq)
        state = have[1]
    else:
        want = run_stacked(_topk_diloco(False), params, grads_seq, path)[:2]
        have_params, state, compiled = run_stacked(
            _topk_diloco(True), params, grads_seq, path
        )
        have = (have_params, state)
        _, state_in = compiled.input_shardings[0][:2]
        assert _memory_kinds(state, state_in) == _expected_kinds(state)
        assert _memory_kinds(state, compiled.output_shardings[1]) == (
            _expected_kinds(state)
        )
        residuals = [s.residual for s in state.reduction_states]
        assert len(jax.tree.leaves(residuals)) == len(params)  # one a leaf
    assert _memory_kinds(state) == _expected_kinds(state)
    _assert_bitwise(have, want)


def test_one_offloaded_worker_is_in_host_memory_eagerly_and_under_jit():
    """One worker (no axis): ``init`` and ``update`` keep the outer state in
    host memory called eagerly and jitted, with the same bits as on the
    device."""
    params = _params()
    grads = [jax.tree.map(lambda g: g[0], g) for g in _grads(1, 4)]
    runs = {}
    for offload in (False, True):
        opt = ga.diloco(optax.adam(0.05), 2, offload_outer_state=offload)
        p, state = params, opt.init(params)
        assert _memory_kinds(state) == _expected_kinds(state, offload)
        update = jax.jit(opt.update)
        for i, g in enumerate(grads):
            updates, state = (opt.update if i % 2 else update)(g, state, p)
            p = optax.apply_updates(p, updates)
        runs[offload] = (p, state)
    assert _memory_kinds(runs[True][1]) == _expected_kinds(runs[True][1])
    _assert_bitwise(runs[True], runs[False])


def test_an_offloaded_state_restores_into_host_memory_and_resumes_bitwise(tmp_path):
    """Saved mid-cycle with orbax and restored into the shardings of the
    compiled ``init`` (which carry the memory kinds; ``jax.eval_shape``'s do
    not), the outer state comes back in host memory and the run goes on
    bitwise; restored into device memory (``jax.eval_shape``'s layout), the
    first ``update`` puts it back, with the same bits."""
    ocp = pytest.importorskip("orbax.checkpoint")  # not at the floors

    params, grads_seq = _big_params(), _big_grads(6)
    opt = _topk_diloco(True, keep_unsent=0.5)
    straight, straight_state, _ = run_stacked(opt, params, grads_seq)
    first, state, _ = run_stacked(opt, params, grads_seq[:3])  # mid-cycle
    mesh = stacked_mesh("1d-explicit")
    with jax.set_mesh(mesh):

        def stacked_init(p):
            return ga.stack_workers(opt.init(p), "data")

        init = jax.jit(stacked_init).lower(params).compile()
        with_kinds = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=sharding
            ),
            init.out_info,
            init.output_shardings,
        )
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "state", state)
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(tmp_path / "state", with_kinds)
        assert _memory_kinds(restored) == _expected_kinds(restored)
        on_device = jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")),
            restored,
        )
        assert _memory_kinds(on_device)["anchor"] == {"device"}
        step = jax.jit(lambda p, s, g: opt.update(g, s, p))
        for resumed in (restored, on_device):
            p = first
            for grads in grads_seq[3:]:
                grads = jax.device_put(grads, P("data"))
                updates, resumed = step(p, resumed, grads)
                p = optax.apply_updates(p, updates)
            assert _memory_kinds(resumed) == _expected_kinds(resumed)
            _assert_bitwise((p, resumed), (straight, straight_state))


def test_offload_outer_state_is_refused_without_a_host_memory_kind(monkeypatch):
    """A backend whose devices have no ``pinned_host`` memory: ``diloco``
    names the argument and the kinds the devices have."""

    class Memory:
        def __init__(self, kind):
            self.kind = kind

    class Device:
        platform = "tpu-without-host"

        def addressable_memories(self):
            return [Memory("device")]

    monkeypatch.setattr(jax, "devices", lambda *_: [Device()])
    with pytest.raises(ValueError, match=r"`offload_outer_state=True`.*\['device'\]"):
        ga.diloco(optax.sgd(0.1), 2, offload_outer_state=True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="`offload_outer_state` must be a bool"):
        ga.diloco(optax.sgd(0.1), 2, offload_outer_state="yes")


# --- errors --------------------------------------------------------------------


def test_update_without_params_raises():
    opt = ga.diloco(optax.sgd(0.1), 2)
    params = _params()
    with pytest.raises(ValueError, match=r"needs `params`"):
        opt.update(params, opt.init(params))


def test_outer_reduction_needs_an_axis_name():
    with pytest.raises(ValueError, match=r"`outer_reduction` must be None when"):
        ga.diloco(
            optax.sgd(0.1),
            2,
            outer_reduction=ga.ternary_average_across_devices("data", seed=0),
        )


def test_more_fragments_than_leaves_raises_at_init():
    opt = ga.diloco(optax.sgd(0.1), 8, fragments=4)
    with pytest.raises(ValueError, match=r"`fragments` must be .*\[1, 3\]"):
        opt.init(_params())


def test_a_rejected_fragment_names_the_params_leaf_behind_its_position():
    """The outer reduction sees a fragment as a list; its error names a
    position, and diloco says which params leaf (and rows) that is."""
    params = {
        "a": jnp.zeros((4, 64), jnp.float32),
        "z": jnp.zeros((4, 64), jnp.complex64),
    }
    reduction = ga.compressed_average_across_devices("i", ga.codecs.topk(0.1))
    opt = ga.diloco(optax.sgd(0.1), 4, axis_name="i", outer_reduction=reduction)
    with pytest.raises(
        ValueError,
        match=r"params leaf \[1\] has dtype complex64: the codec topk.*\(diloco's "
        r"outer_reduction sees fragment 0 as a list: \[1\] is params leaf \['z'\]\)",
    ):
        opt.init(params)
    # Fragments of scanned rows: fragment 1 holds rows 2:4 of each leaf.
    opt = ga.diloco(
        optax.sgd(0.1),
        4,
        axis_name="i",
        outer_reduction=reduction,
        fragments=2,
        fragment_axis=0,
    )
    with pytest.raises(
        ValueError,
        match=r"fragment 0 as a list: \[1\] is params leaf \['z'\] rows 0:2 of "
        r"axis 0\)",
    ):
        opt.init(params)


@pytest.mark.parametrize(
    ("made", "used", "missing"),
    [
        (
            dict(fragments=2),
            dict(),
            r"missing \['.outer_states\[0\]\[0\].trace\[1\]'\], unexpected "
            r"\['.outer_states\[1\]\[0\].trace\[0\]'\]",
        ),
        (
            dict(inner=optax.sgd(0.1)),
            dict(inner=optax.adam(0.1)),
            r"missing \['.inner_state\[0\].count', ",
        ),
    ],
    ids=["fragments", "inner"],
)
def test_a_state_made_with_another_configuration_is_refused(made, used, missing):
    """Not a pytree error from a tree_map, nor an AttributeError of the inner
    optimizer: the leaves that differ, and what to do."""

    def build(inner=None, **kwargs):
        inner = optax.sgd(0.1) if inner is None else inner
        return ga.diloco(inner, 4, outer=optax.sgd(0.7, momentum=0.9), **kwargs)

    params = {"a": jnp.ones((4, 8)), "b": jnp.ones((8,))}
    state = build(**made).init(params)
    with pytest.raises(
        ValueError,
        match=r"diloco: the state does not have the leaves this transformation's "
        rf"init makes for these params \({missing}.*Initialize it with",
    ):
        build(**used).update(params, state, params)


@pytest.mark.parametrize("layout", ["2d-tp", "1d-auto"])
def test_stacked_workers_refuse_a_state_made_with_other_fragments(layout):
    """The check on the stacked path, under jax.jit over a mesh: one worker's
    state as init lays it out, against the stacked state's leaves."""
    mesh = stacked_mesh(layout)
    specs = LAYOUTS[layout][3] or jax.tree.map(lambda _: P(), _params())

    def build(fragments):
        return ga.diloco(optax.sgd(0.1), 4, axis_name="data", fragments=fragments)

    with jax.set_mesh(mesh):
        params = jax.tree.map(
            lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec)),
            _params(),
            specs,
        )
        state = ga.stack_workers(build(2).init(params), "data")
        stacked = ga.stack_workers(params, "data")
        with pytest.raises(
            ValueError,
            match=r"diloco: the state does not have the leaves .*\(missing "
            r"\['.outer_states\[0\]\[0\].trace\[1\]', .*unexpected "
            r"\['.outer_states\[1\]\[0\].trace\[0\]'",
        ):
            jax.jit(build(1).update)(stacked, state, stacked)


def test_stacked_path_checks_the_workers_axis():
    opt = ga.diloco(optax.sgd(0.1), 2, axis_name="data")
    params = _params()
    state = opt.init(params)
    mesh = stacked_mesh("1d-explicit")
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"stacked on a leading axis of size 8"),
    ):
        jax.jit(opt.update)(params, state, params)
    with pytest.raises(ValueError, match=r"must name one axis of the current mesh"):
        jax.jit(opt.update)(params, state, params)


def test_inner_chain_with_clipping_and_accumulation_matches_it_alone():
    """One worker, outer SGD(1): DiLoCo is its inner chain, weights included."""

    def inner():
        return optax.chain(
            ga.clip_by_global_norm(5.0), ga.accumulate(optax.adam(0.05), 2)
        )

    params = _params()
    opt = ga.diloco(inner(), 4, outer=optax.sgd(1.0))
    reference = inner()
    state, ref_state = opt.init(params), reference.init(params)
    got, want = params, params
    step, ref_step = jax.jit(opt.update), jax.jit(reference.update)
    for i, grads in enumerate(_grads(1, 9)):
        grads = jax.tree.map(lambda g: g[0] * 3, grads)
        weight = jnp.float32(1 + i % 3)
        updates, state = step(grads, state, got, weight=weight)
        got = optax.apply_updates(got, updates)
        ref_updates, ref_state = ref_step(grads, ref_state, want, weight=weight)
        want = optax.apply_updates(want, ref_updates)
    assert _max_error(got, want) < 1e-6
    assert _max_error(got, params) > 1e-2


def test_after_a_sync_every_worker_is_on_the_anchor_to_rounding():
    params = _params()
    opt = ga.diloco(optax.adam(0.05), 4, axis_name="data")
    stacked, state = run_pmap(opt, params, _grads(N, 4))
    for name in params:
        anchor = np.asarray(state.anchor[name])
        np.testing.assert_array_equal(anchor, np.broadcast_to(anchor[0], anchor.shape))
        worker = np.asarray(stacked[name])
        # p + (a - p) is a but where a is much smaller than p: there, off
        # by an ulp of p (the params are < 2 in magnitude).
        assert np.all(np.abs(worker - anchor) <= np.spacing(np.float32(2)))
        assert np.mean(worker == anchor) > 0.9


def test_a_donated_step_updates_the_anchor_and_outer_state_in_place():
    """Temporaries of one worker's donated step: the inner updates (read by
    the sync loop, so written out) and the sync's float32 all-reduce buffer,
    about 2x the params; copies of the anchor and of the outer momentum
    would add 2x more. Plain Adam there fuses into 68 bytes."""
    params = _big_params()
    param_bytes = sum(p.nbytes for p in params.values())
    first = functools.partial(jax.tree.map, lambda x: x[0])
    again = functools.partial(jax.tree.map, lambda x: x[None])
    opt = ga.diloco(optax.adam(0.01), 4, axis_name="data")
    with jax.set_mesh(stacked_mesh("1d-explicit")):
        stacked = ga.stack_workers(params, "data")
        state = ga.stack_workers(opt.init(params), "data")

        def body(params, state, grads):
            params, state, grads = first((params, state, grads))
            updates, state = opt.update(grads, state, params)
            return again((optax.apply_updates(params, updates), state))

        step = jax.shard_map(body, in_specs=P("data"), out_specs=P("data"))
        compiled = (
            jax.jit(step, donate_argnums=(0, 1))
            .lower(stacked, state, stacked)
            .compile()
        )
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2.2 * param_bytes, (temp, param_bytes)  # measured 2.04x


def test_gradients_or_params_of_another_structure_name_the_leaf():
    opt = ga.diloco(optax.sgd(0.1), 2)
    params = _params()
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"gradients leaf \['w'\] has shape \(3,\)"):
        opt.update({**params, "w": np.ones(3, np.float32)}, state, params)
    other = {**params, "extra": np.ones(2, np.float32)}
    with pytest.raises(
        ValueError, match=r"params do not have the structure of the anchor"
    ):
        opt.update(other, state, other)
    with pytest.raises(ValueError, match=r"gradient leaf \['b'\] has dtype int32"):
        opt.update({**params, "b": np.ones(8, np.int32)}, state, params)


@pytest.mark.parametrize("layout", ["1d-explicit", "1d-auto"])
def test_worker_value_and_grad_is_each_workers_own_gradient(layout):
    def loss_fn(params, x, y):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    rs = np.random.RandomState(8)
    params = {"w": rs.randn(4, 3).astype(np.float32), "b": np.zeros(3, np.float32)}
    x = rs.randn(N * 5, 4).astype(np.float32)
    y = rs.randn(N * 5, 3).astype(np.float32)
    mesh = stacked_mesh(layout)
    with jax.set_mesh(mesh):
        stacked = ga.stack_workers(params, "data")
        # Worker d's params differ: d added to w.
        stacked = jax.jit(
            lambda p: {
                **p,
                "w": p["w"] + jnp.arange(N, dtype=jnp.float32)[:, None, None],
            }
        )(stacked)
        batch = jax.device_put((x, y), jax.NamedSharding(mesh, P("data")))
        fn = jax.jit(ga.worker_value_and_grad(loss_fn, "data"))
        loss, grads = fn(stacked, *batch)
        compiled = fn.lower(stacked, *batch).compile()
    assert ga.measure.all_reduces(compiled) == []
    assert loss.shape == (N,) and grads["w"].shape == (N, 4, 3)
    for d in range(N):
        own = {**params, "w": params["w"] + d}
        rows = slice(5 * d, 5 * (d + 1))
        want_loss, want = jax.value_and_grad(loss_fn)(own, x[rows], y[rows])
        np.testing.assert_allclose(np.asarray(loss)[d], want_loss, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grads["w"])[d], want["w"], rtol=1e-5)


@pytest.mark.parametrize("layout", ["2d-tp", "2d-auto-tp"])
def test_stack_workers_rejects_params_sharded_over_the_workers_axis(layout):
    # On Auto axes the split is not in the types: it is read from the
    # concrete arrays' sharding.
    mesh = stacked_mesh(layout)
    with jax.set_mesh(mesh):
        fsdp = jax.device_put(
            np.ones((8, 4), np.float32), jax.NamedSharding(mesh, P("data", None))
        )
        with pytest.raises(ValueError, match=r"sharded over 'data', the workers' axis"):
            ga.stack_workers({"w": fsdp}, "data")
        # Over the model axis it is fine, and the model partition stays.
        tp = jax.device_put(fsdp, jax.NamedSharding(mesh, P(None, "model")))
        stacked = ga.stack_workers({"w": tp}, "data")
    want = jax.NamedSharding(mesh, P("data", None, "model"))
    assert stacked["w"].sharding.is_equivalent_to(want, 3), stacked["w"].sharding
    assert stacked["w"].shape == (4, 8, 4)


# --- worker_value_and_grad: host arrays, and what jax.value_and_grad takes ----


def _worker_loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def _worker_batch(seed, workers=N):
    rs = np.random.RandomState(seed)
    return (
        rs.randn(2 * workers, 16).astype(np.float32),
        rs.randn(2 * workers, 8).astype(np.float32),
    )


@pytest.mark.parametrize("layout", ["1d-explicit", "2d-tp"])
def test_a_diloco_run_resumes_from_a_host_state(layout):
    """A state saved with ``jax.device_get`` and fed back as host arrays
    (and, on one axis, the params too): worker_value_and_grad and the update
    split them over the workers themselves, eagerly and under jit, and lay
    the state out over the model axis as `init` does for the params; the
    run goes on bitwise with the same shardings. (Host params have no
    tensor-parallel split to give back: restore those with their
    shardings.)"""
    mesh = stacked_mesh(layout)
    workers = mesh.shape["data"]
    specs = LAYOUTS[layout][3] or {"w": P(), "b": P()}
    params = {name: p for name, p in _params().items() if name != "v"}
    opt = ga.diloco(optax.adam(0.05), 2, axis_name="data")
    grad_fn = ga.worker_value_and_grad(_worker_loss, "data")
    jit_grad_fn, update = jax.jit(grad_fn), jax.jit(opt.update)

    def step(params, state, x, y):
        _, grads = jit_grad_fn(params, x, y)
        updates, state = update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(p, specs[k]) for k, p in params.items()}
        stacked = ga.stack_workers(placed, "data")
        state = ga.stack_workers(init_as_users_do(opt.init, placed), "data")
        batches = [
            jax.device_put(_worker_batch(seed, workers), P("data")) for seed in range(3)
        ]
        stacked, state = step(stacked, state, *batches[0])  # mid-cycle
        host_params, host_state = jax.device_get((stacked, state))
        if layout != "1d-explicit":
            host_params = stacked
        # Eagerly, host arrays are NumPy arrays.
        eager, expected_eager = (
            grad_fn(p, *batches[1]) for p in (host_params, stacked)
        )
        runs = {"placed": (stacked, state), "host": (host_params, host_state)}
        for name, run in runs.items():
            for batch in batches[1:]:
                run = step(*run, *batch)
            runs[name] = run
    for have, want in zip(
        jax.tree.leaves((runs["host"], eager)),
        jax.tree.leaves((runs["placed"], expected_eager)),
        strict=True,
    ):
        np.testing.assert_array_equal(have, want)
        assert have.sharding.is_equivalent_to(want.sharding, have.ndim)
    anchor = runs["host"][1].anchor["w"]
    want = jax.sharding.NamedSharding(mesh, P("data", *specs["w"]))
    assert anchor.sharding.is_equivalent_to(want, 3)


@pytest.mark.parametrize("layout", ["1d-explicit", "1d-auto"])
def test_worker_value_and_grad_takes_what_value_and_grad_takes(layout):
    """A Python number in the aux output and a 0-d PRNG key argument: each
    worker's results are jax.value_and_grad's on its own rows, the key
    given to every worker whole. A raw uint32 key (2 rows for 8 workers)
    is refused by name, and so is an aux leaf that cannot be stacked."""

    def loss_fn(params, x, y, key):
        noise = jax.random.uniform(key, (x.shape[0], 1))
        return _worker_loss(params, x * noise, y), {"count": 3, "scale": 0.5}

    params = {name: p for name, p in _params().items() if name != "v"}
    x, y = _worker_batch(0)
    key = jax.random.key(7)
    grad_fn = ga.worker_value_and_grad(loss_fn, "data", has_aux=True)
    with jax.set_mesh(stacked_mesh(layout)):
        stacked = ga.stack_workers(params, "data")
        (loss, aux), grads = jax.jit(grad_fn)(stacked, x, y, key)
        with pytest.raises(
            ValueError, match=r"worker_value_and_grad: argument 3 has shape \(2,\)"
        ):
            grad_fn(stacked, x, y, jax.random.PRNGKey(7))
        text_aux = ga.worker_value_and_grad(
            lambda p, x, y: (_worker_loss(p, x, y), "done"), "data", has_aux=True
        )
        with pytest.raises(ValueError, match=r"aux leaf  is str 'done'"):
            text_aux(stacked, x, y)
    np.testing.assert_array_equal(aux["count"], np.full(N, 3))
    np.testing.assert_array_equal(aux["scale"], np.full(N, 0.5, np.float32))
    for d in range(N):
        rows = slice(2 * d, 2 * d + 2)
        (want_loss, _), want = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            params, x[rows], y[rows], key
        )
        np.testing.assert_allclose(np.asarray(loss)[d], want_loss, rtol=1e-6)
        for name in want:
            np.testing.assert_allclose(
                np.asarray(grads[name])[d], want[name], rtol=1e-5, atol=1e-7
            )


def test_a_codec_that_codes_scalars_leaves_the_presence_weight_exact():
    """``diloco`` reduces one more scalar with the outer gradients (1 on
    every worker: whether anyone saw anything). A codec asked to code every
    leaf (``min_size=1``) still sends it exactly, so the anchor moves as it
    does with float32 outer gradients; coded as one ternary magnitude it
    came back 0 at every sync and the params never moved."""
    params = _params()
    grads_seq = _grads(N, 4)

    def run(outer_reduction):
        opt = ga.diloco(
            optax.sgd(0.1),
            2,
            outer=optax.sgd(1.0),
            axis_name="data",
            outer_reduction=outer_reduction,
        )
        return run_pmap(opt, params, grads_seq)[0]

    def coded_from(min_size):
        codec = ga.codecs.ternary(min_size=min_size)
        return run(ga.compressed_average_across_devices("data", codec))

    every_leaf = coded_from(1)
    # The same codes for every params leaf (none has one element).
    chex.assert_trees_all_equal(every_leaf, coded_from(2))
    initial = jax.tree.map(lambda p: np.broadcast_to(p, (N, *p.shape)), params)
    moved = _max_error(every_leaf, initial)
    assert moved > 0.5 * _max_error(run(None), initial) > 0.05


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_one_bit_top_k_outer_reduction_runs_in_a_checked_shard_map(axis_type):
    """The README's one-bit top-k setting through the owners, keeping half
    of what is unsent, inside ``jax.shard_map`` with JAX's default
    ``check_vma=True``: the same params as under ``pmap``."""
    big = {"w": np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)}
    grads_seq = [
        {"w": np.random.default_rng(s).standard_normal((N, 64, 64)).astype(np.float32)}
        for s in range(4)
    ]
    opt = ga.diloco(
        optax.sgd(0.1),
        2,
        axis_name="data",
        outer_reduction=ga.compressed_average_across_devices(
            "data",
            ga.codecs.topk(0.5, bits=1, collective="reduce_scatter", min_size=32),
        ),
        keep_unsent=0.5,
    )
    expected, _ = run_pmap(opt, big, grads_seq)
    got, _ = run_shard_map(opt, big, grads_seq, axis_type=axis_type)
    assert _max_error(got, expected) < 1e-6
    assert _max_error(got, jax.tree.map(lambda p: p[None], big)) > 0.01
