"""Tests for microbatched_value_and_grad.

Every numerical test compares against ``jax.value_and_grad`` on the full
batch (or, for keys, against a hand-written loop over the strided
micro-batches), with and without jit.
"""

import functools
import re
import warnings

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradaccum_jax
from gradaccum_jax import microbatched_value_and_grad
from helpers import EAGER_AND_JIT, scan_carries

BATCH, IN_DIM, CLASSES = 16, 5, 3


# Test data comes from numpy: every eager jax op compiles on first use, and
# those compilations, not the tests, would dominate the run time.
def make_params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((IN_DIM, CLASSES)).astype(dtype)),
        "b": jnp.asarray(rng.standard_normal((CLASSES,)).astype(dtype)),
    }


def make_batch(batch=BATCH, dtype=jnp.float32):
    rng = np.random.default_rng(1)
    return {
        "x": jnp.asarray(rng.standard_normal((batch, IN_DIM)).astype(dtype)),
        "y": jnp.asarray(rng.integers(0, CLASSES, (batch,)).astype(np.int32)),
    }


def strided_microbatch(batch, index, num_microbatches):
    """Micro-batch ``index``: examples index, index + m, index + 2m, ..."""
    return jax.tree.map(lambda leaf: np.asarray(leaf)[index::num_microbatches], batch)


def per_example_loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def mean_loss(params, batch):
    return jnp.mean(per_example_loss(params, batch))


def masked_mean_loss(params, batch):
    # Deliberately the naive masked mean: a micro-batch without valid
    # examples gives 0 / 0 = NaN, which weight 0 must drop.
    mask = batch["mask"]
    return jnp.sum(per_example_loss(params, batch) * mask) / jnp.sum(mask)


# The full-batch references, jitted once: eager value_and_grad compiles every
# primitive on its own, which dominates a small test's run time.
full_mean_loss = jax.jit(jax.value_and_grad(mean_loss))
full_masked_mean_loss = jax.jit(jax.value_and_grad(masked_mean_loss))


def valid_count(microbatch):
    return jnp.sum(microbatch["mask"])


# With the strided split, micro-batch i of 4 holds examples i, i+4, i+8, i+12,
# so this mask gives micro-batches 3, 2, 0 and 4 valid examples.
UNEVEN_MASK = np.array(
    [1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1], dtype=np.float32
)


def close(actual, expected, atol=1e-6, rtol=1e-5):
    chex.assert_trees_all_close(actual, expected, atol=atol, rtol=rtol)


class TestMatchesFullBatch:
    # Eagerly only once: without jit every primitive outside the scan
    # compiles on its own, which costs seconds per case.
    @pytest.mark.parametrize(
        "num_microbatches, use_jit", [(1, True), (4, True), (16, True), (4, False)]
    )
    def test_mean_loss(self, num_microbatches, use_jit):
        params, batch = make_params(), make_batch()
        fn = microbatched_value_and_grad(mean_loss, num_microbatches)
        fn = jax.jit(fn) if use_jit else fn
        close(fn(params, batch), full_mean_loss(params, batch))

    @EAGER_AND_JIT
    def test_masked_weighted_is_big_batch_masked_mean(self, compile_fn):
        params, batch = make_params(), make_batch()
        batch["mask"] = UNEVEN_MASK
        fn = compile_fn(
            microbatched_value_and_grad(masked_mean_loss, 4, weight_fn=valid_count)
        )
        loss, grads = fn(params, batch)
        expected_loss, expected_grads = full_masked_mean_loss(params, batch)
        close((loss, grads), (expected_loss, expected_grads))
        assert np.isfinite(float(loss))

    def test_unweighted_mean_of_means_differs_when_counts_differ(self):
        # The gradient-accumulation loss bug the weights fix: without them,
        # micro-batches with few valid examples count as much as full ones.
        params, batch = make_params(), make_batch()
        batch["mask"] = UNEVEN_MASK.copy()
        batch["mask"][2] = 1.0  # counts 3, 2, 1, 4
        unweighted = microbatched_value_and_grad(masked_mean_loss, 4)
        loss, _ = unweighted(params, batch)
        expected, _ = full_masked_mean_loss(params, batch)
        assert abs(float(loss) - float(expected)) > 1e-3

    def test_aux_is_weighted_mean(self):
        def loss_with_aux(params, batch):
            losses = per_example_loss(params, batch)
            mask = batch["mask"]
            logits = batch["x"] @ params["w"] + params["b"]
            correct = (jnp.argmax(logits, -1) == batch["y"]) * mask
            aux = {
                "accuracy": jnp.sum(correct) / jnp.sum(mask),
                "max_logit": jnp.max(logits).astype(jnp.bfloat16),
            }
            return jnp.sum(losses * mask) / jnp.sum(mask), aux

        params, batch = make_params(), make_batch()
        batch["mask"] = UNEVEN_MASK
        fn = jax.jit(
            microbatched_value_and_grad(
                loss_with_aux, 4, has_aux=True, weight_fn=valid_count
            )
        )
        (loss, aux), grads = fn(params, batch)
        (expected_loss, expected_aux), expected_grads = jax.value_and_grad(
            loss_with_aux, has_aux=True
        )(params, batch)
        close((loss, grads), (expected_loss, expected_grads))
        close(aux["accuracy"], expected_aux["accuracy"])
        # A max is not a mean: the aux max comes back as the weighted mean
        # of the micro-batch maxima, in the aux leaf's dtype.
        assert aux["max_logit"].dtype == jnp.bfloat16
        assert float(aux["max_logit"]) <= float(expected_aux["max_logit"])

    @pytest.mark.parametrize(
        "count_of",
        [lambda batch: jnp.sum(batch["y"] >= 0), lambda batch: batch["y"].shape[0]],
        ids=["int-array", "python-int"],
    )
    def test_integer_aux_is_averaged_in_accumulator_dtype(self, count_of):
        # Python scalars in aux are arrays, as jax.value_and_grad takes them:
        # a Python float averages to float32 (a weak type), an int as an
        # integer array does.
        def loss_with_count(params, batch):
            return mean_loss(params, batch), {"n": count_of(batch), "half": 0.5}

        fn = microbatched_value_and_grad(loss_with_count, 4, has_aux=True)
        (_, aux), _ = jax.jit(fn)(make_params(), make_batch())
        chex.assert_trees_all_equal(
            aux, {"n": jnp.float32(BATCH / 4), "half": jnp.float32(0.5)}
        )
        chex.assert_trees_all_equal_dtypes(
            aux, {"n": jnp.float32(0), "half": jnp.float32(0)}
        )

    def test_extra_arguments_are_passed_to_every_microbatch(self):
        def scaled_loss(params, batch, scale, *, offset=0.0):
            return scale * mean_loss(params, batch) + offset

        params, batch = make_params(), make_batch()
        fn = microbatched_value_and_grad(scaled_loss, 4)
        close(
            fn(params, batch, 2.0, offset=1.0),
            jax.value_and_grad(scaled_loss)(params, batch, 2.0, offset=1.0),
        )
        assert fn.__name__ == "scaled_loss"


def dropout_loss(params, batch, key=None):
    logits = batch["x"] @ params["w"] + params["b"]
    if key is not None:
        keep = jax.random.bernoulli(key, 0.5, logits.shape)
        logits = jnp.where(keep, logits * 2.0, 0.0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.mean(losses)


# Jitted once: compiled once per micro-batch shape, not once per call.
full_dropout_loss = jax.jit(jax.value_and_grad(dropout_loss))


def manual_key_reference(params, batch, key, num_microbatches):
    """Mean over the strided micro-batches, micro-batch i with fold_in(key, i)."""
    results = [
        full_dropout_loss(
            params,
            strided_microbatch(batch, i, num_microbatches),
            key=jax.random.fold_in(key, i),
        )
        for i in range(num_microbatches)
    ]
    return jax.tree.map(lambda *leaves: sum(leaves) / num_microbatches, *results)


class TestKeys:
    def test_each_microbatch_gets_fold_in_key(self):
        params, batch = make_params(), make_batch()
        key = jax.random.PRNGKey(42)
        fn = jax.jit(microbatched_value_and_grad(dropout_loss, 4, key_argnum="key"))
        expected = manual_key_reference(params, batch, key, 4)
        close(fn(params, batch, key=key), expected)

    def test_positional_and_typed_keys(self):
        params, batch = make_params(), make_batch()
        fn = microbatched_value_and_grad(dropout_loss, 4, key_argnum="key")
        key = jax.random.PRNGKey(7)
        expected = manual_key_reference(params, batch, key, 4)
        close(jax.jit(fn)(params, batch, key), expected)
        typed_key = jax.random.key(7)
        expected_typed = manual_key_reference(params, batch, typed_key, 4)
        close(fn(params, batch, key=typed_key), expected_typed)

    def test_keyword_only_key_and_no_key(self):
        def loss_kw_only(params, batch, *, key):
            return dropout_loss(params, batch, key=key)

        params, batch = make_params(), make_batch()
        key = jax.random.PRNGKey(3)
        fn = jax.jit(microbatched_value_and_grad(loss_kw_only, 4, key_argnum="key"))
        close(fn(params, batch, key=key), manual_key_reference(params, batch, key, 4))
        # A key-taking loss called without a key runs deterministically.
        fn = microbatched_value_and_grad(dropout_loss, 4, key_argnum=2)
        close(jax.jit(fn)(params, batch), full_mean_loss(params, batch))

    @pytest.mark.parametrize("key_argnum", [2, "key"])
    def test_loss_wrapped_without_functools_wraps_gets_distinct_keys(self, key_argnum):
        def wrapped(*args, **kwargs):  # hides dropout_loss's signature
            return dropout_loss(*args, **kwargs)

        params, batch = make_params(), make_batch()
        key = jax.random.PRNGKey(5)
        expected = manual_key_reference(params, batch, key, 4)
        fn = jax.jit(microbatched_value_and_grad(wrapped, 4, key_argnum=key_argnum))
        if key_argnum == 2:
            close(fn(params, batch, key), expected)
        else:
            close(fn(params, batch, key=key), expected)
        # Without key_argnum the key is invisible: every micro-batch draws
        # the same mask, a different (wrong) result.
        same_key = jax.jit(microbatched_value_and_grad(wrapped, 4))
        assert not np.allclose(same_key(params, batch, key)[0], expected[0])

    def test_integer_key_argnum_also_finds_the_keyword(self):
        # With an inspectable signature, position 2 is also the name `key`.
        params, batch = make_params(), make_batch()
        key = jax.random.PRNGKey(9)
        fn = jax.jit(microbatched_value_and_grad(dropout_loss, 4, key_argnum=2))
        close(fn(params, batch, key=key), manual_key_reference(params, batch, key, 4))

    def test_key_found_by_name_warns_and_still_folds(self):
        params, batch = make_params(), make_batch()
        key = jax.random.PRNGKey(42)
        with pytest.warns(DeprecationWarning, match=r"pass `key_argnum=`"):
            fn = microbatched_value_and_grad(dropout_loss, 4)
        close(
            jax.jit(fn)(params, batch, key), manual_key_reference(params, batch, key, 4)
        )

    def test_no_warning_with_key_argnum_or_without_key(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            microbatched_value_and_grad(dropout_loss, 4, key_argnum="key")
            microbatched_value_and_grad(dropout_loss, 4, key_argnum=2)
            microbatched_value_and_grad(mean_loss, 4)

    @pytest.mark.parametrize(
        "key_argnum, spelling, message",
        [
            ("key", "positional", r"`key_argnum`='key' names .*Pass it as `key=`"),
            (2, "keyword", r"`key_argnum`=2 is the position.*\['key'\]"),
        ],
        ids=["name-passed-by-position", "position-passed-by-keyword"],
    )
    def test_key_hidden_by_a_wrapper_and_passed_the_other_way(
        self, key_argnum, spelling, message
    ):
        # The wrapper's signature tells neither where `key` sits nor what
        # the argument at position 2 is called: the key may be any extra
        # argument, and using none would give every micro-batch the same one.
        def wrapped(*args, **kwargs):
            return dropout_loss(*args, **kwargs)

        params, batch, key = make_params(), make_batch(), jax.random.PRNGKey(5)
        fn = jax.jit(microbatched_value_and_grad(wrapped, 4, key_argnum=key_argnum))
        with pytest.raises(ValueError, match=message):
            if spelling == "positional":
                fn(params, batch, key)
            else:
                fn(params, batch, key=key)

    @pytest.mark.parametrize("spelling", ["keyword", "positional-only"])
    def test_visible_signature_places_extra_arguments(self, spelling):
        # A signature that shows where the extra arguments go needs no
        # guess: `scale` is no key although the key's position is unknown
        # (it comes by keyword only, through **kwargs), and a positional-only
        # `key` is found by its name.
        def by_keyword(params, batch, scale, **kwargs):
            return scale * dropout_loss(params, batch, **kwargs)

        def positional_only(params, batch, scale, key, /):
            return scale * dropout_loss(params, batch, key)

        params, batch, key = make_params(), make_batch(), jax.random.PRNGKey(5)
        loss = by_keyword if spelling == "keyword" else positional_only
        fn = jax.jit(microbatched_value_and_grad(loss, 4, key_argnum="key"))
        expected = manual_key_reference(params, batch, key, 4)
        if spelling == "keyword":
            close(fn(params, batch, 1.0, key=key), expected)
        else:
            close(fn(params, batch, 1.0, key), expected)

    @pytest.mark.parametrize("bad", [0, 1, -1, True, 2.5, "", "not a name", ["key"]])
    def test_bad_key_argnum(self, bad):
        with pytest.raises(
            ValueError, match=r"`key_argnum` must be None, an integer >= 2"
        ):
            microbatched_value_and_grad(dropout_loss, 4, key_argnum=bad)


def scan_carry_dtypes(fn, *args):
    """The dtypes of the scan carry (the accumulators) in ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    return {var.aval.dtype for var in scan_carries(scan)}


class TestDtypes:
    def test_bf16_params_give_bf16_grads_with_f32_accumulation(self):
        params = make_params(jnp.bfloat16)
        batch = make_batch(dtype=jnp.bfloat16)
        fn = microbatched_value_and_grad(mean_loss, 8)
        loss, grads = jax.jit(fn)(params, batch)
        assert loss.dtype == jax.eval_shape(mean_loss, params, batch).dtype
        chex.assert_trees_all_equal_dtypes(grads, params)
        # The accumulator (the scan carry) is float32.
        assert scan_carry_dtypes(fn, params, batch) == {jnp.dtype(jnp.float32)}
        # Numerically: the f32 mean of the 8 bf16 micro-batch gradients.
        per_microbatch = [
            full_mean_loss(params, strided_microbatch(batch, i, 8))[1] for i in range(8)
        ]
        expected = jax.tree.map(
            lambda *g: (sum(x.astype(jnp.float32) for x in g) / 8).astype(jnp.bfloat16),
            *per_microbatch,
        )
        chex.assert_trees_all_equal(grads, expected)

    def test_accumulator_dtype_is_the_gradients_scan_carry_dtype(self):
        # The gradients' carry is bfloat16; the loss and the total weight
        # are summed in float32.
        fn = microbatched_value_and_grad(mean_loss, 4, accumulator_dtype=jnp.bfloat16)
        carry = scan_carry_dtypes(fn, make_params(), make_batch())
        assert carry == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}

    @EAGER_AND_JIT
    def test_float16_sums_of_many_tokens_do_not_overflow(self, compile_fn):
        # 8 micro-batches of 8192 tokens: a float16 total weight (65536) and
        # weighted loss sum overflow at 65504; the loss came out NaN and the
        # gradient 0.
        def token_loss(params, batch):
            return jnp.sum(batch["mask"] * params["w"] * batch["x"]) / jnp.sum(
                batch["mask"]
            )

        batch = {"x": jnp.ones((8, 8192)), "mask": jnp.ones((8, 8192))}
        fn = microbatched_value_and_grad(
            token_loss,
            8,
            weight_fn=lambda micro_batch: micro_batch["mask"].sum(),
            accumulator_dtype=jnp.float16,
        )
        loss, grads = compile_fn(fn)({"w": jnp.float32(1.0)}, batch)
        chex.assert_trees_all_equal((loss, grads), (jnp.float32(1.0), {"w": 1.0}))

    @EAGER_AND_JIT
    def test_bfloat16_mean_of_512_micro_batches_is_exact(self, compile_fn):
        # A bfloat16 total weight stops growing at 256, the sum of a
        # gradient of 3 moves in steps of 4 past 512 and stops at 1024:
        # the mean came out 4.0. The running mean keeps a constant exactly.
        def loss(params, batch):
            return jnp.mean(params["w"] * batch["x"])

        batch = {"x": jnp.full((512, 1), 3.0)}
        fn = microbatched_value_and_grad(
            loss,
            512,
            weight_fn=lambda micro_batch: micro_batch["x"].shape[0],
            accumulator_dtype=jnp.bfloat16,
        )
        value, grads = compile_fn(fn)({"w": jnp.float32(1.0)}, batch)
        chex.assert_trees_all_equal((value, grads), (jnp.float32(3.0), {"w": 3.0}))

    @pytest.mark.parametrize("accumulator_dtype", [jnp.float32, jnp.bfloat16])
    def test_complex_grads_keep_their_imaginary_part(self, accumulator_dtype):
        # Complex leaves are summed in a complex accumulator (complex64: there
        # is no complex bfloat16), so they equal the big-batch gradient; the
        # real leaves and the loss are summed in accumulator_dtype.
        def complex_loss(params, batch):
            residual = batch["x"] @ params["c"] + params["r"] - batch["y"]
            return jnp.mean(jnp.abs(residual) ** 2)

        rng = np.random.default_rng(5)
        x = rng.standard_normal((BATCH, IN_DIM, 2)).astype(np.float32)
        params = {
            "c": (
                rng.standard_normal(IN_DIM) + 1j * rng.standard_normal(IN_DIM)
            ).astype(np.complex64),
            "r": np.float32(0.5),
        }
        batch = {
            "x": (x[..., 0] + 1j * x[..., 1]).astype(np.complex64),
            "y": x[:, 0, 0],
        }
        fn = microbatched_value_and_grad(
            complex_loss, 4, accumulator_dtype=accumulator_dtype
        )
        carry = scan_carry_dtypes(fn, params, batch)
        # The loss and the total weight are summed in float32.
        assert carry == {
            jnp.dtype(accumulator_dtype),
            jnp.dtype(jnp.complex64),
            jnp.dtype(jnp.float32),
        }
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no complex-to-real cast warning
            loss, grads = jax.jit(fn)(params, batch)
        expected_loss, expected_grads = jax.value_and_grad(complex_loss)(params, batch)
        chex.assert_trees_all_equal_dtypes(grads, expected_grads)
        close(grads["c"], expected_grads["c"], atol=1e-5)
        atol = 1e-5 if accumulator_dtype == jnp.float32 else 5e-2
        close((loss, grads["r"]), (expected_loss, expected_grads["r"]), atol=atol)

    def test_bf16_loss_keeps_its_dtype(self):
        def bf16_loss(params, batch):
            return mean_loss(params, batch).astype(jnp.bfloat16)

        loss, grads = microbatched_value_and_grad(bf16_loss, 4)(
            make_params(), make_batch()
        )
        assert loss.dtype == jnp.bfloat16
        chex.assert_trees_all_equal_dtypes(grads, make_params())


class TestZeroWeight:
    @EAGER_AND_JIT
    def test_zero_total_weight_gives_zeros(self, compile_fn):
        def loss_with_aux(params, batch):
            return masked_mean_loss(params, batch), {"n": jnp.sum(batch["mask"])}

        params, batch = make_params(), make_batch()
        batch["mask"] = jnp.zeros((BATCH,))
        fn = compile_fn(
            microbatched_value_and_grad(
                loss_with_aux, 4, has_aux=True, weight_fn=valid_count
            )
        )
        (loss, aux), grads = fn(params, batch)
        chex.assert_trees_all_equal(
            ((loss, aux), grads),
            (
                (jnp.float32(0), {"n": jnp.float32(0)}),
                jax.tree.map(jnp.zeros_like, params),
            ),
        )


NUM_DEVICES = 8
COLLECTIVES = ("psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all")


def replicate(tree):
    return jax.tree.map(
        lambda leaf: jnp.broadcast_to(leaf, (NUM_DEVICES, *leaf.shape)), tree
    )


def per_device(batch):
    return jax.tree.map(
        lambda leaf: leaf.reshape(NUM_DEVICES, -1, *leaf.shape[1:]), batch
    )


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def collectives_in_scan(jaxpr, inside_scan=False):
    """Names of the collective primitives inside any scan body of ``jaxpr``."""
    found = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if inside_scan and name.startswith(COLLECTIVES):
            found.add(name)
        for sub in sub_jaxprs(eqn):
            found |= collectives_in_scan(sub, inside_scan or name == "scan")
    return found


@functools.cache
def pmapped(num_microbatches):
    """pmap of (micro-batched) value_and_grad followed by one pmean."""

    def step(params, batch):
        if num_microbatches:
            grad_fn = microbatched_value_and_grad(mean_loss, num_microbatches)
        else:
            grad_fn = jax.value_and_grad(mean_loss)
        loss, grads = grad_fn(params, batch)
        return jax.lax.pmean((loss, grads), axis_name="devices")

    return jax.pmap(step, axis_name="devices")


class TestAcrossDevices:
    def test_pmean_after_microbatching_is_big_batch(self):
        assert jax.device_count() == NUM_DEVICES, "tests/conftest.py sets 8 devices"
        params, batch = make_params(), make_batch(batch=NUM_DEVICES * 8)
        loss, grads = pmapped(4)(replicate(params), per_device(batch))
        expected = full_mean_loss(params, batch)
        close((loss[0], jax.tree.map(lambda g: g[0], grads)), expected)

    def test_one_reduction_per_step_under_pmap(self):
        # No collective inside the scan, and as many all-reduces as without
        # micro-batching: only the final pmean.
        params, batch = make_params(), make_batch(batch=NUM_DEVICES * 8)
        args = (replicate(params), per_device(batch))
        assert not collectives_in_scan(jax.make_jaxpr(pmapped(4))(*args).jaxpr)

        def all_reduces(num_microbatches):
            return pmapped(num_microbatches).lower(*args).as_text().count("all_reduce")

        assert all_reduces(4) == all_reduces(0) >= 1

    def test_weighted_average_across_devices_is_big_batch_masked_mean(self):
        # 4 examples per device, 2 strided micro-batches per device: device 1
        # sees no valid example at all, and device 2's second micro-batch
        # (examples 1 and 3) is empty, so its naive masked mean is 0 / 0.
        device_masks = [
            [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0],
            [1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1],
        ]  # fmt: skip
        params = make_params()
        batch = make_batch(batch=NUM_DEVICES * 4)
        batch["mask"] = jnp.array(device_masks, jnp.float32).reshape(-1)
        average = gradaccum_jax.average_across_devices("devices")

        def step(params, batch):
            grad_fn = microbatched_value_and_grad(
                masked_mean_loss, 2, weight_fn=valid_count
            )
            # Each device weighs by what it saw: sum_d w_d x_d / sum_d w_d.
            value_and_grads, _ = average.update(
                grad_fn(params, batch), average.init(params), weight=valid_count(batch)
            )
            return value_and_grads

        loss, grads = jax.pmap(step, axis_name="devices")(
            replicate(params), per_device(batch)
        )
        expected = full_masked_mean_loss(params, batch)
        close((loss[0], jax.tree.map(lambda g: g[0], grads)), expected)

    def test_shard_map_with_average_across_devices(self):
        mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
        params, batch = make_params(), make_batch(batch=NUM_DEVICES * 8)
        expected = full_mean_loss(params, batch)
        average = gradaccum_jax.average_across_devices("data")

        def step(params, batch):
            # Varying parameters: each device keeps its own gradient for the
            # one reduction after the scan (invariant ones would make jax.grad
            # psum inside every micro-batch).
            params = jax.lax.pcast(params, "data", to="varying")
            value_and_grads = microbatched_value_and_grad(mean_loss, 4)(params, batch)
            return average.update(value_and_grads, average.init(params))[0]

        sharded_step = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
        )
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
        assert not collectives_in_scan(
            jax.make_jaxpr(sharded_step)(params, batch).jaxpr
        )
        close(jax.jit(sharded_step)(params, batch), expected)

    def test_sharded_batch_under_jit_stays_local(self):
        # The strided split of a batch sharded along its batch axis needs no
        # data movement: no all-gather, all-to-all or permute in the HLO
        # (a contiguous split cannot even be expressed under Explicit mode).
        mesh = jax.make_mesh(
            (NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
        )
        params, batch = make_params(), make_batch(batch=NUM_DEVICES * 8)
        expected = full_mean_loss(params, batch)
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
        compiled = (
            jax.jit(microbatched_value_and_grad(mean_loss, 4))
            .lower(params, batch)
            .compile()
        )
        close(compiled(params, batch), expected)
        hlo = compiled.as_text()
        for collective in ("all-gather", "all-to-all", "collective-permute"):
            assert collective not in hlo


HLO_COLLECTIVE = re.compile(
    r"=\s*(\([^()]*\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all"
    r"|collective-permute)(?:-start)?\("
)


def hlo_collectives(fn, *args):
    """``{"entry" | "loop": [(op, shape), ...]}`` in ``jax.jit(fn)``'s HLO.

    "loop" gathers the collectives of every while body (the scan); a fused
    tuple all-reduce counts once, its shape given as the sorted tuple of its
    parts (XLA picks the order).
    """
    text = jax.jit(fn).lower(*args).compile().as_text()
    computation, entry, bodies, found = None, None, set(), {}
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            computation = header.group(2)
            entry = computation if header.group(1) else entry
            continue
        bodies.update(re.findall(r"body=%?([\w.\-]+)", line))
        match = HLO_COLLECTIVE.search(line)
        if match and computation:
            parts = re.findall(r"\w+\[[\d,]*\](?:\{[\d,]*\})?", match.group(1))
            found.setdefault(computation, []).append((match.group(2), *sorted(parts)))
    places = {"entry": [], "loop": []}
    for name, ops in found.items():
        place = "entry" if name == entry else "loop" if name in bodies else name
        places.setdefault(place, []).extend(ops)
    return places


def all_reduce(*parts):
    """A (fused) all-reduce as `hlo_collectives` lists it."""
    return ("all-reduce", *sorted(parts))


def sharded_masked_batch():
    """8 devices x 4 micro-batches x 2 examples, with a mask that leaves some
    (device, micro-batch) shares empty: their 0/0 NaN loss must drop out."""
    batch = make_batch(batch=NUM_DEVICES * 8)
    mask = np.random.default_rng(2).random(NUM_DEVICES * 8) < 0.6
    # Device d holds rows 8d..8d+7; its micro-batch i holds rows 8d+i, 8d+i+4.
    mask[[0, 4, 8 + 1, 8 + 5]] = False
    batch["mask"] = jnp.asarray(mask.astype(np.float32))
    return batch


def data_mesh(axis_type):
    return jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(axis_type,))


def sharded_grad_fn(**kwargs):
    return microbatched_value_and_grad(
        masked_mean_loss, 4, weight_fn=valid_count, data_axis="data", **kwargs
    )


def gradient_sized(ops):
    """The collectives whose (tuple) shape holds a parameter-sized array."""
    sizes = (f"f32[{IN_DIM},{CLASSES}]", f"f32[{CLASSES},{IN_DIM}]")
    return [op for op in ops if any(p.startswith(sizes) for p in op[1:])]


EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto


class TestDataAxisUnderJit:
    """``data_axis``: device-local accumulation, one reduction per step."""

    @pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO], ids=["explicit", "auto"])
    def test_one_fused_all_reduce_after_the_scan(self, axis_type):
        params, batch = make_params(), sharded_masked_batch()
        expected = full_masked_mean_loss(params, batch)
        with jax.set_mesh(data_mesh(axis_type)):
            params = jax.device_put(params, P())
            batch = jax.device_put(batch, P("data"))
            plain = microbatched_value_and_grad(
                masked_mean_loss, 4, weight_fn=valid_count
            )
            ours = sharded_grad_fn()
            plain_places = hlo_collectives(plain, params, batch)
            places = hlo_collectives(ours, params, batch)
            loss, grads = jax.jit(ours)(params, batch)
        # Without data_axis, XLA reduces the gradient in every micro-batch.
        assert gradient_sized(plain_places["loop"])
        # With it: nothing in the scan, one tuple all-reduce (loss, the two
        # gradient leaves, the total weight) after it.
        assert places["loop"] == []
        assert places["entry"] == [
            all_reduce(
                "f32[]",
                "f32[]",
                f"f32[{CLASSES}]{{0}}",
                f"f32[{IN_DIM},{CLASSES}]{{1,0}}",
            )
        ]
        close((loss, grads), expected)

    def test_unreduced_grads_skip_the_gradient_all_reduce(self):
        params, batch = make_params(), sharded_masked_batch()
        expected = full_masked_mean_loss(params, batch)
        with jax.set_mesh(data_mesh(EXPLICIT)):
            params = jax.device_put(params, P())
            batch = jax.device_put(batch, P("data"))
            fn = sharded_grad_fn(unreduced_grads=True)
            places = hlo_collectives(fn, params, batch)
            loss, grads = jax.jit(fn)(params, batch)
            assert jax.typeof(grads["w"]).sharding.spec.unreduced == {"data"}
            reduced = jax.jit(lambda g: jax.sharding.reshard(g, P()))(grads)
        assert places == {"entry": [("all-reduce", "f32[]", "f32[]")], "loop": []}
        close((loss, reduced), expected)

    @pytest.mark.parametrize(
        "once", [True, False], ids=["gather-once", "per-microbatch"]
    )
    def test_fsdp_params(self, once):
        # w sharded over the data axis on its first dim (IN_DIM * 8 rows so
        # it divides), b replicated.
        params = {
            "w": jnp.asarray(
                np.random.default_rng(3)
                .standard_normal((NUM_DEVICES, CLASSES))
                .astype(np.float32)
            ),
            "b": make_params()["b"],
        }
        batch = sharded_masked_batch()
        batch["x"] = jnp.asarray(
            np.random.default_rng(4)
            .standard_normal((NUM_DEVICES * 8, NUM_DEVICES))
            .astype(np.float32)
        )
        expected = full_masked_mean_loss(params, batch)
        with jax.set_mesh(data_mesh(EXPLICIT)):
            params = {
                "w": jax.device_put(params["w"], P("data", None)),
                "b": jax.device_put(params["b"], P()),
            }
            batch = jax.device_put(batch, P("data"))
            fn = sharded_grad_fn(gather_params_once=once)
            places = hlo_collectives(fn, params, batch)
            loss, grads = jax.jit(fn)(params, batch)
            assert jax.typeof(grads["w"]).sharding.spec == P("data", None)
        w_full = f"f32[{NUM_DEVICES},{CLASSES}]{{1,0}}"
        bias = f"f32[{CLASSES}]{{0}}"
        assert ("all-gather", w_full) in places["entry"]
        if once:
            assert places["loop"] == []
            assert places["entry"] == [
                ("all-gather", w_full),
                all_reduce("f32[]", "f32[]", bias, w_full),
            ]
        else:
            # The weighted gradient of w is reduce-scattered in every
            # micro-batch (XLA hoists the loop-invariant gather on CPU).
            assert places["loop"] == [("reduce-scatter", f"f32[1,{CLASSES}]{{1,0}}")]
            assert places["entry"] == [
                ("all-gather", w_full),
                all_reduce("f32[]", "f32[]", bias),
            ]
        close((loss, grads), expected)

    def test_keys_are_folded_with_the_device_then_the_microbatch(self):
        params, batch = make_params(), make_batch(batch=NUM_DEVICES * 8)
        key = jax.random.PRNGKey(11)
        rows = np.arange(NUM_DEVICES * 8).reshape(NUM_DEVICES, 8)
        results = [
            full_dropout_loss(
                params,
                jax.tree.map(lambda leaf, r=rows[d][i::4]: np.asarray(leaf)[r], batch),
                key=jax.random.fold_in(jax.random.fold_in(key, d), i),
            )
            for d in range(NUM_DEVICES)
            for i in range(4)
        ]
        expected = jax.tree.map(lambda *leaves: sum(leaves) / len(results), *results)
        fn = microbatched_value_and_grad(
            dropout_loss, 4, key_argnum=2, data_axis="data"
        )
        with jax.set_mesh(data_mesh(AUTO)):
            batch = jax.device_put(batch, P("data"))
            close(jax.jit(fn)(jax.device_put(params, P()), batch, key), expected)

    def test_explicit_mesh_splits_a_replicated_batch_and_passes_extra_args(self):
        def scaled_loss(params, batch, scale, square):
            loss = masked_mean_loss(params, batch) * scale
            return loss**2 if square else loss

        params, batch = make_params(), sharded_masked_batch()
        loss, grads = full_masked_mean_loss(params, batch)
        fn = microbatched_value_and_grad(
            scaled_loss, 4, weight_fn=valid_count, data_axis="data"
        )
        with jax.set_mesh(data_mesh(EXPLICIT)):
            result = jax.jit(fn, static_argnums=3)(
                jax.device_put(params, P()), jax.device_put(batch, P()), 3.0, False
            )
        close(result, (3.0 * loss, jax.tree.map(lambda g: 3.0 * g, grads)))

    def test_trace_time_errors(self):
        params, batch = make_params(), make_batch(batch=NUM_DEVICES * 8)
        with pytest.raises(ValueError, match=r"`data_axis`='data' is not an axis"):
            jax.jit(sharded_grad_fn())(params, batch)
        with jax.set_mesh(data_mesh(AUTO)):
            with pytest.raises(
                ValueError, match=r"`unreduced_grads`=True needs .* Explicit"
            ):
                jax.jit(
                    microbatched_value_and_grad(
                        mean_loss, 4, data_axis="data", unreduced_grads=True
                    )
                )(params, batch)
            fn = microbatched_value_and_grad(mean_loss, 16, data_axis="data")
            with pytest.raises(
                ValueError, match=r"`num_microbatches`=16 times the `data_axis` size 8"
            ):
                jax.jit(fn)(params, batch)

    def test_construction_errors(self):
        with pytest.raises(
            ValueError, match=r"`unreduced_grads`=True needs `data_axis`"
        ):
            microbatched_value_and_grad(mean_loss, 4, unreduced_grads=True)
        with pytest.raises(
            ValueError, match=r"`data_axis` must be None or a non-empty string"
        ):
            microbatched_value_and_grad(mean_loss, 4, data_axis="")


class TestErrors:
    @pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4", None])
    def test_bad_num_microbatches(self, bad):
        with pytest.raises(ValueError, match="num_microbatches"):
            microbatched_value_and_grad(mean_loss, bad)

    def test_not_dividing_batch_size(self):
        fn = microbatched_value_and_grad(mean_loss, 3)
        with pytest.raises(ValueError, match=r"num_microbatches.*3.*batch size 16"):
            fn(make_params(), make_batch())
        with pytest.raises(ValueError, match=r"num_microbatches.*batch size 16"):
            jax.jit(fn)(make_params(), make_batch())

    def test_leaves_disagree_on_batch_size(self):
        batch = make_batch()
        batch["y"] = batch["y"][:8]
        with pytest.raises(ValueError, match=r"\['y'\].*8.*\['x'\].*16"):
            microbatched_value_and_grad(mean_loss, 2)(make_params(), batch)

    def test_scalar_batch_leaf(self):
        batch = make_batch()
        batch["temperature"] = jnp.float32(1.0)
        with pytest.raises(ValueError, match=r"\['temperature'\].*scalar"):
            microbatched_value_and_grad(mean_loss, 2)(make_params(), batch)

    @pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, "not a dtype"])
    def test_non_float_accumulator_dtype(self, bad):
        with pytest.raises(ValueError, match="accumulator_dtype"):
            microbatched_value_and_grad(mean_loss, 2, accumulator_dtype=bad)

    def test_loss_fn_and_weight_fn_must_be_callable_and_scalar(self):
        with pytest.raises(ValueError, match="loss_fn"):
            microbatched_value_and_grad("not a function", 2)
        with pytest.raises(ValueError, match="weight_fn"):
            microbatched_value_and_grad(mean_loss, 2, weight_fn=3.0)
        fn = microbatched_value_and_grad(
            mean_loss, 2, weight_fn=lambda microbatch: microbatch["x"]
        )
        with pytest.raises(ValueError, match=r"`weight_fn` must return a scalar"):
            fn(make_params(), make_batch())
