"""`gradaccum_jax.measure.collectives` reads every collective of compiled HLO.

Small programs with known collectives on a 2 x 4 mesh (``data`` x
``model``): each kind's bytes (operand and result), device groups, mesh
axes and place (the entry, a loop with a known or a runtime trip count, a
conditional's branch). The forms XLA writes on other backends (iota device
groups, async ``-start`` / ``-done`` pairs) are pinned on HLO text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax.measure import Collective, collectives
from helpers import compiled_reference

ROWS, COLS = 16, 32  # the global operand; 8 x 8 float32 (256 bytes) per device
DATA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))
MODEL_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _compile(mesh, per_device_fn):
    """``per_device_fn`` under shard_map over both axes, compiled for 8
    devices (its scalar result, one per device)."""
    mapped = jax.shard_map(
        lambda x: per_device_fn(x)[None],
        mesh=mesh,
        in_specs=P("data", "model"),
        out_specs=P(("data", "model")),
    )
    operand = jax.ShapeDtypeStruct(
        (ROWS, COLS), jnp.float32, sharding=NamedSharding(mesh, P("data", "model"))
    )
    return jax.jit(mapped).lower(operand).compile()


def test_each_kind_with_its_bytes_groups_and_axes(mesh):
    def per_device(x):
        outputs = (
            jax.lax.psum(x, "data"),
            jax.lax.all_gather(x, "model", tiled=True),
            jax.lax.psum_scatter(x, "model", tiled=True),
            jax.lax.all_to_all(x, "model", 0, 0, tiled=True),
            jax.lax.ppermute(x, "data", [(0, 1), (1, 0)]),
            jax.lax.psum(x.astype(jnp.int8), ("data", "model")),
        )
        return sum(out.astype(jnp.float32).sum() for out in outputs)

    found = {
        c.kind + str(c.axes): c for c in collectives(_compile(mesh, per_device), mesh)
    }
    assert sorted(found) == sorted(
        [
            "all-reduce('data',)",
            "all-gather('model',)",
            "reduce-scatter('model',)",
            "all-to-all('model',)",
            "collective-permute('data',)",
            "all-reduce('data', 'model')",
        ]
    )
    # (result bytes, operand bytes, groups) per device.
    figures = {
        key: (c.nbytes, c.operand_nbytes, c.groups, c.group_size)
        for key, c in found.items()
    }
    assert figures["all-reduce('data',)"] == (256, 256, DATA_GROUPS, 2)
    assert figures["all-gather('model',)"] == (1024, 256, MODEL_GROUPS, 4)
    assert figures["reduce-scatter('model',)"] == (64, 256, MODEL_GROUPS, 4)
    assert figures["all-to-all('model',)"] == (256, 256, MODEL_GROUPS, 4)
    assert figures["collective-permute('data',)"] == (256, 256, DATA_GROUPS, 2)
    assert figures["all-reduce('data', 'model')"] == (64, 64, (tuple(range(8)),), 8)
    assert found["all-reduce('data', 'model')"].shapes == ("s8[8,8]",)
    # What a ring moves to each device, per kind: an all-reduce twice its
    # (n - 1) / n, an all-gather (n - 1) / n of its result, a reduce-scatter
    # of its operand, an all-to-all of its buffer, a permute all of it.
    received = {key: c.received_nbytes for key, c in found.items()}
    assert received == {
        "all-reduce('data',)": 256.0,
        "all-gather('model',)": 768.0,
        "reduce-scatter('model',)": 192.0,
        "all-to-all('model',)": 192.0,
        "collective-permute('data',)": 256.0,
        "all-reduce('data', 'model')": 112.0,
    }
    assert found["all-gather('model',)"].shapes == ("f32[32,8]",)
    assert {(c.place, c.trips) for c in found.values()} == {("entry", ())}


def test_place_entry_loop_and_branch(mesh):
    def per_device(x):
        entry = jax.lax.psum(x, "model")

        def layer(carry, _):
            return carry + jax.lax.psum(carry, "data"), None

        scanned, _ = jax.lax.scan(layer, x, None, length=3)
        # A loop over a runtime condition: XLA does not know its trip count.
        looped = jax.lax.while_loop(
            lambda c: c[0] < x[0, 0],
            lambda c: (
                c[0] + 1,
                c[1] + jax.lax.all_gather(c[1], "model", tiled=True)[:8],
            ),
            (jnp.float32(0), x),
        )[1]
        both = ("data", "model")
        branched = jax.lax.cond(
            x[0, 0] > 0,
            # Both branches typed as varying, as the cond's type check asks.
            lambda v: jax.lax.pcast(jax.lax.psum(v * 2, both), both, to="varying"),
            lambda v: v,
            x,
        )
        return (entry + scanned + looped + branched).sum()

    found = collectives(_compile(mesh, per_device), mesh)
    places = sorted((c.kind, c.axes, c.place, c.trips) for c in found)
    assert places == [
        ("all-gather", ("model",), "loop", (None,)),
        ("all-reduce", ("data",), "loop", (3,)),
        ("all-reduce", ("data", "model"), "branch", ()),
        ("all-reduce", ("model",), "entry", ()),
    ]


def test_groups_written_over_named_mesh_axes(mesh):
    """A shard_map manual over `data` only: XLA writes the gather over
    `model` as ``replica_groups=mesh[...], device_ids=(...) {axis}``."""

    def per_row_block(w, x):
        return (x @ reshard(w, P())).sum(keepdims=True)

    mapped = jax.shard_map(
        per_row_block,
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
        axis_names={"data"},
    )
    w = jax.ShapeDtypeStruct(
        (16, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))
    )
    x = jax.ShapeDtypeStruct(
        (8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(mapped).lower(w, x).compile()
    assert "replica_groups=mesh[" in compiled.as_text()
    (gather,) = collectives(compiled, mesh)
    assert gather.kind == "all-gather"
    assert (gather.operand_nbytes, gather.nbytes) == (16 * 8 * 4, 16 * 32 * 4)
    assert (gather.groups, gather.group_size, gather.axes) == (
        MODEL_GROUPS,
        4,
        ("model",),
    )


def test_axes_need_a_mesh_and_whole_axes(mesh):
    def per_device(x):
        # Device 0 -> 1 only along `model`: a pair, not the whole axis.
        half = jax.lax.ppermute(x, "model", [(0, 1)])
        return (half + jax.lax.psum(x, "data")).sum()

    compiled = _compile(mesh, per_device)
    by_kind = {c.kind: c for c in collectives(compiled, mesh)}
    assert by_kind["collective-permute"].axes is None
    assert by_kind["collective-permute"].group_size == 2
    assert by_kind["all-reduce"].axes == ("data",)
    assert {c.axes for c in collectives(compiled)} == {None}
    assert collectives(compiled.as_text(), mesh) == collectives(compiled, mesh)


# The text forms XLA writes on GPU and TPU: iota device groups, async
# start / done pairs (the done's shape is the result), an async wrapper's
# called computation, no groups written (all devices) and groups of one.
_HLO = """\
HloModule probe, entry_computation_layout={(f32[8,8]{1,0})->f32[]}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (p: f32[8,8]) -> f32[2,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%p), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[8,8]) -> f32[] {
  %x = f32[8,8]{1,0} parameter(0)
  %ag-start = (f32[8,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %ag-done = f32[16,8]{1,0} all-gather-done(%ag-start)
  %ar-start = f32[8,8]{1,0} all-reduce-start(%x), channel_id=2, replica_groups={}, to_apply=%add
  %ar-done = f32[8,8]{1,0} all-reduce-done(%ar-start)
  %single = f32[8,8]{1,0} all-reduce(%x), channel_id=3, replica_groups=[8,1]<=[8], to_apply=%add
  %named = f32[8,32]{1,0} all-gather(%x), channel_id=4, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={1}
  %identity = f32[8,8]{1,0} all-reduce(%x), channel_id=6, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
  %rs-start = ((f32[8,8]{1,0}), f32[2,8]{1,0}) async-start(%x), calls=%wrapped_reduce_scatter
  %rs-done = f32[2,8]{1,0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  ROOT %out = f32[] constant(0)
}
"""  # noqa: E501 - HLO as XLA writes it


def test_text_forms_of_other_backends(mesh):
    found = collectives(_HLO, mesh)
    assert found == [
        Collective(
            kind="reduce-scatter",
            name="rs",
            shapes=("f32[2,8]",),
            nbytes=64,
            operand_nbytes=256,
            groups=MODEL_GROUPS,
            group_size=4,
            axes=("model",),
            place="entry",
            trips=(),
        ),
        Collective(
            kind="all-gather",
            name="ag-start",
            shapes=("f32[16,8]",),
            nbytes=512,
            operand_nbytes=256,
            groups=DATA_GROUPS,
            group_size=2,
            axes=("data",),
            place="entry",
            trips=(),
        ),
        Collective(
            kind="all-reduce",
            name="ar-start",
            shapes=("f32[8,8]",),
            nbytes=256,
            operand_nbytes=256,
            groups=(tuple(range(8)),),
            group_size=8,
            axes=("data", "model"),
            place="entry",
            trips=(),
        ),
        Collective(
            kind="all-gather",
            name="named",
            shapes=("f32[8,32]",),
            nbytes=1024,
            operand_nbytes=256,
            groups=MODEL_GROUPS,
            group_size=4,
            axes=("model",),
            place="entry",
            trips=(),
        ),
        Collective(
            kind="all-reduce",
            name="identity",
            shapes=("f32[8,8]",),
            nbytes=256,
            operand_nbytes=256,
            groups=DATA_GROUPS,
            group_size=2,
            axes=("data",),
            place="entry",
            trips=(),
        ),
    ]


def test_unreadable_groups_are_an_error_not_a_guess():
    text = _HLO.replace("replica_groups={}", "replica_groups=<some new form>")
    with pytest.raises(ValueError, match="form it cannot read"):
        collectives(text)


def test_unknown_element_type_is_named():
    text = _HLO.replace("%single = f32[8,8]", "%single = q7[8,8]")
    text = text.replace("[8,1]<=[8]", "[2,4]<=[8]")
    with pytest.raises(ValueError, match="unknown HLO element type 'q7'"):
        collectives(text)


# --- the reference configuration of benchmarks/bench_scale.py, 64 devices ---


@pytest.mark.slow  # compiles at scale (64 emulated devices)
def test_reference_configuration_on_64_devices(tmp_path):
    """The 0.81B-param reference of benchmarks/bench_scale.py, compiled for a
    ``data`` 8 x ``model`` 8 mesh in a process of its own (this one has 8
    devices): the plain path all-gathers nothing and holds fewer
    temporaries than optax's."""
    plain, reference = "ga.MultiSteps + jax.grad", "optax.MultiSteps + jax.grad"
    results = compiled_reference(tmp_path, reference, plain)
    assert results[plain]["mesh"] == {"data": 8, "model": 8}
    assert results[plain]["params"] == 2 * 24 * 2048 * 8192
    for path in (reference, plain):
        assert "error" not in results[path], results[path]
        kinds = {c["kind"] for c in results[path]["collectives"]}
        assert "all-gather" not in kinds, path
        # The gradients' all-reduce over `data`, once per layer of the scan.
        assert any(
            c["axes"] == ["data"] and c["trips"] == [24]
            for c in results[path]["collectives"]
        ), path
    assert results[plain]["micro_step"].get("all-gather", 0) == 0
    assert results[plain]["temp_bytes"] < results[reference]["temp_bytes"]


# --- step_traffic: every call, once per window ------------------------------


def _window_step(mesh, local: bool):
    """A k = 4 MultiSteps micro-step on ``mesh``, compiled: its gradient
    from `local_value_and_grad` (terms, ``unreduced_axes="data"``) or from
    ``jax.grad`` of the batch mean (all-reduced by XLA)."""
    import optax  # noqa: PLC0415

    import gradaccum_jax as ga  # noqa: PLC0415

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    with jax.set_mesh(mesh):
        opt = ga.MultiSteps(optax.sgd(0.1), 4, unreduced_axes="data" if local else ())
        grad_fn = ga.local_value_and_grad(loss, "data") if local else None

        def step(w, state, x):
            grads = grad_fn(w, x)[1] if local else jax.grad(loss)(w, x)
            updates, state = opt.update(grads, state, w)
            return optax.apply_updates(w, updates), state

        w = jnp.zeros((16, 8))
        x = jax.device_put(jnp.ones((32, 16)), P("data"))
        return jax.jit(step).lower(w, jax.jit(opt.init)(w), x).compile()


def test_step_traffic_tells_once_per_window_from_every_micro_step(mesh):
    from gradaccum_jax.measure import step_traffic  # noqa: PLC0415

    once = step_traffic(_window_step(mesh, local=True), mesh, "data")
    assert once.once_per_window
    assert once.every_call == {} and once.gathers == ()
    assert once.per_window == {("data",): 16 * 8 * 4 + 4}  # the window, its weight
    every = step_traffic(_window_step(mesh, local=False), mesh, "data")
    assert not every.once_per_window
    assert [c.kind for c in every.every_call_over_summed] == ["all-reduce"]
    assert every.every_call == {("data",): 16 * 8 * 4}
    # The same program read for a summed axis it does not cross.
    assert step_traffic(_window_step(mesh, local=False), mesh, "model").once_per_window


def _bench_scale():
    """``benchmarks/bench_scale.py`` as a module."""
    import importlib.util  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from helpers import REPO  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location(
        "bench_scale", REPO / "benchmarks" / "bench_scale.py"
    )
    bench_scale = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec.loader.exec_module(bench_scale)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return bench_scale


def test_bench_scale_tells_host_memory_apart_by_the_compiled_shardings():
    """XLA:CPU counts a ``pinned_host`` buffer in ``memory_analysis()`` like
    any other: `bench_scale.py` reads which bytes a device keeps in host
    memory from the shardings, each buffer once (a donated argument and
    the output that aliases it)."""
    bench_scale = _bench_scale()
    mesh = jax.make_mesh((8,), ("data",))
    on_device = NamedSharding(mesh, P("data"))
    on_host = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=on_device)
    y = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=on_host)
    step = jax.jit(
        lambda x, y: (x * 2, y + 1),
        out_shardings=(on_device, on_host),
        donate_argnums=1,
    )
    compiled = step.lower(x, y).compile()
    shard = 64 * 128 * 4 // 8
    assert bench_scale._host_bytes(compiled, (x, y)) == shard
    assert bench_scale._host_bytes(compiled, (x, x)) == shard  # the output's
    device_only = jax.jit(lambda x: x * 2).lower(x).compile()
    assert bench_scale._host_bytes(device_only, (x,)) == 0


def test_bench_scale_counts_the_fragment_a_diloco_sync_brings_over():
    """XLA:CPU computes on the host buffers, so `bench_scale.py` adds what a
    sync brings to the device: the largest fragment's share of the outer
    state in host memory (its outer state's share of the outer states)."""
    bench_scale = _bench_scale()
    params = {"a": jnp.zeros((300, 4)), "b": jnp.zeros((100, 4))}
    opt = ga.diloco(optax.sgd(0.1), 4, fragments=2, offload_outer_state=True)
    state = jax.eval_shape(opt.init, params)
    assert bench_scale._sync_host_bytes(state, 8000) == 6000  # 300 of 400 rows
    assert bench_scale._sync_host_bytes(state, 0) == 0
    assert bench_scale._sync_host_bytes(optax.EmptyState(), 8000) == 0
