"""Every transformation inside ``optax.masked`` and ``optax.multi_transform``.

The errors for complex leaves, and the guides, tell users to keep such
leaves out of a compressing transformation with these wrappers, so they
must work: ``optax.masked`` hands the transformation the params, updates
and state with the other leaves replaced by ``optax.MaskedNode``. The
leaves a transformation is given get what it gives them alone; the others
pass through. Device means run under ``jax.pmap`` (8 devices), windows
reduced with a codec on a 1-D Explicit mesh of 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax import codecs
from helpers import init_as_users_do

N = 8
STEPS = 3
# The matrix is coded by every compressing transformation (>= 256
# elements), the bias by none (below min_size: the state keeps no array for
# it); the complex leaf is the one masked out.
SHAPES = {"w": (32, 64), "b": (64,), "z": (16, 16)}
MASK = {"w": True, "b": True, "z": False}
GIVEN = [name for name, given in MASK.items() if given]

ONE_DEVICE = {
    "MultiSteps": lambda: ga.MultiSteps(optax.adam(0.1), 2),
    "accumulate": lambda: ga.accumulate(optax.adam(0.1), 2),
    "clip_by_global_norm": lambda: ga.clip_by_global_norm(1.0),
    "clip": lambda: ga.clip(0.5),
    "ternarize": lambda: ga.ternarize(3),
    "ternary_accumulate": lambda: ga.ternary_accumulate(optax.sgd(1.0), 2, seed=3),
    "diloco": lambda: ga.diloco(optax.adam(0.1), 2),
}
DEVICE_MEANS = {
    "average_across_devices": lambda: ga.average_across_devices("i"),
    "ternary_average_across_devices": lambda: ga.ternary_average_across_devices("i", 3),
    "codecs.ternary": lambda: ga.compressed_average_across_devices(
        "i", codecs.ternary()
    ),
    "codecs.quantized": lambda: ga.compressed_average_across_devices(
        "i", codecs.quantized(bits=4)
    ),
    "codecs.topk": lambda: ga.compressed_average_across_devices("i", codecs.topk(0.05)),
    "codecs.powersgd": lambda: ga.compressed_average_across_devices(
        "i", codecs.powersgd(2)
    ),
    "diloco over devices": lambda: ga.diloco(optax.adam(0.1), 2, axis_name="i"),
    "diloco, top-k outer gradients": lambda: ga.diloco(
        optax.adam(0.1),
        2,
        axis_name="i",
        outer_reduction=ga.compressed_average_across_devices("i", codecs.topk(0.05)),
    ),
}


def _tree(seed: int, devices: int | None = None):
    rng = np.random.default_rng(seed)
    lead = () if devices is None else (devices,)
    return {
        "w": rng.standard_normal((*lead, *SHAPES["w"])).astype(np.float32),
        "b": rng.standard_normal((*lead, *SHAPES["b"])).astype(np.float32),
        "z": (
            rng.standard_normal((*lead, *SHAPES["z"]))
            + 1j * rng.standard_normal((*lead, *SHAPES["z"]))
        ).astype(np.complex64),
    }


def _wrappers(build):
    """``build()`` wrapped both ways: masked, and as one group of a
    multi_transform whose other group leaves its leaves as they are."""
    return {
        "masked": optax.masked(build(), MASK),
        "multi_transform": optax.multi_transform(
            {"given": build(), "kept": optax.identity()},
            {name: "given" if given else "kept" for name, given in MASK.items()},
        ),
    }


def _run(tx, params, grads, step):
    state = step(tx.init)(params)
    outputs = []
    for g in grads:
        updates, state = step(tx.update)(g, state, params)
        outputs.append(jax.block_until_ready(updates))
    return outputs


def _assert_given_leaves_as_alone(build, params, grads, step, wrapper):
    alone = _run(
        build(),
        {name: params[name] for name in GIVEN},
        [{name: g[name] for name in GIVEN} for g in grads],
        step,
    )
    wrapped = _run(_wrappers(build)[wrapper], params, grads, step)
    for got, expected, g in zip(wrapped, alone, grads, strict=True):
        for name in GIVEN:
            np.testing.assert_array_equal(
                np.asarray(got[name]), np.asarray(expected[name]), err_msg=name
            )
        np.testing.assert_array_equal(np.asarray(got["z"]), np.asarray(g["z"]))
        assert got["z"].dtype == jnp.complex64


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
@pytest.mark.parametrize("name", ONE_DEVICE)
def test_a_wrapped_transformation_treats_its_leaves_as_alone(name, wrapper):
    params = _tree(0)
    grads = [_tree(s) for s in range(1, STEPS + 1)]
    _assert_given_leaves_as_alone(ONE_DEVICE[name], params, grads, jax.jit, wrapper)


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
@pytest.mark.parametrize("name", DEVICE_MEANS)
def test_a_wrapped_device_mean_treats_its_leaves_as_alone(name, wrapper):
    params = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), _tree(0))
    grads = [_tree(s, N) for s in range(1, STEPS + 1)]

    def step(f):
        return jax.pmap(f, axis_name="i")

    _assert_given_leaves_as_alone(DEVICE_MEANS[name], params, grads, step, wrapper)


WINDOW_REDUCTIONS = {
    "ternary_window_reduction": lambda: ga.ternary_window_reduction(3),
    "codecs.topk window": lambda: ga.compressed_window_reduction(codecs.topk(0.05)),
    "codecs.powersgd window": lambda: ga.compressed_window_reduction(
        codecs.powersgd(2)
    ),
}


def _window_loss(params, x):
    loss = jnp.sum(jnp.tanh(x @ params["w"] + params["b"]))
    if "z" in params:
        loss = loss + jnp.sum(params["z"] ** 2)
    return loss


# The window's mesh: 1-D Explicit and Auto with replicated float32 params,
# and 2-D Explicit with bfloat16 params split over `model` (w by columns,
# b with them), the masked leaf replicated.
WINDOW_MESHES = {
    "1d-explicit": ((N,), ("data",), jax.sharding.AxisType.Explicit, {}, jnp.float32),
    "1d-auto": ((N,), ("data",), jax.sharding.AxisType.Auto, {}, jnp.float32),
    "2d-explicit-tp-bf16": (
        (4, 2),
        ("data", "model"),
        jax.sharding.AxisType.Explicit,
        {"w": P(None, "model"), "b": P("model")},
        jnp.bfloat16,
    ),
}


@pytest.mark.parametrize("mesh_name", WINDOW_MESHES)
@pytest.mark.parametrize("wrapper", ["masked", "multi_transform"])
@pytest.mark.parametrize("name", WINDOW_REDUCTIONS)
def test_a_wrapped_window_reduced_once_per_window_treats_its_leaves_as_alone(
    name, wrapper, mesh_name
):
    """`MultiSteps` reducing its window with a codec on a mesh: the
    per-device terms and residuals of the leaves it is given only, split
    like their params."""
    shape, names, axis_type, specs, dtype = WINDOW_MESHES[mesh_name]

    def build():
        return ga.MultiSteps(
            optax.sgd(1.0),
            2,
            unreduced_axes="data",
            window_reduction=WINDOW_REDUCTIONS[name](),
        )

    grad_fn = ga.local_value_and_grad(_window_loss, "data")
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((16, 32)).astype(dtype) for _ in range(4)]
    params = {name: rng.standard_normal(SHAPES[name]).astype(dtype) for name in SHAPES}
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))

    def run(tx, params):
        step = jax.jit(lambda p, s, x: tx.update(grad_fn(p, x)[1], s, p))
        with jax.set_mesh(mesh):
            params = {
                name: jax.device_put(leaf, specs.get(name, P()))
                for name, leaf in params.items()
            }
            state = init_as_users_do(tx.init, params)
            outputs = []
            for x in xs:
                x = jax.device_put(x, P("data"))
                updates, state = jax.block_until_ready(step(params, state, x))
                # The given leaves only: those left out pass through as the
                # per-device terms `local_value_and_grad` made them.
                outputs.append({name: jax.device_get(updates[name]) for name in GIVEN})
                if axis_type == jax.sharding.AxisType.Explicit:
                    for name in GIVEN:
                        got = jax.typeof(updates[name]).sharding.spec
                        assert _stripped(got) == _stripped(specs.get(name, P())), name
        return outputs

    alone = run(build(), {name: params[name] for name in GIVEN})
    wrapped = run(_wrappers(build)[wrapper], params)
    for got, expected in zip(wrapped, alone, strict=True):
        for name in GIVEN:
            assert got[name].dtype == dtype, name
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def _stripped(spec: P) -> tuple:
    """A partition spec without its trailing Nones."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)
