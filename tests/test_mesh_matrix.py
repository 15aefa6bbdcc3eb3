"""Every transformation on the layouts users run, against one device.

A cell is a mesh layout x a param dtype x a transformation. The model: a
column-parallel layer, a stack of residual layers under ``jax.lax.scan``
(one leaf with a leading layer axis, as large models hold their layers) and
a row-parallel layer. The layouts: a 1-D Explicit and a 1-D Auto ``data``
mesh with replicated params, and a 2-D Explicit ``data`` x ``model`` mesh
with replicated, FSDP-sharded (``P("data", None)``; the stack split on a
layer's rows) and tensor-parallel (``P(None, "model")``, Megatron's split)
params; float32 and bfloat16 params. Every transformation runs on every
layout it supports, each pair with one dtype, chosen so that every
transformation and every layout meets both (``_cells`` says which, and
where both run). Each cell runs a few jitted steps of one transformation
and checks that

* the results equal the same steps on plain, unsharded arrays (exactly where
  the inputs are the same bits, to a tolerance where a collective sums in
  another order), in the params' dtypes;
* on an Explicit mesh, updates come back sharded like the params (the types
  say so, with no resharding on the way);
* with tensor-parallel params, no program the cell compiled all-gathers over
  ``model`` a param-shaped tensor (a param, its gradient or update, one
  layer of the stack) that the plain ``jax.grad`` and optax step of the
  same layout does not. Read from the compiled HLO
  (`gradaccum_jax.measure.collectives`); the model is wide enough that XLA
  keeps the params split in the plain step rather than gather them.

One small model; each cell compiles its step once.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax.measure import collectives
from helpers import assert_no_unreduced_or_reduced

K = 2  # micro-batches per window
# The model's widths: inputs, hidden features (the scanned layers' too),
# outputs. No param is shaped like a batch of activations (8 or fewer rows
# per device by HIDDEN), so that a gathered param is told by its shape; the
# plain step keeps every tensor-parallel param split
# (`test_the_gather_check_sees_a_gathered_param`).
IN, HIDDEN, OUT, LAYERS = 16, 32, 4, 2


class Layout(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    axis_type: AxisType
    specs: dict[str, P]  # the params' partitions

    @property
    def explicit(self) -> bool:
        return self.axis_type == AxisType.Explicit

    def mesh(self) -> jax.sharding.Mesh:
        return jax.make_mesh(
            self.shape, self.axes, axis_types=(self.axis_type,) * len(self.axes)
        )

    @property
    def shards_params_over_data(self) -> bool:
        return any("data" in spec for spec in self.specs.values())

    @property
    def splits_params_over_model(self) -> bool:
        return any("model" in spec for spec in self.specs.values())


REPLICATED = {"w1": P(), "b1": P(), "layers": P(), "w2": P()}
LAYOUTS = {
    "1d-explicit": Layout((8,), ("data",), AxisType.Explicit, REPLICATED),
    "1d-auto": Layout((8,), ("data",), AxisType.Auto, REPLICATED),
    "2d-replicated": Layout((4, 2), ("data", "model"), AxisType.Explicit, REPLICATED),
    "2d-fsdp": Layout(
        (4, 2),
        ("data", "model"),
        AxisType.Explicit,
        {
            "w1": P("data", None),
            "b1": P("data"),
            "layers": P(None, "data", None),
            "w2": P("data", None),
        },
    ),
    # Megatron's split: the first layer by columns, the second by rows.
    "2d-tp": Layout(
        (4, 2),
        ("data", "model"),
        AxisType.Explicit,
        {
            "w1": P(None, "model"),
            "b1": P("model"),
            "layers": P(None, "model", None),
            "w2": P("model", None),
        },
    ),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _params(dtype) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(0)
    return {
        "w1": (rs.randn(IN, HIDDEN) * 0.3).astype(dtype),
        "b1": (rs.randn(HIDDEN) * 0.1).astype(dtype),
        "layers": (rs.randn(LAYERS, HIDDEN, HIDDEN) * 0.3).astype(dtype),
        "w2": (rs.randn(HIDDEN, OUT) * 0.3).astype(dtype),
    }


def _grads(dtype, n: int) -> list[dict[str, np.ndarray]]:
    """``n`` micro-batches of gradients, some entries large (so clips bite)."""
    rs = np.random.RandomState(1)
    return [
        {
            name: (rs.standard_t(3, p.shape) * 0.2).astype(dtype)
            for name, p in _params(dtype).items()
        }
        for _ in range(n)
    ]


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    """``n`` batches of 32 examples, each with a mask of valid ones."""
    rs = np.random.RandomState(2)
    return [
        {
            "x": rs.randn(32, IN).astype(np.float32),
            "y": rs.randn(32, OUT).astype(np.float32),
            "mask": (rs.rand(32) < 0.7).astype(np.float32),
        }
        for _ in range(n)
    ]


def _matmul(a, b):
    """``a @ b``; on an Explicit mesh, its rows sharded like ``a``'s and its
    columns like ``b``'s (Megatron's column-parallel product keeps the
    ``model`` split of its features).

    Tensor parallelism's row-parallel product contracts over ``model`` on
    both sides, and JAX asks for the output sharding there, as a user must.
    """
    if AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types:
        return a @ b
    rows, columns = jax.typeof(a).sharding.spec, jax.typeof(b).sharding.spec
    return jnp.matmul(
        a,
        b,
        out_sharding=P(*_padded(rows, a.ndim)[:-1], _padded(columns, b.ndim)[-1]),
    )


def _layer(hidden, weights):
    """One residual layer of the scanned stack, its output laid out as its
    input: with tensor parallelism, the product over ``model`` reduce-scattered
    back to features split over ``model``."""
    if AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types:
        return hidden + jnp.tanh(hidden @ weights), None
    spec = jax.typeof(hidden).sharding.spec
    return hidden + jnp.tanh(jnp.matmul(hidden, weights, out_sharding=spec)), None


def _gathered(params):
    """FSDP's all-gather: params sharded over ``data`` made whole for use.

    On an Explicit mesh a user writes it (the types would not add up
    otherwise); model-axis partitions stay, as tensor parallelism wants.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in mesh.axis_types:
        return params

    def gather(p):
        spec = jax.typeof(p).sharding.spec
        kept = [None if part == "data" else part for part in spec]
        return jax.sharding.reshard(p, P(*kept)) if kept != list(spec) else p

    return jax.tree.map(gather, params)


def _errors(params, batch):
    params = _gathered(params)
    hidden = jnp.tanh(_matmul(batch["x"].astype(params["w1"].dtype), params["w1"]))
    hidden, _ = jax.lax.scan(_layer, hidden + params["b1"], params["layers"])
    pred = _matmul(hidden, params["w2"])
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2, axis=-1)


def _masked_loss(params, batch):
    """The masked mean loss and the number of valid examples."""
    count = jnp.sum(batch["mask"])
    return jnp.sum(batch["mask"] * _errors(params, batch)) / jnp.maximum(
        count, 1.0
    ), count


def _mean_loss(params, batch):
    return jnp.mean(_errors(params, batch))


# --- the transformations, each run as its user would -----------------------

# The programs that the run in progress compiled, one per jitted function
# (`_on_mesh` reads them). Lowering again what a call compiled hits jax.jit's
# caches: reading a program costs no compile.
_PROGRAMS: list[Any] = []


def _jit(f):
    """``jax.jit(f)``, its program recorded in ``_PROGRAMS`` at the first call.

    Every value it returns (the states, the updates, the gradients) is
    checked: no unreduced or reduced array crosses a jit boundary (newer
    JAX releases refuse one as the next call's input).
    """
    jitted = jax.jit(f)
    recorded = False

    def call(*args):
        nonlocal recorded
        if not recorded:
            _PROGRAMS.append(jitted.lower(*args).compile())
            recorded = True
        out = jitted(*args)
        assert_no_unreduced_or_reduced(out, getattr(f, "__name__", repr(f)))
        return out

    return call


def _place(tree, specs, layout):
    """``tree`` on the mesh with ``specs`` (None: plain, unsharded arrays)."""
    if layout is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.tree.map(lambda x, spec: jax.device_put(x, spec), tree, specs)


def _batch_specs(batch):
    return {name: P("data") for name in batch}


def _run_updates(tx, params, grads_seq, layout, *, flush: bool = False):
    """The updates of ``tx`` on fixed gradients, step by step, then a flush."""
    params = _place(params, layout and layout.specs, layout)
    state = _jit(tx.init)(params)
    step = _jit(lambda g, s, p: tx.update(g, s, p))
    outputs = []
    for grads in grads_seq:
        updates, state = step(
            _place(grads, layout and layout.specs, layout), state, params
        )
        outputs.append(jax.block_until_ready(updates))
    if flush:
        updates, state = _jit(tx.flush)(state, params)
        outputs.append(jax.block_until_ready(updates))
    return outputs, state


def multisteps(params, layout):
    tx = ga.MultiSteps(optax.adam(1e-2), K, track_noise_scale=True)
    outputs, state = _run_updates(
        tx, params, _grads(params["w1"].dtype, 3), layout, flush=True
    )
    stats = tx.stats(state)
    # The noise scale's squared norms sum over every shard of a leaf.
    return outputs, (
        stats.window_fill,
        stats.gradient_steps,
        stats.grad_sq_norm,
        stats.noise_trace,
    )


def accumulate_in_chain(params, layout):
    tx = optax.chain(
        ga.clip_by_global_norm(1.0), ga.accumulate(optax.sgd(0.5), K), ga.clip(0.05)
    )
    return _run_updates(tx, params, _grads(params["w1"].dtype, 2 * K), layout)[0], ()


def low_precision_window(params, layout):
    """A bfloat16 window (a running mean) for params of any dtype."""
    tx = ga.MultiSteps(optax.sgd(1.0), K, accumulator_dtype=jnp.bfloat16)
    return _run_updates(
        tx, params, _grads(params["w1"].dtype, K + 1), layout, flush=True
    )[0], ()


def bfloat16_grads_window(params, layout):
    """bfloat16 gradients (a mixed-precision backward pass) of any params."""
    tx = ga.MultiSteps(optax.sgd(1.0), K)
    grads = _grads(jnp.bfloat16, 2 * K)
    return _run_updates(tx, params, grads, layout)[0], ()


def ternary_accumulate(params, layout):
    # At the default min_size (256 elements), w1 and the scanned layers (a
    # scale per layer) are coded, w2 and b1 summed exactly.
    tx = ga.ternary_accumulate(optax.sgd(1.0), K, seed=3)
    return _run_updates(
        tx, params, _grads(params["w1"].dtype, K + 1), layout, flush=True
    )[0], ()


def ternarize(params, layout):
    tx = optax.chain(ga.ternarize(5), optax.sgd(1.0))
    return _run_updates(tx, params, _grads(params["w1"].dtype, 2), layout)[0], ()


def microbatched(params, layout):
    grad_fn = ga.microbatched_value_and_grad(_masked_loss, 4, has_aux=True)
    batch = _batches(1)[0]
    params = _place(params, layout and layout.specs, layout)
    batch = _place(batch, _batch_specs(batch), layout)
    (loss, count), grads = _jit(grad_fn)(params, batch)
    return [grads], (loss, count)


def average_across_devices(params, layout):
    """The weighted device mean inside a ``shard_map`` over ``data``."""
    return _device_mean_run(params, layout, ga.average_across_devices("data"))


def compressed_average_across_devices(params, layout):
    """The same through a codec's plumbing (its state placed like the
    params, error feedback, the weighted sum): top-k sending every entry in
    float32 is the float32 mean."""
    codec = ga.codecs.topk(1.0, bits=32)
    return _device_mean_run(
        params, layout, ga.compressed_average_across_devices("data", codec)
    )


def _per_device_residuals(state, layout):
    """A chain's state whose first part is a `CodecState`, as it crosses a
    ``shard_map`` over ``data``: each device's residual is its own, so the
    global residual stacks ``data``'s blocks along axis 0 (``P("data")``
    hands each device its block back), split like its param over other
    axes; the rest is the same on every device. Returns the state and its
    specs."""
    n = layout.mesh().shape["data"]
    codec_state = state[0]
    residual = {
        name: jax.device_put(
            jnp.concatenate([r] * n),
            P("data", *_padded(layout.specs[name], r.ndim)[1:]),
        )
        if isinstance(r, jax.Array)
        else r  # a leaf that keeps no residual: no array
        for name, r in codec_state.residual.items()
    }
    specs = (
        codec_state._replace(
            key=P(),
            residual={name: P("data") for name in residual},
            codec=P(),
        ),
        *(P() for _ in state[1:]),
    )
    return (codec_state._replace(residual=residual), *state[1:]), specs


def _device_mean_run(params, layout, averaging):
    """``averaging`` of each device's gradients over ``data``, then sgd."""
    state_specs = P()
    if layout is None:  # the reference: the whole batch's masked mean
        tx = optax.sgd(1.0)

        def step(params, state, batch):
            grads = jax.grad(lambda p: _masked_loss(p, batch)[0])(params)
            return tx.update(grads, state, params)

    else:
        tx = optax.chain(averaging, optax.sgd(1.0))

        def local_step(params, state, batch):
            # Each device's own gradient: differentiated as replicated, the
            # params' gradient would come out summed over ``data`` already.
            local = jax.lax.pcast(params, "data", to="varying")
            (_, count), grads = jax.value_and_grad(_masked_loss, has_aux=True)(
                local, batch
            )
            return tx.update(grads, state, params, weight=count)

    params = _place(params, layout and layout.specs, layout)
    state = _jit(tx.init)(params)
    if layout is not None:
        if isinstance(state[0], ga.extend.CodecState):
            state, state_specs = _per_device_residuals(state, layout)
        # Manual over ``data`` only: a ``model`` axis stays the compiler's.
        step = jax.shard_map(
            local_step,
            in_specs=(P(), state_specs, P("data")),
            out_specs=(P(), state_specs),
            axis_names={"data"},
        )
    step = _jit(step)
    outputs = []
    for batch in _batches(2):
        updates, state = step(params, state, _place(batch, _batch_specs(batch), layout))
        outputs.append(jax.block_until_ready(updates))
    return outputs, ()


def _unreduced_run(params, layout, weighted: bool):
    """MultiSteps reducing the window once, from per-device gradients."""
    if layout is None:  # the reference: each window's big-batch gradient
        tx = ga.MultiSteps(optax.sgd(1.0), K)
        loss = _masked_loss if weighted else _mean_loss

        def step(params, state, batch):
            grads = jax.grad(
                lambda p: loss(p, batch)[0] if weighted else loss(p, batch)
            )(params)
            weight = jnp.sum(batch["mask"]) if weighted else None
            return tx.update(grads, state, params, weight=weight)

    else:
        tx = ga.MultiSteps(optax.sgd(1.0), K, unreduced_axes="data")
        if weighted:
            grad_fn = ga.local_value_and_grad(
                lambda p, b: _masked_loss(p, b), "data", has_weight=True
            )
        else:
            grad_fn = ga.local_value_and_grad(_mean_loss, "data")

        def step(params, state, batch):
            if weighted:
                (_, weight), grads = grad_fn(params, batch)
                return tx.update(grads, state, params, weight=weight)
            _, grads = grad_fn(params, batch)
            return tx.update(grads, state, params)

    params = _place(params, layout and layout.specs, layout)
    state = _jit(tx.init)(params)
    step = _jit(step)
    outputs = []
    for i, batch in enumerate(_batches(2 * K)):
        if i == K + 1 and layout is not None:
            # A checkpoint mid-window: reduced, then resumed from.
            state = _jit(tx.reduce_window)(state)
        updates, state = step(params, state, _place(batch, _batch_specs(batch), layout))
        outputs.append(jax.block_until_ready(updates))
    return outputs, ()


def unreduced_window(params, layout):
    return _unreduced_run(params, layout, weighted=False)


def unreduced_weighted_window(params, layout):
    return _unreduced_run(params, layout, weighted=True)


TRANSFORMATIONS: dict[str, Callable[[Any, Any], Any]] = {
    f.__name__: f
    for f in (
        multisteps,
        accumulate_in_chain,
        low_precision_window,
        bfloat16_grads_window,
        ternary_accumulate,
        ternarize,
        microbatched,
        average_across_devices,
        compressed_average_across_devices,
        unreduced_window,
        unreduced_weighted_window,
    )
}
# The updates' dtype: the params' (as the inner optimizer returns them on
# gradients of the params' dtype), or the gradients' where they differ.
UPDATE_DTYPE = {"bfloat16_grads_window": jnp.bfloat16}
# Exact where each device adds the same bits a single device adds; where a
# collective sums partial sums (a gradient over a sharded batch, the window's
# all-reduce) the order differs: float32 rounding, or bfloat16's (a bfloat16
# gradient is rounded in its own backward pass, per device or not).
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}


@functools.cache
def _unsharded(name: str, dtype: str):
    """The reference: ``name`` on plain arrays on one device (computed once)."""
    return TRANSFORMATIONS[name](_params(DTYPES[dtype]), None)


def _padded(spec: P, ndim: int) -> tuple[Any, ...]:
    return (*spec, *(None,) * (ndim - len(spec)))


def _on_mesh(name: str, layout: Layout, params):
    """``name``'s run on ``layout``'s mesh; ``_PROGRAMS`` holds its programs."""
    _PROGRAMS.clear()
    with jax.set_mesh(layout.mesh()):
        return TRANSFORMATIONS[name](params, layout)


def _param_gathers(compiled, mesh) -> collections.Counter[tuple[int, ...]]:
    """The all-gathers of ``compiled`` over ``model`` (or over device groups
    that are not a sub-mesh) of a tensor shaped like a param or one layer of
    the scanned stack, by that shape (dimensions of size 1 left out).

    A gathered tensor-parallel param (or its gradient, or its update) shows
    as one. Left out: the gathers of the scanned layers' backward pass, of
    their input's gradient, which the plain step runs too; shaped like a
    batch of activations (its rows are the micro-batch's, which differ
    between paths), no param's shape.
    """
    shapes = {np.shape(p) for p in _params(np.float32).values()}
    shapes.add((HIDDEN, HIDDEN))  # one layer of the scanned stack
    found = collections.Counter()
    for c in collectives(compiled, mesh):
        if c.kind != "all-gather" or (c.axes is not None and "model" not in c.axes):
            continue
        for shape in c.shapes:
            dims = tuple(
                int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d
            )
            squeezed = tuple(d for d in dims if d != 1)
            if squeezed in shapes:
                found[squeezed] += 1
    return found


class GatheredOverModel(AssertionError):
    """A cell's program gathers over ``model`` a param-shaped tensor that the
    plain step does not gather."""


def _assert_gathers_no_param_over_model(name: str, layout_name: str):
    """Every program the cell's run compiled (``_PROGRAMS``) gathers over
    ``model`` no param-shaped tensor more than the plain step does."""
    plain, mesh = _plain_gathers(layout_name), LAYOUTS[layout_name].mesh()
    for compiled in _PROGRAMS:
        extra = _param_gathers(compiled, mesh) - plain
        if extra:
            raise GatheredOverModel(
                f"{name} on {layout_name} all-gathers over 'model' tensors of "
                f"shapes {dict(extra)} that the plain step does not"
            )


@functools.cache
def _plain_gathers(layout_name: str):
    """`_param_gathers` of the plain step on ``layout_name``: ``jax.grad`` of
    the loss and optax's adam, no gradaccum_jax. Float32 params: shapes, not
    dtypes, say what is gathered."""
    layout, tx = LAYOUTS[layout_name], optax.adam(1e-2)

    def step(params, state, batch):
        grads = jax.grad(_masked_loss, has_aux=True)(params, batch)[0]
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    mesh, batch = layout.mesh(), _batches(1)[0]
    with jax.set_mesh(mesh):
        params = _place(_params(np.float32), layout.specs, layout)
        batch = _place(batch, _batch_specs(batch), layout)
        compiled = jax.jit(step).lower(params, tx.init(params), batch).compile()
    return _param_gathers(compiled, mesh)


# Transformations that run on data-parallel layouts only: no cell where the
# params are sharded over ``data``. A device mean of gradients is data
# parallelism over replicated params (with FSDP params jax.grad
# reduce-scatters them itself); an unreduced window refuses such params
# (`test_unreduced_windows_refuse_params_sharded_over_their_axis`).
DATA_PARALLEL_ONLY = (
    "average_across_devices",
    "compressed_average_across_devices",
    "unreduced_window",
    "unreduced_weighted_window",
)
# The cells where the params' dtype is not the only one to matter, so both
# run: XLA:CPU aborted the process on a bfloat16 device mean inside a
# shard_map manual over ``data`` alone of a 2-D mesh (gradaccum_jax now sums
# such means in float32), a bug of the three together, on no single pair.
BOTH_DTYPES = {
    ("average_across_devices", "2d-replicated"),
    ("average_across_devices", "2d-tp"),
}
# bfloat16_grads_window's gradients are bfloat16 whatever the params: its own
# case is float32 params, updates in the gradients' dtype rather than the
# params'. With bfloat16 params it would be multisteps' bfloat16 window, with
# sgd for adam and without the noise scale: nothing more to fail.
PARAM_DTYPE = {"bfloat16_grads_window": "float32"}


def _cells() -> list[tuple[str, str, str]]:
    """The (transformation, layout, params' dtype) cells that run.

    Every transformation runs on every layout it supports, but with one
    dtype: the pair of the i-th transformation and the j-th layout takes
    ``DTYPES``' ``(i + j) % 2``-th, so that each transformation meets both
    dtypes on some layouts and each layout meets both dtypes from some
    transformations (pairwise coverage, half the cells of the full product).
    A defect that needs a transformation and a dtype, or a layout and a
    dtype, still shows in some cell; one that needs all three at once shows
    only where ``BOTH_DTYPES`` runs both dtypes, as history asked.
    ``PARAM_DTYPE`` fixes the dtype of a transformation whose other dtype
    would repeat another transformation's cell.
    `test_cells_cover_every_pair_and_the_pinned_triples` checks all of this,
    so that an edit here cannot drop coverage unnoticed.
    """
    dtypes = list(DTYPES)
    cells = []
    for i, name in enumerate(TRANSFORMATIONS):
        for j, (layout_name, layout) in enumerate(LAYOUTS.items()):
            if name in DATA_PARALLEL_ONLY and layout.shards_params_over_data:
                continue
            if (name, layout_name) in BOTH_DTYPES:
                chosen = dtypes
            else:
                chosen = [PARAM_DTYPE.get(name, dtypes[(i + j) % len(dtypes)])]
            cells.extend((name, layout_name, dtype) for dtype in chosen)
    return cells


CELLS = _cells()
# The cells whose programs still gather tensor-parallel params over
# ``model``, and why. Each fails with `GatheredOverModel` alone (its values
# and shardings are checked first): strict, so that a cell that stops
# gathering fails until its entry goes.
GATHERS_OVER_MODEL = {
    ("average_across_devices", "2d-tp"): (
        "the step's shard_map, manual over data alone, gathers every "
        "model-split param at its boundary (and the updates at its "
        "out_specs): jax 0.10.2 lowers it with the other Explicit axes "
        "replicated"
    ),
    ("compressed_average_across_devices", "2d-tp"): (
        "the same shard_map boundary, which also gathers the residuals"
    ),
}


def _dtypes_met(name: str, dtype: str) -> set[str]:
    """The dtypes a cell runs its transformation on: params' and updates'."""
    return {dtype, jnp.dtype(UPDATE_DTYPE.get(name, DTYPES[dtype])).name}


def test_cells_cover_every_pair_and_the_pinned_triples():
    """Cutting the product to pairs keeps each pair that can fail: every
    transformation on every layout it runs on, with both dtypes somewhere;
    every layout with both dtypes; both dtypes where a bug needed all three."""
    pairs = {(name, layout_name) for name, layout_name, _ in CELLS}
    assert len(set(CELLS)) == len(CELLS)
    for name in TRANSFORMATIONS:
        for layout_name, layout in LAYOUTS.items():
            refused = name in DATA_PARALLEL_ONLY and layout.shards_params_over_data
            assert ((name, layout_name) in pairs) != refused, (name, layout_name)
        met = set().union(*(_dtypes_met(n, d) for n, _, d in CELLS if n == name))
        assert met == set(DTYPES), name
    for layout_name in LAYOUTS:
        met = {dtype for _, in_layout, dtype in CELLS if in_layout == layout_name}
        assert met == set(DTYPES), layout_name
    # Named here rather than read from BOTH_DTYPES, so that an edit of that
    # table cannot drop the bfloat16 device mean on a 2-D mesh unnoticed.
    for layout_name in ("2d-replicated", "2d-tp"):
        for dtype in DTYPES:
            assert ("average_across_devices", layout_name, dtype) in CELLS


@pytest.mark.parametrize(
    ("name", "layout_name", "dtype"),
    [
        pytest.param(
            *cell,
            id="-".join(cell),
            marks=[
                pytest.mark.xfail(
                    strict=True,
                    raises=GatheredOverModel,
                    reason=GATHERS_OVER_MODEL[cell[:2]],
                )
            ]
            if cell[:2] in GATHERS_OVER_MODEL
            else [],
        )
        for cell in CELLS
    ],
)
def test_sharded_equals_unsharded(name, layout_name, dtype):
    layout = LAYOUTS[layout_name]
    params = _params(DTYPES[dtype])
    expected, expected_extra = _unsharded(name, dtype)
    actual, actual_extra = _on_mesh(name, layout, params)
    tolerance = TOLERANCE[dtype]
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
        for (path, w), g in zip(want_leaves, jax.tree.leaves(got), strict=True):
            where = f"step {step}, leaf {jax.tree_util.keystr(path)}"
            assert g.dtype == w.dtype == UPDATE_DTYPE.get(name, DTYPES[dtype]), where
            np.testing.assert_allclose(
                np.asarray(g, np.float32),
                np.asarray(w, np.float32),
                rtol=tolerance,
                # An element much smaller than the leaf's largest gets its
                # rounding error from the sums that made it: scale by those.
                atol=tolerance * float(np.max(np.abs(np.asarray(w, np.float32)))),
                err_msg=where,
            )
        if layout.explicit:
            for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
                leaf = jax.tree_util.keystr(path)[2:-2]
                assert _padded(jax.typeof(g).sharding.spec, g.ndim) == _padded(
                    layout.specs[leaf], g.ndim
                ), f"step {step}, leaf {leaf}: {jax.typeof(g)}"
    for want, got in zip(expected_extra, actual_extra, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tolerance)
    if layout.splits_params_over_model:
        _assert_gathers_no_param_over_model(name, layout_name)


def test_the_gather_check_sees_a_gathered_param():
    """What the matrix's check stands on: on the tensor-parallel layout the
    plain step gathers no param (the model is wide enough that XLA keeps the
    split), and a program that gathers the params shows each one."""
    assert _plain_gathers("2d-tp") == collections.Counter()
    layout = LAYOUTS["2d-tp"]
    mesh = layout.mesh()
    with jax.set_mesh(mesh):
        params = _place(_params(np.float32), layout.specs, layout)
        gather = jax.jit(
            lambda p: jax.tree.map(lambda x: jax.sharding.reshard(x, P()), p)
        )
        compiled = gather.lower(params).compile()
    assert _param_gathers(compiled, mesh) == collections.Counter(
        [(IN, HIDDEN), (HIDDEN,), (LAYERS, HIDDEN, HIDDEN), (HIDDEN, OUT)]
    )


def test_unreduced_windows_refuse_params_sharded_over_their_axis():
    """A per-device term of an FSDP gradient would be the whole gradient on
    every device: the window cannot be unreduced over the axis the params
    are sharded over. Refused at init, before anything compiles."""
    for layout in LAYOUTS.values():
        if not layout.shards_params_over_data:
            continue
        for name in ("unreduced_window", "unreduced_weighted_window"):
            for dtype in DTYPES.values():
                with pytest.raises(
                    ValueError, match="sharded over the mesh axis 'data'"
                ):
                    _on_mesh(name, layout, _params(dtype))


@pytest.mark.parametrize("layout_name", ["2d-fsdp", "2d-tp"])
def test_complex_params_accumulate_exactly_when_sharded(layout_name):
    """A complex window on sharded params: imaginary parts kept, sharding too."""
    layout = LAYOUTS[layout_name]
    params = jax.tree.map(lambda p: p * (1 + 0.5j), _params(np.complex64))
    real, imaginary = _grads(np.float32, 2), _grads(np.float32, 3)[1:]
    grads = [
        jax.tree.map(lambda re, im: (re + 1j * im).astype(np.complex64), r, i)
        for r, i in zip(real, imaginary, strict=True)
    ]

    def run(layout):
        tx = ga.accumulate(optax.sgd(1.0), K)
        return _run_updates(tx, params, grads, layout)[0][-1]

    expected = run(None)
    with jax.set_mesh(layout.mesh()):
        actual = run(layout)
    for name, got in actual.items():
        assert got.dtype == jnp.complex64, name
        assert np.abs(np.imag(np.asarray(got))).max() > 0.01, name
        np.testing.assert_allclose(np.asarray(got), expected[name], rtol=1e-6)
        assert _padded(jax.typeof(got).sharding.spec, got.ndim) == _padded(
            layout.specs[name], got.ndim
        ), name
