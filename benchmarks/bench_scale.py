"""Memory and collectives at scale: every training path, compiled, not run.

Each configuration is compiled for a mesh of emulated CPU devices (64, or
256 for the 70B-class one) from abstract arrays (``jax.ShapeDtypeStruct``
with a ``NamedSharding``): nothing is allocated, nothing runs. The train
step is jitted with params and state donated, on Explicit mesh axes.

Configurations:

* ``reference``: the reference configuration of the scale work: 24 scanned
  residual MLP blocks ``h = h + relu(h @ w1) @ w2``, ``w1`` (24, 2048, 8192)
  sharded ``P(None, None, "model")``, ``w2`` (24, 8192, 2048) sharded
  ``P(None, "model", None)`` (0.81B float32 params), the row-parallel
  product with ``out_sharding`` over ``data``; a micro-batch of 32 rows of
  2048 sharded over ``data``; loss ``mean(h ** 2)``; ``data`` 8 x ``model``
  8.
* ``lm-1b/...``: a decoder-only transformer of about 1B float32 params
  (attention and MLP, scanned layers, bfloat16 compute), on ``data`` x
  ``model`` (8 x 8, tensor parallel), ``data`` x ``fsdp`` (8 x 8, params
  sharded over ``fsdp`` and gathered per layer) and ``dcn`` x ``data`` x
  ``model`` (2 x 4 x 8; DiLoCo's workers are the ``dcn`` slices).
* ``lm-70b``: the same transformer at 80 layers, d_model 8192 (about 65B
  params) on 256 devices, ``data`` 16 x ``model`` 16 (``--skip-70b``
  leaves it out).

Paths, adam inside, k = 8 micro-batches per update (a DiLoCo cycle of 8
steps): ``optax.MultiSteps`` + ``jax.grad``; ``optax.microbatching`` (k
micro-batches in one step, then adam); ``ga.MultiSteps`` + ``jax.grad``;
the documented once-per-window path (``local_value_and_grad`` +
``MultiSteps(unreduced_axes=)``); the same window fed by ``jax.grad`` of
params resharded to ``P(*spec, reduced={"data"})`` (JAX's own types give
gradients unreduced over ``data``); ``microbatched_value_and_grad(
data_axis=)`` (k micro-batches in one step); the ternary window
(``window_reduction=ternary_window_reduction``); ``diloco`` with float32 and
ternary outer gradients, 1 and 4 fragments (blocks of the scanned layers,
``fragment_axis``), on stacked workers (over ``dcn`` where the mesh has
it, else ``data``); the window and DiLoCo (1 fragment) with a codec of
`gradaccum_jax.codecs` (``compressed_window_reduction``,
``compressed_average_across_devices``): top-k at 1 % in 2 bits (all-gathered,
and through the shards' owners: ``collective="reduce_scatter"``), E2M1,
PowerSGD of rank 4; the top-k window with a bfloat16 residual
(``residual_dtype``); DiLoCo with top-k and its outer state in host memory
(``offload_outer_state=True``), 1 and 4 fragments. On request
(``--paths``): the window fed by ``jax.grad`` of reduced params with the
noise scale tracked, or with the ternary window reduction; DiLoCo
keeping half of what top-k did not send; the window and that DiLoCo with
top-k at 50 % in one bit through the owners (chunks sent as maps, 1.6
bits an element).

Reported per device, from the compiled program: the total a device holds
(arguments + outputs + temporaries - aliased, ``memory_analysis()``), the
bytes in host memory (``pinned_host`` in the compiled shardings, which
XLA:CPU's totals count as device memory), what the device's own memory
holds (the total less the host bytes, plus the largest fragment's share
of them that a DiLoCo sync brings over), argument, output and temporary
bytes; every collective
(`gradaccum_jax.measure.collectives`) per micro-step and per window, with
its result bytes on one device, each counted as often as it runs: a
collective inside a loop of known trip count (a scan over layers or over
micro-batches) that many times, one inside a loop of runtime trip count
(the emission of a window, a DiLoCo sync) once per window; and the compile
time. A path that does not compile today is reported with its error class.

Output: a printed table, ``benchmarks/plots/scale.json`` and
``benchmarks/plots/scale.png``.

Run: ``python benchmarks/bench_scale.py [--skip-70b] [--only NAME ...]
[--paths PATH ...]``: 572 s on 2 CPU cores
shared with other jobs (110 compiles); the 65B configuration's 22 compiles
are about a fifth of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _devices
import _headline

HERE = Path(__file__).resolve().parent
K = 8  # micro-batches per update; steps per DiLoCo cycle
PATHS = (
    "optax.MultiSteps + jax.grad",
    "optax.microbatching",
    "ga.MultiSteps + jax.grad",
    "once per window (local_value_and_grad)",
    "once per window (jax.grad of reduced params)",
    "microbatched_value_and_grad(data_axis=)",
    "ternary window",
    "diloco float32, F=1",
    "diloco float32, F=4",
    "diloco ternary, F=1",
    "diloco ternary, F=4",
    "top-k window",
    "top-k reduce-scatter window",
    "E2M1 window",
    "PowerSGD window",
    "top-k window, bfloat16 residual",
    "diloco top-k, F=1",
    "diloco top-k reduce-scatter, F=1",
    "diloco E2M1, F=1",
    "diloco PowerSGD, F=1",
    # `diloco(offload_outer_state=True)`: the anchor, the outer momentum and
    # the top-k residual in host memory; with F=4 a sync brings a quarter of
    # them to the device.
    "diloco top-k, host outer state, F=1",
    "diloco top-k, host outer state, F=4",
)
# The codecs of the "<codec> window" and "diloco <codec>" paths: top-k at
# SparseLoCo's 1 % in 2 bits (its payloads all-gathered, or summed through
# the shards' owners), E2M1 (`quantized(bits=4)`), PowerSGD of rank 4.
# Each is given `gradaccum_jax.codecs`, imported in the worker (after
# XLA_FLAGS is set).
CODECS = {
    "top-k": lambda codecs: codecs.topk(0.01),
    "top-k reduce-scatter": lambda codecs: codecs.topk(
        0.01, collective="reduce_scatter"
    ),
    "E2M1": lambda codecs: codecs.quantized(bits=4),
    "PowerSGD": lambda codecs: codecs.powersgd(4),
    # Only on request (PATHS_ON_REQUEST).
    "top-k 50% 1-bit reduce-scatter": lambda codecs: codecs.topk(
        0.5, bits=1, collective="reduce_scatter"
    ),
}
# Run only when named (--paths): the once-per-window path fed by jax.grad of
# reduced params with the parts that read each device's terms, to see what
# they add to it (the per-device noise-scale norms, the ternary codes).
PATHS_ON_REQUEST = (
    "once per window (jax.grad of reduced params) + noise scale",
    "ternary window (jax.grad of reduced params)",
    # `diloco(keep_unsent=0.5)`: each worker keeps half of what its top-k
    # did not send; what that adds to the sync's memory and collectives.
    "diloco top-k reduce-scatter, keep 0.5, F=1",
    # Top-k at 50 % in one bit through the owners (maps of 1.6 bits an
    # element), the setting that kept the transformer of
    # bench_low_communication.py within 2 % at 1/500 of the bytes.
    "diloco top-k 50% 1-bit reduce-scatter, keep 0.5, F=1",
    "top-k 50% 1-bit reduce-scatter window",
)
# (name, devices, mesh shape, mesh axes)
CONFIGS = (
    ("reference", 64, (8, 8), ("data", "model")),
    ("lm-1b/data x model", 64, (8, 8), ("data", "model")),
    ("lm-1b/data x fsdp", 64, (8, 8), ("data", "fsdp")),
    ("lm-1b/dcn x data x model", 64, (2, 4, 8), ("dcn", "data", "model")),
    ("lm-70b", 256, (16, 16), ("data", "model")),
)
GIB = 2**30
MIB = 2**20


# --- the models (imported in the worker, after XLA_FLAGS is set) ----------


def _models():
    """The model builders; jax is imported here, in the worker process."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from jax.sharding import reshard

    def rows_of(x):
        """``x``'s layout of rows, its other dimensions whole: a spec that
        names only the axes ``x``'s type names (inside a path's shard_map,
        `data` is manual and named by none)."""
        return P(jax.typeof(x).sharding.spec[0], *([None] * (x.ndim - 1)))

    def reference():
        layers, width, hidden, rows = 24, 2048, 8192, 32
        params = {
            "w1": ((layers, width, hidden), P(None, None, "model")),
            "w2": ((layers, hidden, width), P(None, "model", None)),
        }
        batch = (((rows, width), jnp.float32, P("data", None)),)

        def loss(params, x):
            def block(h, weights):
                w1, w2 = weights
                hidden_act = jax.nn.relu(h @ w1)
                # Row-parallel: the product over the `model` shards sums
                # across them; its result is laid out as `h` (over `data`,
                # or per device where a path maps `data` by hand).
                return h + jnp.matmul(hidden_act, w2, out_sharding=rows_of(h)), None

            h, _ = jax.lax.scan(block, x, (params["w1"], params["w2"]))
            return jnp.mean(h**2)

        return params, batch, loss

    def transformer(
        layers, width, heads, hidden, vocab, rows, seq, tp, fsdp, rows_over
    ):
        """A pre-norm decoder: tensor parallel over ``tp``, FSDP over ``fsdp``."""
        bf16 = jnp.bfloat16
        params = {
            "embed": ((vocab, width), P(fsdp, tp)),
            "unembed": ((width, vocab), P(fsdp, tp)),
            "final_norm": ((width,), P()),
            "layers": {
                "norm1": ((layers, width), P()),
                "norm2": ((layers, width), P()),
                "wq": ((layers, width, width), P(None, fsdp, tp)),
                "wk": ((layers, width, width), P(None, fsdp, tp)),
                "wv": ((layers, width, width), P(None, fsdp, tp)),
                "wo": ((layers, width, width), P(None, tp, fsdp)),
                "w1": ((layers, width, hidden), P(None, fsdp, tp)),
                "w2": ((layers, hidden, width), P(None, tp, fsdp)),
            },
        }
        batch = (((rows, seq), jnp.int32, P(rows_over, None)),)

        def use(w, spec):
            # FSDP: a layer's weights are gathered over `fsdp` where used.
            if fsdp is not None:
                w = reshard(w, spec)
            return w.astype(bf16)

        def norm(x, scale):
            x32 = x.astype(jnp.float32)
            x32 = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-6)
            return (x32 * (1 + scale)).astype(bf16)

        def attention(x, w):
            b, s, _ = x.shape
            split = P(rows_of(x)[0], None, tp, None)

            def heads_of(proj):
                y = x @ use(proj, P(None, tp))
                return jnp.reshape(y, (b, s, heads, width // heads), out_sharding=split)

            q, k, v = heads_of(w["wq"]), heads_of(w["wk"]), heads_of(w["wv"])
            logits = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(width / heads)
            causal = jnp.tril(jnp.ones((s, s), bool))
            logits = jnp.where(causal, logits.astype(jnp.float32), -1e9)
            probs = jax.nn.softmax(logits, axis=-1).astype(bf16)
            out = jnp.einsum("bhst,bthd->bshd", probs, v)
            out = jnp.reshape(out, (b, s, width), out_sharding=P(split[0], None, tp))
            return jnp.matmul(out, use(w["wo"], P(tp, None)), out_sharding=rows_of(x))

        def mlp(x, w):
            h = jax.nn.gelu(x @ use(w["w1"], P(None, tp)))
            return jnp.matmul(h, use(w["w2"], P(tp, None)), out_sharding=rows_of(x))

        def loss(params, tokens):
            embed = use(params["embed"], P(None, tp))
            rows = rows_of(tokens)[0]
            x = embed.at[tokens].get(out_sharding=P(rows, None, tp))
            x = reshard(x, P(rows, None, None))

            def block(x, w):
                x = x + attention(norm(x, w["norm1"]), w)
                return x + mlp(norm(x, w["norm2"]), w), None

            x, _ = jax.lax.scan(block, x, params["layers"])
            logits = norm(x, params["final_norm"]) @ use(params["unembed"], P(None, tp))
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            targets = jnp.roll(tokens, -1, axis=1)
            # A one-hot product, not a gather: the vocabulary is sharded.
            hits = targets[..., None] == jnp.arange(logp.shape[-1])
            return -jnp.sum(jnp.where(hits, logp, 0.0)) / targets.size

        return params, batch, loss

    def lm(name):
        if name == "lm-1b/data x model":
            return transformer(
                18, 2048, 16, 8192, 32000, 64, 512, "model", None, "data"
            )
        if name == "lm-1b/data x fsdp":
            return transformer(
                18, 2048, 16, 8192, 32000, 64, 512, None, "fsdp", ("data", "fsdp")
            )
        if name == "lm-1b/dcn x data x model":
            return transformer(
                18, 2048, 16, 8192, 32000, 64, 512, "model", None, ("dcn", "data")
            )
        if name == "lm-70b":
            return transformer(
                80, 8192, 64, 32768, 32000, 32, 1024, "model", None, "data"
            )
        raise ValueError(f"unknown configuration {name!r}")

    return {"reference": reference, "lm": lm}


# --- the paths -------------------------------------------------------------


def _build_path(path, loss, data_axis, workers_axis, fragment_axis, batch_axes):
    """(transformation, step, kind, stacked): kind "micro" (a call is one
    micro-step) or "window" (a call is a whole window of K micro-batches);
    stacked when params and state are DiLoCo's stacked workers.
    ``data_axis``: the axis the once-per-window paths reduce once per window
    (``dcn`` on a multi-slice mesh: the multi-slice recipe reduces over the
    fast ``data`` inside each slice on every micro-step); ``batch_axes``:
    every axis the batch is split over.
    ``fragment_axis``: DiLoCo's, the scanned leaves cut along their layers."""
    import jax
    import optax

    import gradaccum_jax as ga

    adam = optax.adam(1e-3)

    def accumulating(tx, grad_fn):
        def step(params, state, *batch):
            grads = grad_fn(params, *batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return tx, step

    if path == "optax.MultiSteps + jax.grad":
        return (
            *accumulating(optax.MultiSteps(adam, K), jax.grad(loss)),
            "micro",
            False,
        )
    if path == "ga.MultiSteps + jax.grad":
        return (*accumulating(ga.MultiSteps(adam, K), jax.grad(loss)), "micro", False)

    def codec(name):
        return CODECS[name](ga.codecs)

    def coded_window(name):
        return lambda: ga.compressed_window_reduction(codec(name))

    def coded_mean(name):
        return lambda: ga.compressed_average_across_devices(workers_axis, codec(name))

    # The once-per-window paths fed by local_value_and_grad, by the window's
    # reduction (None: the float32 mean).
    window_reductions = {
        "once per window (local_value_and_grad)": lambda: None,
        "ternary window": lambda: ga.ternary_window_reduction(0),
        **{f"{name} window": coded_window(name) for name in CODECS},
        "top-k window, bfloat16 residual": lambda: ga.compressed_window_reduction(
            codec("top-k"), residual_dtype=jax.numpy.bfloat16
        ),
    }
    # DiLoCo's outer reductions, by the word after "diloco" in the path.
    outer_reductions = {
        "float32": lambda: None,
        "ternary": lambda: ga.ternary_average_across_devices(workers_axis, 0),
        **{name: coded_mean(name) for name in CODECS},
    }
    if path in window_reductions:
        tx = ga.MultiSteps(
            adam,
            K,
            unreduced_axes=data_axis,
            window_reduction=window_reductions[path](),
        )
        grad_fn = ga.local_value_and_grad(loss, data_axis)
        return (*accumulating(tx, lambda *a: grad_fn(*a)[1]), "micro", False)
    if "(jax.grad of reduced params)" in path:
        # JAX's own types: params marked `reduced` over the data axis give
        # gradients `unreduced` over it (and laid out as the params).
        from jax.sharding import PartitionSpec as P
        from jax.sharding import reshard

        def marked(leaf, **kinds):
            return reshard(leaf, P(*jax.typeof(leaf).sharding.spec, **kinds))

        # On a multi-slice mesh, reduced over both batch axes (JAX's rule
        # for a product that sums over the rows), the gradients then summed
        # over `data` and unreduced over `dcn` alone.
        slices = data_axis == "dcn"
        reduced_over = set(batch_axes) if slices else {data_axis}

        def grad_fn(params, *batch):
            local = jax.tree.map(lambda p: marked(p, reduced=reduced_over), params)
            grads = jax.grad(loss)(local, *batch)
            if not slices:
                return grads
            return jax.tree.map(lambda g: marked(g, unreduced={data_axis}), grads)

        ternary = path.startswith("ternary window")
        tx = ga.MultiSteps(
            adam,
            K,
            unreduced_axes=data_axis,
            track_noise_scale=path.endswith("+ noise scale"),
            window_reduction=ga.ternary_window_reduction(0) if ternary else None,
        )
        return (*accumulating(tx, grad_fn), "micro", False)
    if path == "optax.microbatching":

        def step(params, state, *batch):
            grads = optax.microbatching.microbatch(
                jax.grad(loss),
                argnums=tuple(range(1, 1 + len(batch))),
                microbatch_size=batch[0].shape[0] // K,
                accumulator=optax.microbatching.AccumulationType.MEAN,
            )(params, *batch)
            updates, state = adam.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return adam, step, "window", False
    if path == "microbatched_value_and_grad(data_axis=)":
        grad_fn = ga.microbatched_value_and_grad(loss, K, data_axis=data_axis)
        return (*accumulating(adam, lambda *a: grad_fn(*a)[1]), "window", False)
    if path.startswith("diloco"):
        reduction = outer_reductions[path.removeprefix("diloco ").split(",")[0]]()
        keep = path.split(", keep ")[1].split(",")[0] if ", keep " in path else 0
        tx = ga.diloco(
            adam,
            K,
            axis_name=workers_axis,
            outer_reduction=reduction,
            fragments=int(path.rsplit("F=", 1)[1]),
            fragment_axis=fragment_axis,
            keep_unsent=float(keep),
            offload_outer_state=", host outer state" in path,
        )
        grad_fn = ga.worker_value_and_grad(loss, workers_axis)
        return (*accumulating(tx, lambda *a: grad_fn(*a)[1]), "micro", True)
    raise ValueError(f"unknown path {path!r}")


# --- measuring one compiled step -------------------------------------------


def _per_micro_and_window(found, kind):
    """Collectives per micro-step and per window: counts by kind, bytes.

    A call is a micro-step ("micro"): what has only loops of known trip
    count runs on every call (that many times), what sits in a loop of
    runtime trip count (the emission, a sync) once per window, K calls. A
    call is a window ("window"): everything runs once per call, each
    collective in the loop over the K micro-batches (the outermost loop of
    K trips) once per micro-batch.
    """
    import numpy as np

    def runs(trips):
        return int(np.prod([t for t in trips if t is not None], dtype=np.int64))

    micro, window = {}, {}
    micro_bytes = window_bytes = 0
    for c in found:
        if kind == "micro":
            every_call = c.place != "branch" and None not in c.trips
            window_bytes += c.nbytes * runs(c.trips) * (K if every_call else 1)
            if every_call:
                micro[c.kind] = micro.get(c.kind, 0) + 1
                micro_bytes += c.nbytes * runs(c.trips)
            else:
                window[c.kind] = window.get(c.kind, 0) + 1
        else:
            window_bytes += c.nbytes * runs(c.trips)
            if c.trips and c.trips[0] == K:
                micro[c.kind] = micro.get(c.kind, 0) + 1
                micro_bytes += c.nbytes * runs(c.trips[1:])
            else:
                window[c.kind] = window.get(c.kind, 0) + 1
    return micro, micro_bytes, window, window_bytes


def _measure(config, path, mesh, spec):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gradaccum_jax.measure import collectives

    params_spec, batch_spec, loss = spec
    axes = mesh.axis_names
    # The slow axis, summed once per window: `dcn` where slices are joined
    # by it (the multi-slice recipe), else `data`. DiLoCo's workers too.
    data_axis = workers_axis = "dcn" if "dcn" in axes else "data"
    batch_axes = tuple(a for a in ("dcn", "data", "fsdp") if a in axes)
    # DiLoCo's fragments are blocks of layers: the scanned leaves (all of
    # the reference's, the transformer's "layers") are cut along axis 0.
    fragment_axis = (
        {name: 0 if name == "layers" else None for name in params_spec}
        if "layers" in params_spec
        else 0
    )
    tx, step, kind, stacked = _build_path(
        path, loss, data_axis, workers_axis, fragment_axis, batch_axes
    )
    rows_factor = K if kind == "window" else 1

    def abstract(shape, dtype, pspec, memory_kind=None):
        sharding = NamedSharding(mesh, pspec, memory_kind=memory_kind)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def stack(leaf):
        n = dict(zip(axes, mesh.devices.shape, strict=True))[workers_axis]
        sharding = leaf.sharding  # None: a scalar, replicated
        pspec = P(workers_axis, *(() if sharding is None else sharding.spec))
        kind = None if sharding is None else sharding.memory_kind
        return abstract((n, *leaf.shape), leaf.dtype, pspec, kind)

    is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)  # noqa: E731
    params = jax.tree.map(
        lambda s: abstract(s[0], jnp.float32, s[1]), params_spec, is_leaf=is_spec
    )
    batch = [
        abstract((shape[0] * rows_factor, *shape[1:]), dtype, pspec)
        for shape, dtype, pspec in batch_spec
    ]
    with jax.set_mesh(mesh):
        # The state as `init` lays it out, memory kinds included: the
        # compiled init's output shardings say them (jax.eval_shape's and a
        # lowering's outputs drop some).
        init = jax.jit(tx.init).lower(params).compile()
        state = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=sharding
            ),
            init.out_info,
            init.output_shardings,
        )
        if stacked:
            params, state = jax.tree.map(stack, (params, state))
        start = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *batch)
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    host = _host_bytes(compiled, (params, state, batch))
    sync_host = _sync_host_bytes(state, host)
    found = collectives(compiled, mesh)
    micro, micro_bytes, window, window_bytes = _per_micro_and_window(found, kind)
    # What crosses `dcn` (the slow network between slices) per window.
    over_dcn = [c for c in found if "dcn" in c.axes]
    dcn_window_bytes = _per_micro_and_window(over_dcn, kind)[3] if over_dcn else 0
    return {
        "config": config,
        "path": path,
        "kind": kind,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        # What a device holds at once: XLA:CPU counts buffers in host
        # memory (`pinned_host`) with the others, so they are told apart
        # by the compiled shardings.
        "total_bytes": total,
        "host_bytes": host,
        # What a DiLoCo sync brings from host memory to the device at once,
        # which XLA:CPU does not count (it computes on the host buffers):
        # the largest fragment's share of the outer state.
        "sync_host_bytes": sync_host,
        # What the device's own memory must hold.
        "device_bytes": total - host + sync_host,
        "micro_step": micro,
        "micro_step_bytes": micro_bytes,
        "window_only": window,
        "window_bytes": window_bytes,
        "dcn_window_bytes": dcn_window_bytes if "dcn" in axes else None,
        "compile_s": seconds,
        # Each collective but its device groups (their size and mesh axes
        # stay): 256 devices' groups would make the file megabytes.
        "collectives": [
            {k: v for k, v in c._asdict().items() if k != "groups"} for c in found
        ],
    }


def _host_bytes(compiled, arguments) -> int:
    """Bytes a device keeps in host memory (``pinned_host``): its shards of
    the arguments (as given) and of the outputs (as compiled) placed there,
    each buffer once (an output aliasing a donated argument is that
    argument)."""
    import jax
    import numpy as np

    def placed(shardings, avals):
        return sum(
            int(np.prod(s.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
            for s, a in zip(shardings, avals, strict=True)
            if getattr(s, "memory_kind", None) == "pinned_host"
        )

    leaves = jax.tree.leaves(arguments)
    outputs = jax.tree.leaves(compiled.out_info)
    return max(
        placed([leaf.sharding for leaf in leaves], leaves),
        placed(jax.tree.leaves(compiled.output_shardings), outputs),
    )


def _sync_host_bytes(state, host: int) -> int:
    """The largest fragment's part of ``host``, the bytes of a `DiLoCoState`
    kept in host memory: each fragment's sync brings its pieces of the
    anchor, outer state and residuals, every one of them over the same
    pieces, so its part is its outer state's share of the outer states'
    bytes. 0 for another state, or nothing in host memory."""
    import jax

    if not host or not hasattr(state, "outer_states"):
        return 0
    sizes = [
        sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(outer))
        for outer in state.outer_states
    ]
    return int(host * max(sizes) / sum(sizes))


def worker(configs, paths, out):
    """Compiles every (configuration, path) for one device count."""
    import jax
    import numpy as np
    from jax.sharding import AxisType

    models = _models()
    results = []
    for name, _, shape, axes in configs:
        mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(axes))
        spec = models["reference"]() if name == "reference" else models["lm"](name)
        params = sum(
            int(np.prod(shape))
            for shape, _ in jax.tree.leaves(
                spec[0], is_leaf=lambda x: isinstance(x, tuple)
            )
        )
        for path in paths:
            start = time.perf_counter()
            try:
                result = _measure(name, path, mesh, spec)
            except Exception as error:  # noqa: BLE001 - reported, not hidden
                result = {
                    "config": name,
                    "path": path,
                    "error": type(error).__name__,
                    "message": str(error).strip().splitlines()[0][:300]
                    if str(error).strip()
                    else traceback.format_exc(limit=1)[-300:],
                    "compile_s": time.perf_counter() - start,
                }
            result["params"] = params
            result["mesh"] = dict(zip(axes, shape, strict=True))
            results.append(result)
            print(_row(result), flush=True)
            jax.clear_caches()
    Path(out).write_text(json.dumps(results, indent=1) + "\n")


# --- the table, the plot ---------------------------------------------------


def _counts(counts):
    short = {
        "all-reduce": "AR",
        "all-gather": "AG",
        "reduce-scatter": "RS",
        "all-to-all": "A2A",
        "collective-permute": "CP",
    }
    return " ".join(f"{short[k]}{n}" for k, n in sorted(counts.items())) or "0"


def _row(r):
    if "error" in r:
        return (
            f"| {r['config']} | {r['path']} | {r['error']} | | | | | | | | | "
            f"| {r['compile_s']:.1f} |"
        )
    return (
        f"| {r['config']} | {r['path']} | {r['total_bytes'] / GIB:.3f} "
        f"| {r['host_bytes'] / GIB:.3f} | {r['device_bytes'] / GIB:.3f} "
        f"| {r['argument_bytes'] / GIB:.3f} "
        f"| {r['output_bytes'] / GIB:.3f} | {r['temp_bytes'] / GIB:.3f} "
        f"| {_counts(r['micro_step'])}, {r['micro_step_bytes'] / MIB:.1f} "
        f"| {_counts(r['window_only'])} | {r['window_bytes'] / MIB:.1f} "
        f"| {_over_dcn(r)} | {r['compile_s']:.1f} |"
    )


def _over_dcn(r):
    """MiB over `dcn` per window, where the mesh has it."""
    dcn = r.get("dcn_window_bytes")
    return "" if dcn is None else f"{dcn / MIB:.1f}"


HEADER = (
    "| configuration | path | total GiB | in host memory GiB "
    "| on the device GiB | arguments GiB | outputs GiB | temporaries GiB "
    "| per micro-step: collectives, MiB | once per window | MiB per window "
    "| MiB over dcn per window | compile s |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--skip-70b", dest="skip_big", action="store_true", help="leave out lm-70b"
    )
    parser.add_argument("--only", nargs="*", help="configuration names to run")
    parser.add_argument(
        "--paths",
        nargs="*",
        default=list(PATHS),
        help="the paths to compile (default: all but PATHS_ON_REQUEST: "
        + "; ".join(PATHS_ON_REQUEST)
        + ")",
    )
    parser.add_argument(
        "--plots",
        default=str(HERE / "plots"),
        help="where scale.json and scale.png go; '' for nowhere",
    )
    parser.add_argument(
        "--no-figure",
        action="store_true",
        help="write scale.json but not scale.png (no matplotlib needed)",
    )
    _headline.add_argument(parser)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = [
        c
        for c in CONFIGS
        if (args.only and c[0] in args.only)
        or (not args.only and not (args.skip_big and c[0] == "lm-70b"))
    ]
    if args.worker:
        worker([c for c in configs if c[1] == args.worker], args.paths, args.out)
        return

    start = time.monotonic()
    results = []
    print(HEADER, flush=True)
    scratch = Path(tempfile.mkdtemp())
    for devices in sorted({c[1] for c in configs}):
        out = scratch / f"scale_{devices}.json"
        # One process per device count. LLVM at -O0 takes about a third
        # less CPU time to compile; memory and collectives are decided
        # before it, by XLA's HLO passes (buffer assignment, SPMD
        # partitioning), and unchanged.
        env = _devices.child_env(devices, "--xla_backend_optimization_level=0")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])]
        )
        command = [
            sys.executable,
            __file__,
            "--worker",
            str(devices),
            "--out",
            str(out),
        ]
        command += ["--paths", *args.paths]
        if args.only:
            command += ["--only", *args.only]
        elif args.skip_big:
            command += ["--skip-70b"]
        subprocess.run(command, check=True, env=env)
        results += json.loads(out.read_text())
        out.unlink()
    for result in results:  # the command that made each row
        result["args"] = sys.argv[1:]
    scratch.rmdir()
    if args.plots:
        plots = Path(args.plots)
        plots.mkdir(parents=True, exist_ok=True)
        saved = plots / "scale.json"
        if saved.exists():
            # The configurations and paths run replace theirs in the saved
            # file, in place; the others' rows stay.
            ran = {(r["config"], r["path"]): r for r in results}
            old = json.loads(saved.read_text())
            seen = {(r["config"], r["path"]) for r in old}
            results = [ran.get((r["config"], r["path"]), r) for r in old] + [
                r for key, r in ran.items() if key not in seen
            ]
        saved.write_text(json.dumps(results, indent=1) + "\n")
    if args.plots and not args.no_figure:
        # Imported here: the figure needs matplotlib (the `examples` extra),
        # the figures do not (tests/test_measure.py runs at the floors).
        import _plots

        where = f"{os.cpu_count()} CPU cores, emulated devices"
        print(f"\nplot: {_plots.scale(results, plots / 'scale.png', where)}")
    print(f"total: {time.monotonic() - start:.0f} s")
    _headline.write(args.json, "bench_scale", headline(results), {"results": results})


# The headline ratios: (name, numerator (path, field), denominator (path,
# field), target the ratio must not exceed), on the reference.
RATIOS = (
    (
        "reference: temporaries, ga.MultiSteps / optax's",
        ("ga.MultiSteps + jax.grad", "temp_bytes"),
        ("optax.MultiSteps + jax.grad", "temp_bytes"),
        1.0,
    ),
    (
        "reference: total, once per window / plain",
        ("once per window (local_value_and_grad)", "total_bytes"),
        ("ga.MultiSteps + jax.grad", "total_bytes"),
        1.05,
    ),
    (
        "reference: temporaries, top-k window / float32 window",
        ("top-k window", "temp_bytes"),
        ("once per window (local_value_and_grad)", "temp_bytes"),
        1.1,
    ),
    *(
        (
            f"reference: temporaries, {codec} window / float32 window",
            (f"{codec} window", "temp_bytes"),
            ("once per window (local_value_and_grad)", "temp_bytes"),
            1.25,
        )
        for codec in ("top-k reduce-scatter", "E2M1", "PowerSGD")
    ),
    (
        "reference: device total, diloco top-k host F=4 / optax's",
        ("diloco top-k, host outer state, F=4", "device_bytes"),
        ("optax.MultiSteps + jax.grad", "total_bytes"),
        1.0,
    ),
)


def headline(results: list[dict]) -> dict[str, tuple[float, float]]:
    """The reference configuration's figures the scale work is judged by."""
    reference = {r["path"]: r for r in results if r["config"] == "reference"}
    figures = {}
    for name, (top_path, top_field), (bottom_path, bottom_field), target in RATIOS:
        top = reference.get(top_path, {}).get(top_field)
        bottom = reference.get(bottom_path, {}).get(bottom_field)
        if top is not None and bottom:
            figures[name] = (top / bottom, target)
    once = reference.get("once per window (local_value_and_grad)", {})
    if "micro_step" in once:
        # The window is reduced once: nothing else needs gathering.
        figures["reference: all-gathers per micro-step, once-per-window path"] = (
            once["micro_step"].get("all-gather", 0),
            0,
        )
    return figures


if __name__ == "__main__":
    main()
