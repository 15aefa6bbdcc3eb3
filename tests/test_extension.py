"""Your own parts: a window reduction, a statistic and a codec, public names only.

The three toys below are the examples of ``docs/architecture.md`` ("Write your
own part"); they use nothing but public names (the protocols are in
``gradaccum_jax.extend``) and the `TermsLayout` object the engine hands them:

* `bf16_wire_reduction`: the window's per-device terms are sent as bfloat16
  (half the bytes of a float32 all-reduce) and summed in float32; its state
  counts the windows it reduced.
* `window_norm_statistic`: the squared norm of each closed window's mean
  gradient, and the number of weighted (device) micro-batches it held.
* `scaled_sign_codec`: a codec (EF-signSGD's codes: each device sends the
  signs of its input and one scale, their mean magnitude; error feedback
  keeps the rest), in a device mean under ``jax.pmap`` and in a window
  reduction on the meshes below.

The statistic runs on whole gradients (float32 and bfloat16 params, FSDP and
tensor-parallel params on a 2-D ``data`` x ``model`` mesh), and both run
with per-device terms on 1-D Explicit and Auto meshes and the 2-D mesh with
tensor-parallel params; each must give the numbers computed directly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, reshard
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

K = 3


def bf16_wire_reduction() -> ga.extend.WindowReduction:
    """Per-device terms summed as bfloat16 on the wire, in float32 after."""

    def reduce(terms, layout, windows):
        def to_wire(leaf):
            # The window weight and the statistics' counts stay exact.
            return leaf.astype(jnp.bfloat16) if jnp.size(leaf) > 1 else leaf

        wire = layout.reduce(jax.tree.map(to_wire, terms))
        sums = jax.tree.map(lambda s, t: s.astype(t.dtype), wire, terms)
        # Its sums are not exact, but it does not say by how much: 0.
        return sums, windows + 1, jnp.zeros([], jnp.float32)

    return ga.extend.WindowReduction(
        init=lambda params, layout: jnp.zeros([], jnp.int32), reduce=reduce
    )


class WindowNorm(NamedTuple):
    micro_batches: jax.Array  # window term: weighted micro-batches seen
    last_sq_norm: jax.Array  # |window mean gradient|^2 of the last window
    last_micro_batches: jax.Array


def window_norm_statistic() -> ga.extend.WindowStatistic:
    """The last closed window's mean-gradient squared norm and size."""

    def init(params, layout):
        zero = jnp.zeros([], jnp.float32)
        return WindowNorm(layout.zeros(zero), zero, zero)

    def observe(state, grads, weight, position, layout):
        def count(mean_grads, weight):
            return (weight != 0).astype(jnp.float32)

        return state._replace(
            micro_batches=state.micro_batches + layout.micro_batch(count)(grads, weight)
        )

    def close(state, window_sum, weight, position):
        sq = sum(jnp.sum(jnp.square(s)) for s in jax.tree.leaves(window_sum))
        return state._replace(
            last_sq_norm=sq / weight**2, last_micro_batches=state.micro_batches
        )

    return ga.extend.WindowStatistic(
        init=init,
        observe=observe,
        window_terms=lambda state: state.micro_batches,
        with_window_terms=lambda state, terms: state._replace(micro_batches=terms),
        close=close,
    )


def _params(tensor_parallel=False):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(k1, (8, 32)), "b": jax.random.normal(k2, (32,))}
    if tensor_parallel:
        params = {
            "w": reshard(params["w"], P(None, "model")),
            "b": reshard(params["b"], P("model")),
        }
    return params


def _loss(params, x):
    return jnp.mean(jnp.square(jnp.tanh(x @ params["w"] + params["b"])))


def _batches(n):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((16, 8), np.float32) for _ in range(n)]


def _expected(params, batches):
    """The emitted sgd(1) update and the window's |mean grad|^2, on one device."""
    grads = [jax.grad(_loss)(params, x) for x in batches]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    sq = sum(float(jnp.sum(jnp.square(m))) for m in jax.tree.leaves(mean))
    return jax.tree.map(lambda m: -np.asarray(m), mean), sq


# Whole gradients (no ``unreduced_axes``): params replicated on one device,
# in bfloat16, and FSDP / tensor-parallel on a 2-D data x model mesh, where
# the gradients jax.grad returns are sharded like the params.
WHOLE = {
    "float32": (jnp.float32, None),
    "bfloat16": (jnp.bfloat16, None),
    "2d-fsdp": (jnp.float32, {"w": P("data", None), "b": P("data")}),
    "2d-tp": (jnp.float32, {"w": P(None, "model"), "b": P("model")}),
}


@pytest.mark.parametrize("dtype, specs", WHOLE.values(), ids=WHOLE.keys())
def test_toy_statistic_on_whole_gradients(dtype, specs):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    batches = _batches(K)
    expected_updates, expected_sq = _expected(_params(), batches)
    with jax.set_mesh(mesh):
        params = jax.tree.map(lambda p: p.astype(dtype), _params())
        if specs is not None:
            params = jax.tree.map(reshard, params, specs)
        opt = ga.MultiSteps(
            optax.sgd(1.0), K, statistics={"window_norm": window_norm_statistic()}
        )
        state = opt.init(params)
        step = jax.jit(opt.update)
        for x in batches:
            grads = jax.jit(jax.grad(_loss))(params, jnp.asarray(x, dtype))
            updates, state = step(grads, state, params)
    stat = state.statistics["window_norm"]
    tolerance = 1e-5 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(float(stat.last_sq_norm), expected_sq, rtol=tolerance)
    assert float(stat.last_micro_batches) == K
    assert float(stat.micro_batches) == 0  # emptied for the next window
    for u, p, e in zip(
        jax.tree.leaves(updates),
        jax.tree.leaves(params),
        jax.tree.leaves(expected_updates),
        strict=True,
    ):
        assert u.dtype == dtype
        assert jax.typeof(u).sharding.spec == jax.typeof(p).sharding.spec
        np.testing.assert_allclose(
            np.asarray(u, np.float32), e, rtol=tolerance, atol=tolerance * 1e-2
        )


MESHES = {
    "1d-explicit": ((8,), ("data",), (AxisType.Explicit,), False),
    "1d-auto": ((8,), ("data",), (AxisType.Auto,), False),
    "2d-explicit-tp": ((4, 2), ("data", "model"), (AxisType.Explicit,) * 2, True),
}


@pytest.mark.parametrize("layout", MESHES.values(), ids=MESHES.keys())
def test_toy_reduction_and_statistic_with_per_device_terms(layout):
    shape, names, types, tensor_parallel = layout
    mesh = jax.make_mesh(shape, names, axis_types=types)
    devices = shape[0]
    with jax.set_mesh(mesh):
        params = _params(tensor_parallel)
        opt = ga.MultiSteps(
            optax.sgd(1.0),
            K,
            unreduced_axes="data",
            window_reduction=bf16_wire_reduction(),
            statistics={"window_norm": window_norm_statistic()},
        )
        grad_fn = ga.local_value_and_grad(_loss, "data")
        state = opt.init(params)

        @jax.jit
        def step(params, state, x):
            _, grads = grad_fn(params, x)
            return opt.update(grads, state, params)

        batches = _batches(K)
        for x in batches:
            x = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
            updates, state = jax.block_until_ready(step(params, state, x))
    expected_updates, expected_sq = _expected(_params(), batches)
    stat = state.statistics["window_norm"]
    np.testing.assert_allclose(float(stat.last_sq_norm), expected_sq, rtol=5e-2)
    assert float(stat.last_micro_batches) == K * devices
    assert int(state.reduction_state) == 1
    # The terms really went through bfloat16: errors of its 8 mantissa
    # bits, far above float32 rounding (about 1e-7).
    error = max(
        float(np.max(np.abs(u - e)) / np.max(np.abs(e)))
        for u, e in zip(
            jax.tree.leaves(jax.device_get(updates)),
            jax.tree.leaves(expected_updates),
            strict=True,
        )
    )
    assert 1e-5 < error < 2e-2
    # Updates keep the params' sharding (tensor-parallel stays split).
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
        assert jax.typeof(u).sharding.spec == jax.typeof(p).sharding.spec


# --- a statistic's report, and the other accumulators ----------------------


def reported_norm_statistic(field: str = "grad_sq_norm") -> ga.extend.WindowStatistic:
    """The toy statistic, reporting its last window's squared norm as ``field``."""
    toy = window_norm_statistic()
    return toy._replace(report=lambda state: {field: state.last_sq_norm})


def test_a_statistic_of_your_own_reports_through_stats():
    opt = ga.MultiSteps(
        optax.sgd(1.0),
        2,
        statistics={
            "norm": reported_norm_statistic(),
            "count": window_norm_statistic(),
        },
    )
    state = opt.init({"w": jnp.zeros(2)})
    for g in ([1.0, 2.0], [3.0, 2.0]):
        _, state = opt.update({"w": jnp.asarray(g)}, state)
    stats = opt.stats(state)
    assert float(stats.grad_sq_norm) == 2.0**2 + 2.0**2  # |mean|^2
    assert bool(jnp.isnan(stats.noise_trace)) and bool(jnp.isnan(stats.noise_scale))
    assert set(state.statistics) == {"norm", "count"}


@pytest.mark.parametrize(
    ("track_noise_scale", "statistics", "message"),
    [
        (
            False,
            {"mine": reported_norm_statistic("loss")},
            r"reports 'loss', which is not a field of AccumulationStats",
        ),
        (
            False,
            {"a": reported_norm_statistic(), "b": reported_norm_statistic()},
            r"The statistics 'a' and 'b' both report 'grad_sq_norm'",
        ),
        # The noise scale that track_noise_scale keeps reports it too.
        (
            True,
            {"mine": reported_norm_statistic("noise_scale")},
            r"The statistics 'noise_scale' and 'mine' both report 'noise_scale'",
        ),
    ],
    ids=["unknown-field", "two-statistics", "with-the-noise-scale"],
)
def test_a_report_stats_cannot_show_is_refused_naming_it(
    track_noise_scale, statistics, message
):
    opt = ga.MultiSteps(
        optax.sgd(1.0), 2, track_noise_scale=track_noise_scale, statistics=statistics
    )
    with pytest.raises(ValueError, match=message):
        opt.stats(opt.init({"w": jnp.zeros(2)}))


def test_accumulate_and_ternary_accumulate_take_statistics_and_a_window_reduction():
    """The keywords of MultiSteps, with per-device terms on a 1-D mesh: the
    statistic counts every device's micro-batches, the reduction runs once
    per window; a ternary window's decoded terms go through it too."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    batches = _batches(K)
    expected_updates, expected_sq = _expected(_params(), batches)
    shared = {
        "unreduced_axes": "data",
        "window_reduction": bf16_wire_reduction(),
        "statistics": {"window_norm": window_norm_statistic()},
    }
    txs = {
        "accumulate": ga.accumulate(optax.sgd(1.0), K, **shared),
        "ternary_accumulate": ga.ternary_accumulate(
            optax.sgd(1.0), K, clip_sigma=None, min_size=1, **shared
        ),
    }
    grad_fn = ga.local_value_and_grad(_loss, "data")
    with jax.set_mesh(mesh):
        params = _params()
        for name, tx in txs.items():
            state = tx.init(params)

            @jax.jit
            def step(params, state, x, tx=tx):
                _, grads = grad_fn(params, x)
                return tx.update(grads, state, params)

            for x in batches:
                x = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
                updates, state = jax.block_until_ready(step(params, state, x))
            stat = state.statistics["window_norm"]
            assert float(stat.last_micro_batches) == K * 8, name
            assert int(state.reduction_state) == 1, name
            if name == "accumulate":
                np.testing.assert_allclose(
                    float(stat.last_sq_norm), expected_sq, rtol=5e-2
                )
                for u, e in zip(
                    jax.tree.leaves(jax.device_get(updates)),
                    jax.tree.leaves(expected_updates),
                    strict=True,
                ):
                    np.testing.assert_allclose(u, e, rtol=2e-2, atol=1e-4)
            else:  # unbiased codes: the window's mean, with rounding noise
                for u, e in zip(
                    jax.tree.leaves(jax.device_get(updates)),
                    jax.tree.leaves(expected_updates),
                    strict=True,
                ):
                    assert abs(float(np.mean(u)) - float(np.mean(e))) < 0.1 * float(
                        np.max(np.abs(e))
                    )


# --- a codec of your own -----------------------------------------------------


def scaled_sign_codec(min_size: int = 256) -> ga.extend.Codec:
    """Each device sends the signs of its input (int8 here; packed bits would
    take an eighth of that) and one float32 scale, their mean magnitude:
    ``scale * sign(x)`` is what the others receive, and error feedback
    keeps the rest."""

    def codec_sum(inputs, state, key, wire):
        del key  # no random draws
        sums, sent, finite = [], [], []
        for x in inputs:
            scale = jnp.mean(jnp.abs(x))
            signs = jnp.sign(x).astype(jnp.int8)
            all_signs, all_scales = jax.lax.all_gather((signs, scale), wire.axis)
            total = jnp.zeros(x.shape, jnp.float32)
            for d in range(wire.num_devices):  # one order on every device
                total = total + all_scales[d] * all_signs[d]
            sums.append(total)
            sent.append(scale * signs)
            finite.append(jnp.all(jnp.isfinite(all_scales)))
        return ga.extend.CodecSum(sums, sent, finite, state)

    return ga.extend.Codec(
        name=f"scaled_sign(min_size={min_size})",
        compresses=lambda shape: math.prod(shape) >= min_size,
        init=lambda shapes, key: (),
        sum=codec_sum,
    )


def test_a_codec_of_your_own_sends_its_codes_and_loses_nothing_over_time():
    """Under ``jax.pmap``: the compiled mean gathers int8 signs and one scale
    per device, never the float32 leaf; error feedback loses nothing: after
    T calls on the same inputs, the returned means and what the devices
    still hold add up to T times the true mean, and the running mean's
    error shrinks, like 1/sqrt(T) for these codes."""
    devices = jax.device_count()
    rng = np.random.default_rng(3)
    grads = {
        "w": rng.standard_normal((devices, 64, 128)).astype(np.float32),
        "b": rng.standard_normal((devices, 32)).astype(np.float32),
    }
    tx = ga.compressed_average_across_devices("i", scaled_sign_codec())
    state = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (devices, *jnp.shape(x))),
        tx.init(jax.tree.map(lambda g: g[0], grads)),
    )
    compiled = jax.pmap(tx.update, axis_name="i").lower(grads, state).compile()
    collectives = ga.measure.collectives(compiled)
    gathered = sorted(
        shape for c in collectives if c.kind == "all-gather" for shape in c.shapes
    )
    assert gathered == ["f32[8]", "s8[8,64,128]"]
    # The all-reduce carries "b" (under min_size) and the weight only.
    assert all(c.nbytes < 1024 for c in collectives if c.kind == "all-reduce")

    def means(g, state):
        def step(state, _):
            mean, state = tx.update(g, state)
            return state, mean["w"]

        state, series = jax.lax.scan(step, state, None, length=256)
        return series, state.residual["w"]

    series, residual = jax.pmap(means, axis_name="i")(grads, state)
    series = np.asarray(series[0], np.float64)  # device 0's, as every device's
    target = grads["w"].astype(np.float64).mean(0)
    running = np.cumsum(series, axis=0)
    held = np.asarray(residual, np.float64).sum(0)
    np.testing.assert_allclose(
        running[-1] + held, 256 * target, atol=2e-3 * np.abs(256 * target).max()
    )

    def error(t):
        return np.linalg.norm(running[t - 1] / t - target) / np.linalg.norm(target)

    # Its residual keeps growing, like sqrt(T) on constant inputs: the error
    # falls like 1/sqrt(T) (2x from 64 to 256), not like 1/T (4x).
    assert error(64) / 3 < error(256) < error(64) / 1.5, (error(64), error(256))


@pytest.mark.parametrize("layout", MESHES.values(), ids=MESHES.keys())
def test_a_codec_of_your_own_reduces_a_window_on_meshes(layout):
    """`compressed_window_reduction` of the codec: each device keeps its own
    residual, stacked over ``data`` and split like its param over ``model``,
    and nothing is lost: the emitted update less the residuals' share is the
    float32 window's."""
    shape, names, types, tensor_parallel = layout
    mesh = jax.make_mesh(shape, names, axis_types=types)

    def run(window_reduction):
        with jax.set_mesh(mesh):
            params = _params(tensor_parallel)
            opt = ga.MultiSteps(
                optax.sgd(1.0),
                K,
                unreduced_axes="data",
                window_reduction=window_reduction,
            )
            grad_fn = ga.local_value_and_grad(_loss, "data")
            state = opt.init(params)

            @jax.jit
            def step(params, state, x):
                return opt.update(grad_fn(params, x)[1], state, params)

            for x in _batches(K):
                x = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
                updates, state = jax.block_until_ready(step(params, state, x))
        return updates, state, params

    updates, state, params = run(ga.compressed_window_reduction(scaled_sign_codec()))
    exact, _, _ = run(None)
    residual = state.reduction_state.residual["w"]
    assert residual.shape == (shape[0], 8, 32)
    assert residual.dtype == jnp.float32
    if types[0] == AxisType.Explicit:
        assert jax.typeof(residual).sharding.spec == P(
            "data", *jax.typeof(params["w"]).sharding.spec
        )
    # "b" (32 elements) is under min_size: summed exactly.
    np.testing.assert_allclose(updates["b"], exact["b"], rtol=1e-5, atol=1e-7)
    unsent = np.asarray(residual).sum(0) / K
    np.testing.assert_allclose(
        np.asarray(updates["w"]) - unsent, exact["w"], rtol=1e-5, atol=1e-6
    )
    assert not np.allclose(updates["w"], exact["w"], atol=1e-3)


def later_sign_codec(told: list) -> ga.extend.Codec:
    """`scaled_sign_codec` whose sums are made later, by functions of the
    new residual (`CodecSum.sums`): each records what it was given."""
    codec = scaled_sign_codec()

    def codec_sum(inputs, state, key, wire):
        result = codec.sum(inputs, state, key, wire)

        def later(total):
            def make(after):
                told.append(None if after is None else after.shape)
                return ga.extend.made_after(total, after)

            return make

        return result._replace(sums=[later(total) for total in result.sums])

    return codec._replace(name="later_sign", sum=codec_sum)


@pytest.mark.parametrize("error_feedback", [True, False], ids=["fed-back", "plain"])
def test_a_codec_may_make_its_sums_after_the_residual(error_feedback):
    """A sum given as a function is made once the residual is kept, from
    that residual (None where none is kept), where the codec runs on
    whole leaves (pmap); the means are the arrays' bitwise."""
    grads = {
        "w": np.random.default_rng(2).standard_normal((8, 64, 128), np.float32),
        "b": np.ones((8, 32), np.float32),
    }
    told = []
    results = []
    for codec in (scaled_sign_codec(), later_sign_codec(told)):
        tx = ga.compressed_average_across_devices(
            "i", codec, error_feedback=error_feedback
        )

        def mean(g, tx=tx):
            return tx.update(g, tx.init(g))[0]

        results.append(jax.pmap(mean, axis_name="i")(grads))
    # The first call is the contract's check of the shape it would have.
    assert told == [None, (64, 128) if error_feedback else None]
    for got, want in zip(*map(jax.tree.leaves, results), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("where", ["window", "window-auto", "split-blocks"])
def test_a_sum_made_later_on_a_2d_mesh(where):
    """On `data` x `model` with the leaf split over `model`. A window's map
    is manual over every axis (on Explicit axes, and on Auto ones where
    `init` saw the params placed): the sum is made from each device's
    residual row, its half over `model` (its leading device axis kept, so
    that XLA updates it in place). A
    mean in a ``shard_map`` over `data` alone runs the codec in a map over
    the leaf's blocks, which only arrays leave: the sum is made there,
    given None. The results are the arrays' bitwise."""
    kind = AxisType.Auto if where == "window-auto" else AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    told = []
    runs = []
    for codec in (scaled_sign_codec(), later_sign_codec(told)):
        with jax.set_mesh(mesh):
            if where.startswith("window"):
                if kind == AxisType.Auto:  # placed: `init` sees the split
                    params = jax.device_put(
                        _params(), {"w": P(None, "model"), "b": P("model")}
                    )
                else:
                    params = _params(tensor_parallel=True)
                opt = ga.MultiSteps(
                    optax.sgd(1.0),
                    K,
                    unreduced_axes="data",
                    window_reduction=ga.compressed_window_reduction(codec),
                )
                grad_fn = ga.local_value_and_grad(_loss, "data")
                state = opt.init(params)

                @jax.jit
                def step(params, state, x, opt=opt, grad_fn=grad_fn):
                    return opt.update(grad_fn(params, x)[1], state, params)

                for x in _batches(K):
                    x = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
                    updates, state = jax.block_until_ready(step(params, state, x))
            else:
                tx = ga.compressed_average_across_devices("data", codec)

                def mean(g, tx=tx):
                    g = g[0]
                    return tx.update(g, tx.init(g))[0]

                grads = np.random.default_rng(4).standard_normal((4, 32, 128))
                placed = jax.device_put(
                    grads.astype(np.float32), P("data", None, "model")
                )
                updates = jax.jit(
                    jax.shard_map(
                        mean, in_specs=P("data"), out_specs=P(), axis_names={"data"}
                    )
                )(placed)
        runs.append(updates)
    row = (1, 8, 16)  # one device's residual row of "w", its half over `model`
    # (None: the contract's check of the shape; the step traced twice.)
    assert set(told) == ({None, row} if where.startswith("window") else {None}), told
    for got, want in zip(*map(jax.tree.leaves, runs), strict=True):
        np.testing.assert_array_equal(got, want)


BROKEN_SUMS = {
    # One sum too few: a bare IndexError deep in the mean before.
    "too-few": (
        lambda result: result._replace(sums=result.sums[:-1]),
        r"scaled_sign\(min_size=256\): its sum returned 1 `sums` for 2 inputs",
    ),
    # A flattened sum: returned silently as the mean's leaf before.
    "flattened": (
        lambda result: result._replace(sums=[s.reshape(-1) for s in result.sums]),
        r"CodecSum.sums\[0\] has shape \(\d+,\), but input 0 \(updates leaf "
        r"\[0\] in flattened order, shape \(32, \d+\) on this device\) needs "
        r"shape \(32, \d+\)",
    ),
    "sent-flattened": (
        lambda result: result._replace(sent=[s.reshape(-1) for s in result.sent]),
        r"CodecSum.sent\[0\] has shape \(\d+,\)",
    ),
    "finite-per-element": (
        lambda result: result._replace(finite=[jnp.isfinite(s) for s in result.sums]),
        r"CodecSum.finite\[0\] has shape \(32, \d+\).* needs a bool scalar",
    ),
    "a-tuple": (
        lambda result: tuple(result),
        r"its sum returned a tuple, not a gradaccum_jax.extend.CodecSum",
    ),
    # A sum made later is checked by the shape it would have.
    "later-flattened": (
        lambda result: result._replace(
            sums=[lambda after, s=s: s.reshape(-1) for s in result.sums]
        ),
        r"CodecSum.sums\[0\] has shape \(\d+,\), but input 0",
    ),
    "sent-later": (
        lambda result: result._replace(
            sent=[lambda after, s=s: s for s in result.sent]
        ),
        r"CodecSum.sent\[0\] is a function; only a sum may be made later",
    ),
}


@pytest.mark.parametrize(("breaks", "message"), BROKEN_SUMS.values(), ids=BROKEN_SUMS)
@pytest.mark.parametrize("mapped", ["pmap", "shard_map-split"])
def test_a_codec_whose_sum_breaks_the_contract_is_refused(breaks, message, mapped):
    """A codec of your own whose sum returns the wrong number of sums, or
    sums not shaped as its inputs, is refused with a message naming it,
    where its sum runs whole (pmap) and on split blocks (a shard_map over
    `data` on a `data` x `model` mesh, the leaf split over `model`)."""
    codec = scaled_sign_codec()
    broken = codec._replace(
        sum=lambda *args: breaks(codec.sum(*args)),
    )
    grads = {
        "w": np.ones((8, 64, 128), np.float32),
        "v": np.ones((8, 32, 128), np.float32),
    }
    tx = ga.compressed_average_across_devices("data", broken)

    def mean(grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        return tx.update(grads, tx.init(grads))[0]

    with pytest.raises(ValueError, match=message):
        if mapped == "pmap":
            jax.pmap(mean, axis_name="data")(jax.tree.map(lambda g: g[:, None], grads))
        else:
            mesh = jax.make_mesh(
                (4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
            )
            with jax.set_mesh(mesh):
                placed = jax.device_put(
                    jax.tree.map(lambda g: g[:4], grads), P("data", None, "model")
                )
                jax.jit(
                    jax.shard_map(
                        mean, in_specs=P("data"), out_specs=P(), axis_names={"data"}
                    )
                )(placed)
