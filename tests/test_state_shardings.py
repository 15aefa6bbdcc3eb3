"""Declared shardings: `gradaccum_jax.state_shardings` and what a step
declared with them sends (`gradaccum_jax.measure.step_traffic`).

On an Explicit mesh the state's types say how each leaf is split: the
declared shardings must be those. On an Auto mesh nothing says it, and a
jitted ``init`` replicates optax's zeros: the declared shardings split
adam's moments like their params and the window's rows over ``data``,
and a step declared with them reduces once per window. A window declared
with its params' split instead (what ``nn.get_sharding`` of the boxes
gives) is resharded every micro-step, which `step_traffic` shows and an
Explicit mesh refuses, naming the leaf.
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
from gradaccum_jax.measure import step_traffic

SPECS = {"w": P(None, "model"), "v": P("model", None), "b": P()}
SHAPES = {"w": (16, 32), "v": (32, 4), "b": (4,)}


def _mesh(axis_type):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _params(mesh):
    rs = np.random.RandomState(0)
    return {
        name: jax.device_put(
            rs.randn(*SHAPES[name]).astype(np.float32) * 0.3,
            NamedSharding(mesh, SPECS[name]),
        )
        for name in SHAPES
    }


def _loss(params, x, y):
    # No product contracts over "model" (an Explicit mesh would ask where
    # its result lies): a column-parallel layer, and penalties on the rest.
    hidden = jnp.tanh(x @ params["w"])
    penalty = jnp.sum(params["v"] ** 2) + jnp.sum((params["b"] - y[0]) ** 2)
    return jnp.mean(hidden**2) + 1e-3 * penalty


def _transformations():
    return {
        "MultiSteps": ga.MultiSteps(
            optax.adam(1e-2), 2, unreduced_axes="data", track_noise_scale=True
        ),
        "chain": optax.chain(
            ga.clip_by_global_norm(1.0),
            ga.accumulate(optax.adamw(1e-2), 2, unreduced_axes="data"),
        ),
        "codec window": ga.MultiSteps(
            optax.sgd(0.1),
            2,
            unreduced_axes="data",
            window_reduction=ga.compressed_window_reduction(ga.codecs.topk(0.25)),
        ),
        # Its anchor and outer momentum in host memory.
        "diloco offloaded": ga.diloco(
            optax.adam(1e-2), 2, fragments=2, offload_outer_state=True
        ),
    }


def _specs(tree):
    return [s.spec for s in jax.tree.leaves(tree)]


def _normalized(spec):
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)


@pytest.mark.parametrize("name", sorted(_transformations()))
def test_explicit_declared_shardings_are_the_state_types(name):
    tx = _transformations()[name]
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        params = _params(mesh)
        state = jax.jit(tx.init)(params)
        from_arrays = ga.state_shardings(tx, params)
        from_structs = ga.state_shardings(
            tx,
            jax.tree.map(
                lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding),
                params,
            ),
        )
    typed = [
        _normalized(jax.typeof(leaf).sharding.spec) for leaf in jax.tree.leaves(state)
    ]
    assert [_normalized(s) for s in _specs(from_arrays)] == typed
    assert _specs(from_structs) == _specs(from_arrays)
    kinds = [s.memory_kind for s in jax.tree.leaves(from_arrays)]
    assert kinds == [leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)]
    assert ("pinned_host" in kinds) == (name == "diloco offloaded")
    assert jax.tree.structure(from_arrays) == jax.tree.structure(state)


def test_auto_declared_shardings_split_what_a_jitted_init_replicates():
    tx = _transformations()["MultiSteps"]
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        declared = ga.state_shardings(tx, _params(mesh))
    inner = declared.inner_opt_state[0]
    assert _normalized(inner.mu["w"].spec) == (None, "model")
    assert _normalized(inner.nu["v"].spec) == ("model",)
    # The window's rows: over "data", then the param's own split.
    assert _normalized(declared.acc_grads["w"].spec) == ("data", "model")
    assert _normalized(declared.acc_grads["v"].spec) == (("data", "model"),)
    assert _normalized(declared.acc_weight.spec) == ("data",)
    assert _normalized(declared.mini_step.spec) == ()


def _declared_step(tx, mesh, state_sharding, params):
    """A micro-step jitted with declared in/out shardings, compiled, and
    the state it starts from."""
    grad_fn = ga.local_value_and_grad(_loss, "data")
    params_sharding = jax.tree.map(lambda p: p.sharding, params)
    rows = NamedSharding(mesh, P("data"))

    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(
        step,
        in_shardings=(params_sharding, state_sharding, rows, rows),
        out_shardings=(params_sharding, state_sharding),
    )
    state = jax.jit(tx.init, out_shardings=state_sharding)(params)
    x = jax.device_put(np.ones((32, 16), np.float32), rows)
    y = jax.device_put(np.ones((32, 4), np.float32), rows)
    return jitted.lower(params, state, x, y).compile(), jitted, state, x, y


def test_an_auto_step_declared_with_them_reduces_once_per_window():
    tx = ga.MultiSteps(optax.adam(1e-2), 2, unreduced_axes="data")
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        params = _params(mesh)
        declared = ga.state_shardings(tx, params)
        compiled, *_ = _declared_step(tx, mesh, declared, params)
        good = step_traffic(compiled, mesh, "data")
        # The window declared with its params' split (the boxes' mistake).
        mistaken = declared._replace(
            acc_grads=jax.tree.map(lambda p: p.sharding, params)
        )
        compiled, *_ = _declared_step(tx, mesh, mistaken, params)
        bad = step_traffic(compiled, mesh, "data")
    assert good.once_per_window and good.gathers == ()
    assert list(good.per_window) == [("data",)]
    # Resharded every call: over "data" on each micro-step, unseen by a
    # count of all-reduces.
    assert not bad.once_per_window
    assert any(c.kind != "all-reduce" for c in bad.every_call_over_summed)


def test_an_explicit_window_declared_otherwise_is_refused_naming_the_leaf():
    tx = ga.MultiSteps(optax.adam(1e-2), 2, unreduced_axes="data")
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        params = _params(mesh)
        declared = ga.state_shardings(tx, params)
        mistaken = declared._replace(
            acc_grads={**declared.acc_grads, "w": NamedSharding(mesh, P(None, "model"))}
        )
        with pytest.raises(
            ValueError,
            match=r"state\.acc_grads\['w'\] arrived split .*state_shardings",
        ):
            _declared_step(tx, mesh, mistaken, params)


def test_flax_boxes_map_through_the_active_rules():
    nn = pytest.importorskip("flax.linen")
    tx = ga.MultiSteps(optax.adam(1e-2), 2, unreduced_axes="data")
    mesh = _mesh(AxisType.Auto)
    model = nn.Dense(
        8, kernel_init=nn.with_logical_partitioning(nn.initializers.ones, ("in", "out"))
    )
    rules = (("out", "model"),)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 16)))
        declared = ga.state_shardings(tx, boxed["params"])
        # init on the boxes hands none to the rows.
        state = jax.eval_shape(tx.init, boxed["params"])
    assert _normalized(declared.acc_grads["kernel"].spec) == ("data", "model")
    assert _normalized(declared.inner_opt_state[0].mu["kernel"].spec) == (None, "model")
    assert not isinstance(state.acc_grads["kernel"], nn.LogicallyPartitioned)
    assert isinstance(state.inner_opt_state[0].mu["kernel"], nn.LogicallyPartitioned)


def test_a_step_declared_with_them_keeps_an_offloaded_state_in_host_memory():
    """On an Auto mesh a jitted step whose ``in_shardings`` and
    ``out_shardings`` are `state_shardings` keeps `diloco`'s anchor and
    outer momentum in host memory, call after call, with the values of
    the state kept on the device."""
    mesh = _mesh(AxisType.Auto)
    results = {}
    with jax.set_mesh(mesh):
        params = _params(mesh)
        for offload in (False, True):
            tx = ga.diloco(optax.adam(1e-2), 2, offload_outer_state=offload)
            declared = ga.state_shardings(tx, params)
            state = jax.jit(tx.init, out_shardings=declared)(params)

            def step(params, state, x, y, tx=tx):
                grads = jax.grad(_loss)(params, x, y)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            param_shardings = jax.tree.map(lambda p: p.sharding, params)
            step = jax.jit(
                step,
                in_shardings=(param_shardings, declared, None, None),
                out_shardings=(param_shardings, declared),
            )
            p = params
            for seed in range(3):
                rs = np.random.RandomState(seed)
                x, y = rs.randn(8, 16).astype(np.float32), rs.randn(8, 4)
                p, state = jax.block_until_ready(step(p, state, x, y.astype("f4")))
            results[offload] = (p, state)
    state = results[True][1]
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.anchor)} == {
        "pinned_host"
    }
    assert {
        leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.inner_state)
    } == {"device"}
    for a, b in zip(
        jax.tree.leaves(results[True]), jax.tree.leaves(results[False]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
