"""Bad configuration fails at construction with a ValueError that names the
argument and the accepted range (docs/architecture.md, "Errors").

One table row per (public constructor, argument, bad value). A row passes
when constructing with that one bad argument (all others valid) raises a
ValueError whose message contains the argument's name in backticks, a
description of the accepted values, and nothing is deferred to ``init`` or
to XLA. `test_table_covers_every_argument_of_every_constructor` keeps the
table complete as the API grows.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga
from helpers import public_names, public_object


def _loss(params, batch):
    return jnp.sum(params * batch)


# Valid arguments for every public constructor, named as `public_names`
# names it (``extend.float_accumulator``); each row changes one of them.
VALID: dict[str, dict[str, Any]] = {
    "MultiSteps": {"opt": optax.sgd(0.1), "every_k_schedule": 2},
    "accumulate": {"opt": optax.sgd(0.1), "every_k": 2},
    "extend.float_accumulator": {"dtype": jnp.float32},
    "clip_by_global_norm": {"max_norm": 1.0},
    "clip": {"max_delta": 1.0},
    "average_across_devices": {"axis_name": "devices"},
    "ternary_quantize": {"x": np.ones(4, np.float32)},
    "ternarize": {"seed": 0},
    "ternary_accumulate": {"opt": optax.sgd(0.1), "every_k": 2},
    "ternary_average_across_devices": {"axis_name": "devices", "seed": 0},
    "ternary_window_reduction": {"seed": 0},
    "compressed_average_across_devices": {
        "axis_name": "devices",
        "codec": ga.codecs.topk(0.01),
    },
    "compressed_window_reduction": {"codec": ga.codecs.powersgd(2)},
    "codecs.ternary": {},
    "codecs.quantized": {},
    "codecs.topk": {"density": 0.01},
    "codecs.powersgd": {"rank": 4},
    "microbatched_value_and_grad": {"loss_fn": _loss, "num_microbatches": 2},
    "local_value_and_grad": {"loss_fn": _loss, "axis_name": "data"},
    "adaptive_every_k": {"micro_batch_size": 16, "k_min": 2, "k_max": 8},
    "diloco": {"inner": optax.adam(1e-3), "sync_every": 4, "axis_name": "data"},
    "worker_value_and_grad": {"loss_fn": _loss, "axis_name": "data"},
}

# Arguments that are inputs, not configuration.
INPUTS = {("ternary_quantize", "x"), ("ternary_quantize", "key")}

# Public callables that are not constructors (their arguments are inputs).
NOT_CONSTRUCTORS = {
    "global_norm",
    "ternary_dequantize",
    "measure.state_nbytes",
    "measure.all_reduce_nbytes",
    "measure.all_reduces",
    "measure.collectives",
    "measure.step_traffic",  # its bad arguments: test below
    "state_shardings",  # its bad arguments: test below
    "stack_workers",
    "anchor_params",
    "extend.made_after",  # a codec's helper on its own arrays, when traced
    # optax's own functions, re-exported with optax's signatures.
    "skip_not_finite",
    "skip_large_updates",
}

# What the message must say about the accepted values.
INTEGER_GE_1 = r"integer >= 1"
INTEGER_GE_0 = r"integer >= 0|integer in \[0,"
SEED_RANGE = r"(integer >= 0|integer in \[0,).*(2\*\*32|4294967295)"
POSITIVE_FINITE = r"positive finite"
FLOAT_DTYPE = r"floating dtype"
AXIS_NAME = r"non-empty string"
CODE_SUM_LIMIT = r"<= 32767"
WINDOW_RANGE = r"integer in \[1, 2147483647\]"
BOOL = r"a bool"
CALLABLE = r"callable"
TRANSFORMATION = r"GradientTransformation"
ACCUMULATOR = r"WindowAccumulator"
MESH_AXES = r"mesh-axis name or a sequence of distinct"
DECAY = r"number in \[0, 1\)"
ESTIMATOR = r"one of 'sampled', 'all'"

NAN, INF = math.nan, math.inf

# A `WindowStatistic` to put in the wrong place.
STATISTIC = ga.extend.WindowStatistic(*[lambda *a: None] * 5)


class Row(NamedTuple):
    constructor: str
    argument: str
    bad_values: tuple[Any, ...]
    accepted: str  # regex the message must match


def _rows_for(constructors, argument, bad_values, accepted):
    return [Row(c, argument, tuple(bad_values), accepted) for c in constructors]


ACCUMULATORS = ("MultiSteps", "accumulate", "ternary_accumulate")
TERNARY = (
    "ternarize",
    "ternary_accumulate",
    "ternary_average_across_devices",
    "ternary_window_reduction",
)
BAD_COUNTS = (0, -3, 2.5, 2.0, True, "4", None)
COMPRESSED = ("compressed_average_across_devices", "compressed_window_reduction")
CODECS = ("codecs.ternary", "codecs.quantized", "codecs.topk", "codecs.powersgd")

TABLE: list[Row] = [
    # Accumulation windows.
    Row("MultiSteps", "every_k_schedule", BAD_COUNTS + (np.int64(0),), INTEGER_GE_1),
    Row("accumulate", "every_k", BAD_COUNTS, INTEGER_GE_1),
    # The window's counters are int32: 2**40 used to fail later, in `update`.
    *_rows_for(("MultiSteps",), "every_k_schedule", (2**31, 2**40), WINDOW_RANGE),
    Row("accumulate", "every_k", (2**31, 2**40), WINDOW_RANGE),
    Row("ternary_accumulate", "every_k", BAD_COUNTS, INTEGER_GE_1),
    Row("ternary_accumulate", "every_k", (32768, 10**6), CODE_SUM_LIMIT),
    Row("ternary_accumulate", "max_every_k", (0, -1, 2.5, "8"), INTEGER_GE_1),
    Row("ternary_accumulate", "max_every_k", (32768,), CODE_SUM_LIMIT),
    Row("microbatched_value_and_grad", "num_microbatches", BAD_COUNTS, INTEGER_GE_1),
    # Accumulator dtypes. None is rejected: optax's convention for
    # `dtype=None` is "the params' dtype", but jnp.dtype(None) is float64,
    # which would silently mean float32 here.
    *_rows_for(
        ("MultiSteps", "accumulate", "microbatched_value_and_grad"),
        "accumulator_dtype",
        (jnp.int32, jnp.int8, jnp.bool_, jnp.complex64, "no-such-dtype", None),
        FLOAT_DTYPE,
    ),
    Row(
        "extend.float_accumulator",
        "dtype",
        (jnp.int32, jnp.bool_, jnp.complex64, "no-such-dtype", None),
        FLOAT_DTYPE,
    ),
    # Clipping thresholds.
    Row(
        "clip_by_global_norm",
        "max_norm",
        (0.0, -1.0, NAN, INF, -INF, "1.0", None, True),
        POSITIVE_FINITE,
    ),
    Row(
        "clip",
        "max_delta",
        (0.0, -1.0, NAN, INF, "1.0", None, True),
        POSITIVE_FINITE,
    ),
    *_rows_for(
        ("ternary_quantize", *TERNARY),
        "clip_sigma",
        (0.0, -2.5, NAN, INF, "2.5", True),
        POSITIVE_FINITE,
    ),
    # Ternary configuration.
    *_rows_for(TERNARY, "min_size", (-1, 2.5, "256", None, True), INTEGER_GE_0),
    *_rows_for(TERNARY, "seed", (-1, 1.5, "0", None, True), INTEGER_GE_0),
    # jax.random.key keeps only 32 bits without jax_enable_x64: seed 2**32
    # gives seed 0's key (silently), 2**64 overflows in `init`.
    *_rows_for(TERNARY, "seed", (2**32, 2**64), SEED_RANGE),
    # Axis names.
    *_rows_for(
        ("average_across_devices", "ternary_average_across_devices"),
        "axis_name",
        ("", None, 3, (), ("devices", ""), ["devices"]),
        AXIS_NAME,
    ),
    Row("local_value_and_grad", "axis_name", ("", None, 3, ("data",)), AXIS_NAME),
    # Mesh axes over which gradients arrive unreduced.
    *_rows_for(
        ("MultiSteps", "accumulate", "extend.float_accumulator", "ternary_accumulate"),
        "unreduced_axes",
        ("", None, 3, ("data", "data"), ("data", ""), ("data", 1)),
        MESH_AXES,
    ),
    # Each device's ternary window is stacked on one mesh axis.
    Row("ternary_accumulate", "unreduced_axes", (("data", "model"),), r"one mesh axis"),
    # The wrapped optimizer: a transformation, not its factory.
    *_rows_for(ACCUMULATORS, "opt", (None, optax.adam, "adam"), TRANSFORMATION),
    Row("MultiSteps", "window_accumulator", ("float32", (1, 2)), ACCUMULATOR),
    *_rows_for(
        ACCUMULATORS, "window_reduction", ("ternary", (1, 2), 3), r"WindowReduction"
    ),
    # A codec, or the device mean built on one, says how a codec goes in.
    *_rows_for(
        ACCUMULATORS,
        "window_reduction",
        (
            ga.codecs.topk(0.01),
            ga.compressed_average_across_devices("data", ga.codecs.topk(0.01)),
        ),
        r"compressed_window_reduction\(codec\) for a codec of "
        r"gradaccum_jax.codecs\), got",
    ),
    # More window statistics: named ones, not a sequence or one bare.
    *_rows_for(
        ACCUMULATORS,
        "statistics",
        (
            "noise",
            (1, 2),
            [STATISTIC],
            STATISTIC,
            {"": STATISTIC},
            {3: STATISTIC},
            {"norm": 3},
        ),
        r"`statistics` must be a mapping of names \(non-empty strings\) to "
        r"WindowStatistic",
    ),
    # A window reduction needs per-device terms: without `unreduced_axes`
    # there are none (a ternary window too: each device's decoded window is
    # what a reduction sums).
    *_rows_for(
        ACCUMULATORS,
        "window_reduction",
        (ga.ternary_window_reduction(seed=0),),
        r"needs `unreduced_axes`",
    ),
    # Flags: a string such as "False" is truthy; only bools are accepted.
    # The accumulation entry points share one vocabulary.
    *_rows_for(ACCUMULATORS, "use_grad_mean", ("False", None), BOOL),
    *_rows_for(ACCUMULATORS, "count_skipped", ("False", None), BOOL),
    *_rows_for(ACCUMULATORS, "skip_nonfinite", ("False", None), BOOL),
    Row("accumulate", "average", ("False",), BOOL),
    Row("ternarize", "stochastic", ("False", None), BOOL),
    *_rows_for(
        ("ternarize", "ternary_average_across_devices"),
        "error_feedback",
        ("False", None),
        BOOL,
    ),
    Row("microbatched_value_and_grad", "has_aux", ("False", None), BOOL),
    Row("local_value_and_grad", "has_weight", ("False", None), BOOL),
    Row("local_value_and_grad", "has_aux", ("True", 1), BOOL),
    # Callables.
    *_rows_for(
        ACCUMULATORS,
        "should_skip_update_fn",
        (3, "skip_not_finite"),
        CALLABLE,
    ),
    Row("microbatched_value_and_grad", "loss_fn", (3, None), CALLABLE),
    Row("local_value_and_grad", "loss_fn", (3, None), CALLABLE),
    Row("microbatched_value_and_grad", "weight_fn", (3, "mask"), CALLABLE),
    # Micro-batching: the PRNG key's slot and the data-parallel layout.
    Row(
        "microbatched_value_and_grad",
        "key_argnum",
        (0, 1, -1, True, 2.5, "", "not a name", ("key",)),
        r"integer >= 2.*identifier",
    ),
    Row(
        "microbatched_value_and_grad",
        "batch_argnums",
        (0, -1, True, 1.5, "1", (), (1, 0), [1, 2]),
        r"a position >= 1 \(the params are 0\)",
    ),
    Row("microbatched_value_and_grad", "batch_argnums", ((1, 2, 1),), r"twice"),
    Row("microbatched_value_and_grad", "data_axis", ("", 3, ("data",)), AXIS_NAME),
    Row("microbatched_value_and_grad", "gather_params_once", ("True", None), BOOL),
    Row("microbatched_value_and_grad", "unreduced_grads", ("True", None), BOOL),
    # Unreduced over which axis: it needs `data_axis`.
    Row("microbatched_value_and_grad", "unreduced_grads", (True,), r"data_axis"),
    # The gradient noise scale.
    *_rows_for(ACCUMULATORS, "track_noise_scale", ("True", None, 1), BOOL),
    *_rows_for(
        ACCUMULATORS, "noise_scale_decay", (1.0, -0.1, NAN, INF, "0.9", None), DECAY
    ),
    # One micro-batch's norm per window, or every one's; nothing else.
    *_rows_for(
        ACCUMULATORS,
        "noise_scale_estimator",
        ("mean", "", "Sampled", "ALL", None, 1, True, ("sampled",)),
        ESTIMATOR,
    ),
    Row("microbatched_value_and_grad", "return_noise_scale", ("True", None), BOOL),
    # A ternary window cannot measure the noise scale without bias.
    Row("ternary_accumulate", "track_noise_scale", (True,), r"track_noise_scale=False"),
    Row(
        "ternary_accumulate",
        "every_k",
        (ga.adaptive_every_k(1, 2, 8),),
        r"an int or callable every_k",
    ),
    Row(
        "adaptive_every_k",
        "micro_batch_size",
        (0, -1.0, NAN, INF, "16", None, True),
        POSITIVE_FINITE,
    ),
    Row("adaptive_every_k", "k_min", BAD_COUNTS, INTEGER_GE_1),
    Row("adaptive_every_k", "k_max", BAD_COUNTS, INTEGER_GE_1),
    # k_max below k_min.
    Row("adaptive_every_k", "k_max", (1,), r"integer >= k_min \(2\)"),
    Row(
        "adaptive_every_k", "axis_name", ("", 3, (), ("data", ""), ["data"]), AXIS_NAME
    ),
    # DiLoCo.
    Row("diloco", "inner", (None, optax.adam, "adam"), TRANSFORMATION),
    Row("diloco", "outer", (optax.sgd, "sgd", 0.7), TRANSFORMATION),
    Row("diloco", "sync_every", BAD_COUNTS, INTEGER_GE_1),
    Row("diloco", "sync_every", (2**31,), WINDOW_RANGE),
    Row("diloco", "axis_name", ("", 3, (), ("data", ""), ["data"]), AXIS_NAME),
    Row(
        "diloco",
        "outer_reduction",
        ("ternary", 3, ga.ternary_average_across_devices),
        TRANSFORMATION,
    ),
    Row(
        "diloco",
        "outer_reduction",
        (ga.codecs.topk(0.01), ga.compressed_window_reduction(ga.codecs.topk(0.01))),
        r"compressed_average_across_devices\('data', codec\) for a codec of "
        r"gradaccum_jax.codecs, got",
    ),
    Row("diloco", "fragments", BAD_COUNTS, INTEGER_GE_1),
    # Each fragment syncs at its own step of the 4-step cycle.
    Row("diloco", "fragments", (5, 100), r"integer in \[1, sync_every\] = \[1, 4\]"),
    Row(
        "diloco",
        "fragment_axis",
        ("layers", -1, 1.5, True, {"layers": "0"}, [0, -2]),
        r"None .* integer >= 0 .* pytree prefix of the params",
    ),
    Row(
        "diloco",
        "keep_unsent",
        (-0.1, 1.01, NAN, INF, "0.5", True, None),
        r"number in \[0, 1\]",
    ),
    Row("diloco", "offload_outer_state", ("False", None, 1), BOOL),
    Row("worker_value_and_grad", "loss_fn", (3, None), CALLABLE),
    Row("worker_value_and_grad", "axis_name", ("", None, 3, ("data",)), AXIS_NAME),
    Row("worker_value_and_grad", "has_aux", ("False", None), BOOL),
    # Compression codecs and where they plug in.
    *_rows_for(
        COMPRESSED,
        "codec",
        ("topk", None, ga.codecs.topk, ga.ternary_window_reduction(0)),
        r"must be a Codec",
    ),
    *_rows_for(COMPRESSED, "seed", (-1, 1.5, "0", None, True), INTEGER_GE_0),
    *_rows_for(COMPRESSED, "seed", (2**32,), SEED_RANGE),
    *_rows_for(COMPRESSED, "error_feedback", ("False", None), BOOL),
    *_rows_for(
        COMPRESSED,
        "residual_dtype",
        (jnp.float16, jnp.int8),
        r"must be jnp.float32 or jnp.bfloat16|floating dtype",
    ),
    *_rows_for(COMPRESSED, "residual_dtype", (None, "f32x"), "floating dtype"),
    Row(
        "compressed_average_across_devices",
        "axis_name",
        ("", None, 3, (), ["devices"]),
        AXIS_NAME,
    ),
    *_rows_for(CODECS, "min_size", (-1, 2.5, "256", None, True), INTEGER_GE_0),
    Row("codecs.ternary", "clip_sigma", (0.0, -2.5, NAN, INF, "2.5"), POSITIVE_FINITE),
    Row(
        "codecs.ternary",
        "rounding",
        ("nearby", "", 1, True),
        r"one of 'stochastic', 'nearest'",
    ),
    Row(
        "codecs.quantized",
        "bits",
        (2, 16, 32, 8.0, "8", True, None),
        r"must be 8 or 4, got",
    ),
    Row(
        "codecs.topk",
        "density",
        (0, 0.0, -0.1, 1.01, NAN, INF, "0.01", True, None),
        r"number in \(0, 1\]",
    ),
    Row(
        "codecs.topk",
        "bits",
        (0, 3, 16, 64, 2.0, "2", True, None),
        r"must be 1, 2, 4, 8 or 32, got",
    ),
    Row(
        "codecs.topk",
        "collective",
        ("all-gather", "psum", "", None, 1, True),
        r"one of 'all_gather', 'reduce_scatter'",
    ),
    Row(
        "codecs.topk",
        "owner_density",
        (0, 0.0, -0.1, 1.01, NAN, INF, "0.1", True),
        r"number in \(0, 1\]",
    ),
    Row("codecs.powersgd", "rank", BAD_COUNTS, INTEGER_GE_1),
    Row(
        "codecs.powersgd",
        "warmup",
        (-1, 2.5, "5", None, True, 2**32),
        INTEGER_GE_0,
    ),
    Row("codecs.powersgd", "scanned", ("False", None, 0), BOOL),
]


def _cases():
    for row in TABLE:
        for bad in row.bad_values:
            label = getattr(bad, "__name__", None) or repr(bad)
            name = re.sub(r"\W+", "_", label).strip("_")[:24]
            yield pytest.param(row, bad, id=f"{row.constructor}-{row.argument}-{name}")


@pytest.mark.parametrize(("row", "bad"), list(_cases()))
def test_bad_argument_raises_value_error_naming_it_and_its_range(row, bad):
    constructor = public_object(row.constructor)
    call = f"gradaccum_jax.{row.constructor}({row.argument}={bad!r})"
    try:
        constructor(**{**VALID[row.constructor], row.argument: bad})
    except ValueError as error:
        message = str(error)
    except Exception as error:  # e.g. AttributeError from deep inside
        pytest.fail(
            f"{call} raised {type(error).__name__} instead of ValueError: {error}"
        )
    else:
        pytest.fail(f"{call} was accepted at construction")
    assert f"`{row.argument}`" in message, (call, message)
    assert re.search(row.accepted, message), (call, row.accepted, message)


def test_valid_arguments_construct():
    for name, kwargs in VALID.items():
        built = public_object(name)(**kwargs)
        if name == "ternary_quantize":
            codes, scale = built
            assert (codes.dtype, scale.dtype) == (jnp.int8, jnp.float32)
        elif name == "extend.float_accumulator":
            assert isinstance(built, ga.extend.WindowAccumulator)
        elif name in ("ternary_window_reduction", "compressed_window_reduction"):
            assert isinstance(built, ga.extend.WindowReduction)
        elif name.startswith("codecs."):
            assert isinstance(built, ga.extend.Codec)
        elif name == "adaptive_every_k":
            assert isinstance(built, ga.AdaptiveWindow)
        elif name in (
            "microbatched_value_and_grad",
            "local_value_and_grad",
            "worker_value_and_grad",
        ):
            assert callable(built) and not hasattr(built, "init"), name
        else:  # a transformation (MultiSteps is one with methods)
            assert callable(built.init) and callable(built.update), name


def _public_callables() -> set[str]:
    names = set()
    for name in public_names():
        value = public_object(name)
        if not callable(value):
            continue
        if inspect.isclass(value) and name != "MultiSteps":
            continue  # states, NamedTuples, type aliases
        names.add(name)
    return names


def test_table_covers_every_argument_of_every_constructor():
    constructors = _public_callables() - NOT_CONSTRUCTORS
    assert constructors == set(VALID), (
        "a public name was added or removed: give it a row per argument, or "
        f"list it in NOT_CONSTRUCTORS: {constructors ^ set(VALID)}"
    )
    covered = {(row.constructor, row.argument) for row in TABLE} | INPUTS
    missing = []
    for name in sorted(constructors):
        for parameter in inspect.signature(public_object(name)).parameters:
            if (name, parameter) not in covered:
                missing.append(f"{name}({parameter}=...)")
    assert not missing, f"no bad-value row for {missing}"


def test_the_readers_of_shardings_and_traffic_name_their_bad_arguments():
    tx = ga.MultiSteps(optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"state_shardings: `mesh` must be a jax"):
        ga.state_shardings(tx, {"w": np.zeros(2)}, mesh="data")
    with pytest.raises(ValueError, match=r"state_shardings: `mesh` .* jax.set_mesh"):
        ga.state_shardings(tx, {"w": np.zeros(2)})  # no mesh set
    with pytest.raises(ValueError, match=r"`summed_axes` must be a " + MESH_AXES):
        ga.measure.step_traffic(None, None, summed_axes="")


@pytest.mark.parametrize("name", ["MultiSteps", "accumulate", "ternary_accumulate"])
def test_skip_nonfinite_and_a_skip_function_together_are_rejected(name):
    with pytest.raises(ValueError) as error:
        getattr(ga, name)(
            **VALID[name],
            skip_nonfinite=True,
            should_skip_update_fn=ga.skip_large_updates,
        )
    assert str(error.value).startswith(
        "`skip_nonfinite=True` is shorthand for "
        "`should_skip_update_fn=skip_not_finite`: pass one of them, not both"
    )


def test_accumulate_average_is_a_deprecated_alias_of_use_grad_mean():
    with pytest.warns(DeprecationWarning, match="use use_grad_mean"):
        tx = ga.accumulate(optax.sgd(1.0), 2, average=False)
    state = tx.init({"a": jnp.zeros(())})
    for g in (1.0, 2.0):
        updates, state = tx.update({"a": jnp.float32(g)}, state)
    assert float(updates["a"]) == -3.0  # the sum, not the mean


@pytest.mark.parametrize(
    "noise_scale",
    [
        {"track_noise_scale": True},
        {"every_k": ga.adaptive_every_k(1, 2, 8)},
        {"every_k": ga.adaptive_every_k(1, 2, 8), "track_noise_scale": True},
    ],
    ids=["track_noise_scale", "adaptive_every_k", "both"],
)
def test_a_statistic_named_as_the_noise_scale_it_keeps_is_rejected(noise_scale):
    with pytest.raises(ValueError) as error:
        ga.accumulate(
            **{**VALID["accumulate"], **noise_scale},
            statistics={"noise_scale": STATISTIC, "mine": STATISTIC},
        )
    # An adaptive window's noise scale is the one kept (with its axis_name).
    asks = "`every_k`" if "every_k" in noise_scale else "`track_noise_scale=True`"
    assert str(error.value) == (
        "`statistics` names 'noise_scale', the name of a statistic the "
        f"accumulator keeps itself ({asks} asks for it): give yours "
        "another name."
    )
