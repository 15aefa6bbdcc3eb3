"""Ternary gradient compression: quantizers, error feedback, an int8
accumulator and a compressed cross-device mean.

A ternary code stores each gradient element as one of {-1, 0, +1} times one
float32 scale per tensor. Two quantizers are provided:

- stochastic (TernGrad; Wen et al., "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017): an unbiased
  randomized rounding, used when the codes are summed (across devices or
  micro-steps), because unbiased errors average out;
- deterministic (TWN; Li & Liu, "Ternary Weight Networks", 2016): a fixed
  threshold, lower variance but biased, used with error feedback.

Error feedback (Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019) keeps the compressor's error in the
state and adds it to the next input, so whatever one step loses is sent by a
later one. It feeds back the *bias* of the compressor, ``x - E[C(x)]``:

- for TWN, which is deterministic, that is the whole error ``x - C(x)``;
- for TernGrad it is the clipping error ``x - clip(x)``: the stochastic
  rounding is unbiased, so its error is zero-mean noise, independent across
  steps, that averages out without help. Feeding the rounding noise back
  as well (the full ``x - C(x)``) re-injects it, and because the residual
  enters the next step's scale, a larger residual makes a larger scale and
  more noise: measured on load_digits (benchmarks/bench_ternary.py's
  setup), data-parallel on 8 devices, the full residual gave 95.5 % test
  accuracy (86 % without clipping) against 97.1 % for float32 and for the
  clipping-error residual. TernGrad's rounding error is not contractive
  (E||C(x) - x||^2 is about ||x||^2 or more), which the convergence theory
  of error feedback requires.

Either way, ``E[sum of sent] + residual = sum of inputs``; for TWN the
identity holds without the expectation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import _checks
from gradaccum_jax._accumulation import MultiSteps, WindowAccumulator

# TWN (Li & Liu 2016): delta = 0.7 * E|x| approximates the threshold that
# minimizes the L2 error of a ternary code for uniform or Gaussian values.
_TWN_THRESHOLD = 0.7

# Leaves with fewer elements than this are left uncompressed by default.
# Below a few hundred elements (biases, LayerNorm scales, the last layer's
# bias) compression saves < 1 KiB per leaf, while one scale shared by so few
# elements makes the quantization noise relatively largest (a bias's few
# entries often differ by orders of magnitude); every compressed leaf also
# costs a scale, a PRNG draw and, with error feedback, a residual. Such
# leaves are a negligible share of a model's bytes, so keeping them exact is
# almost free.
DEFAULT_MIN_SIZE = 256

# Largest every_k each code-sum dtype can hold: a window adds at most one
# code in {-1, 0, 1} per micro-step, so |sum| <= every_k.
_CODE_SUM_DTYPES = ((127, jnp.int8), (32767, jnp.int16))


class TernaryState(NamedTuple):
    """State of `ternarize` and `ternary_average_across_devices`.

    Attributes:
      key: raw uint32 PRNG key data (checkpointable), split on every update.
      residual: float32 compression bias per compressed leaf (the whole error
        for TWN, the clipping error for TernGrad), added to the next step's
        input (error feedback); ``optax.MaskedNode()`` for leaves that keep
        no residual (uncompressed leaves, ``error_feedback=False``, or
        TernGrad without clipping, which is unbiased).
    """

    key: jax.Array
    residual: optax.Updates


class TernaryAccumulatorState(NamedTuple):
    """One window of `ternary_accumulate`, stored in ``MultiStepsState.acc_grads``.

    Attributes:
      key: raw uint32 PRNG key data, split on every micro-step; kept by reset.
      code_sums: per leaf, the window's sum of ternary codes (int8, or int16
        when every_k > 127); for leaves smaller than ``min_size``, the exact
        float32 weighted sum instead.
      scales: per compressed leaf, the window's float32 scale (the running
        maximum of the micro-steps' scales); ``optax.MaskedNode()`` for
        uncompressed leaves. The window's sum is ``code_sums * scales``.
    """

    key: jax.Array
    code_sums: optax.Updates
    scales: optax.Updates


# ---------------------------------------------------------------- quantizers


def _clip_sigma(value: Any) -> float | None:
    """Validates ``clip_sigma``: None (no clipping) or a positive finite float."""
    if value is None:
        return None
    return _checks.positive_finite("clip_sigma", value)


def _max_abs_and_rms(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns max|x| and sqrt(mean(x**2)) of a float32 array.

    The root mean square is computed on x / max|x| so that x**2 cannot
    overflow float32 for large (but finite) gradients.
    """
    max_abs = jnp.max(jnp.abs(x), initial=0.0)
    safe_max = jnp.where(max_abs > 0, max_abs, 1.0)
    rms = max_abs * jnp.sqrt(jnp.mean(jnp.square(x / safe_max)))
    return max_abs, rms


def _clip(x: jax.Array, clip_sigma: float | None) -> jax.Array:
    """TernGrad's gradient clipping to ``clip_sigma`` standard deviations.

    The standard deviation is taken about zero (the root mean square): it is
    the paper's sigma for zero-mean gradients, and unlike the deviation about
    the mean it is not 0 for a constant non-zero tensor (which would
    otherwise be clipped to all zeros).
    """
    if clip_sigma is None:
        return x
    _, rms = _max_abs_and_rms(x)
    bound = clip_sigma * rms
    return jnp.clip(x, -bound, bound)


def _codes_from_uniform(
    x: jax.Array, scale: jax.Array, uniform: jax.Array
) -> jax.Array:
    """Int8 codes with P(code = sign(x)) = |x| / scale, else 0.

    ``uniform`` holds independent U[0, 1) draws shaped like ``x``. Requires
    |x| <= scale. E[code * scale] = x exactly (up to the 2**-23 resolution
    of a float32 uniform draw), and scale = 0 gives all-zero codes.
    """
    safe_scale = jnp.where(scale > 0, scale, 1.0)
    probability = jnp.where(scale > 0, jnp.abs(x) / safe_scale, 0.0)
    return jnp.where(uniform < probability, jnp.sign(x), 0.0).astype(jnp.int8)


def _stochastic_codes(x: jax.Array, scale: jax.Array, key: jax.Array) -> jax.Array:
    """`_codes_from_uniform` with fresh draws from ``key``."""
    return _codes_from_uniform(x, scale, jax.random.uniform(key, x.shape))


def _stochastic_round(x: jax.Array, uniform: jax.Array) -> jax.Array:
    """Rounds to floor(x) or floor(x) + 1 with E[result] = x (float32 out)."""
    low = jnp.floor(x)
    return low + (uniform < x - low)


def _poison_if_nonfinite(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Makes ``scale`` NaN when ``x`` holds any NaN or infinity.

    Every dequantized element is then NaN (0 * NaN = NaN), so a non-finite
    gradient stays visible to e.g. `skip_not_finite` instead of being
    silently rounded to finite codes.
    """
    return jnp.where(jnp.all(jnp.isfinite(x)), scale, jnp.nan)


def ternary_quantize(
    x: jax.Array,
    key: jax.Array | None = None,
    *,
    clip_sigma: float | None = 2.5,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes a tensor to ternary codes and one float32 scale.

    With a ``key``, TernGrad's stochastic ternarization (Wen et al., NeurIPS
    2017): ``x`` is clipped to ``clip_sigma`` standard deviations (taken about
    zero, see below), ``scale = max|clipped x|``, and each code is ``sign(x)``
    with probability ``|clipped x| / scale``, else 0. Hence
    ``E[dequantize(codes, scale)] = clipped x``: exactly unbiased for ``x``
    when ``clip_sigma=None``; clipping trades a small bias on the outliers
    for a smaller scale, hence much less variance on everything else.

    Without a key, TWN's deterministic threshold (Li & Liu, "Ternary Weight
    Networks", 2016): ``delta = 0.7 * mean|x|``, ``codes = sign(x)`` where
    ``|x| > delta`` else 0, and ``scale`` the mean of ``|x|`` over those
    elements (the L2-optimal scale for that support). Biased but
    low-variance; use it with error feedback. ``clip_sigma`` is ignored:
    the threshold is already robust to outliers.

    The standard deviation used for clipping is the root mean square of
    ``x``: the paper's sigma for zero-mean gradients, and never zero for a
    non-zero tensor, so ``clip_sigma >= 1`` never clips a tensor to zeros.

    An all-zero ``x`` gives all-zero codes and scale 0 (no NaN). A ``x``
    holding any NaN or infinity gives ``scale = NaN`` and codes that are
    still valid values in {-1, 0, 1} but carry no meaning: the dequantized
    tensor is all NaN, so the non-finite input stays visible downstream.

    Args:
      x: a floating-point array of any shape (computed in float32).
      key: a PRNG key (typed or raw uint32) for stochastic rounding, or None
        for the deterministic threshold.
      clip_sigma: clip to this many standard deviations before stochastic
        rounding; None disables clipping. Must be > 0.

    Returns:
      ``(codes, scale)``: int8 codes in {-1, 0, 1} shaped like ``x``, and a
      float32 scalar scale; ``ternary_dequantize(codes, scale)`` reconstructs.
    """
    clip_sigma = _clip_sigma(clip_sigma)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"ternary_quantize: `x` must be a floating-point array, got dtype "
            f"{x.dtype.name}; cast it first (x.astype(jnp.float32))."
        )
    x = x.astype(jnp.float32)
    if key is None:
        magnitude = jnp.abs(x)
        support = magnitude > _TWN_THRESHOLD * jnp.mean(magnitude)
        count = jnp.sum(support)
        scale = jnp.sum(jnp.where(support, magnitude, 0.0)) / jnp.maximum(count, 1)
        codes = jnp.where(support, jnp.sign(x), 0.0).astype(jnp.int8)
    else:
        clipped = _clip(x, clip_sigma)
        scale = jnp.max(jnp.abs(clipped), initial=0.0)
        codes = _stochastic_codes(clipped, scale, key)
    return codes, _poison_if_nonfinite(x, scale.astype(jnp.float32))


def ternary_dequantize(
    codes: jax.Array, scale: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """Reconstructs ``codes * scale``, the inverse of `ternary_quantize`.

    Also reconstructs summed codes (e.g. a window's or the devices' sums,
    any integer dtype) against their shared scale.

    Args:
      codes: integer codes (int8 from `ternary_quantize`, or their sums).
      scale: the float32 scale (a scalar, or anything that broadcasts).
      dtype: the floating dtype of the result.

    Returns:
      ``codes * scale`` in ``dtype``.
    """
    product = jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return product.astype(dtype)


# ------------------------------------------------------------------- helpers


def _seed_key(seed: int) -> jax.Array:
    """Raw uint32 key data for ``seed``: plain arrays survive checkpointing."""
    return jax.random.key_data(jax.random.key(seed))


def _split_per_leaf(key: jax.Array, tree: Any) -> tuple[jax.Array, Any]:
    """Returns the next state key and a tree of independent keys, one per leaf."""
    key, step_key = jax.random.split(jax.random.wrap_key_data(key))
    leaves, treedef = jax.tree.flatten(tree)
    leaf_keys = list(jax.random.split(step_key, len(leaves))) if leaves else []
    return jax.random.key_data(key), jax.tree.unflatten(treedef, leaf_keys)


def _is_masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


def _check_updates(updates: Any, template: Any, caller: str) -> None:
    """Raises, naming the leaf, if ``updates`` do not match a state template.

    ``template`` is shaped like the params, with ``optax.MaskedNode()`` at
    leaves whose shape the state does not record.
    """
    _checks.floating_leaves(updates, f"{caller}: updates")
    _checks.same_structure(
        updates,
        template,
        f"{caller}: updates",
        "the parameters the state was initialized with",
        placeholder=_is_masked,
    )


def _unzip(reference: Any, pairs: Any) -> tuple[Any, Any]:
    """Splits a tree of pairs, one per leaf of ``reference``, into two trees.

    Unlike ``jax.tree.transpose`` it allows ``optax.MaskedNode()`` (a node
    with no leaves) in either half.
    """
    first = jax.tree.map(lambda _, pair: pair[0], reference, pairs)
    second = jax.tree.map(lambda _, pair: pair[1], reference, pairs)
    return first, second


def _compressed(leaf: Any, min_size: int) -> bool:
    """Whether a leaf is ternarized (static: from its shape only)."""
    return np.size(leaf) >= max(min_size, 1)


def _keeps_residual(
    error_feedback: bool, stochastic: bool, clip_sigma: float | None
) -> bool:
    """Whether the compressor has a bias to feed back (see the module doc)."""
    return error_feedback and (not stochastic or clip_sigma is not None)


def _residual_init(params: Any, min_size: int, keep_residual: bool) -> Any:
    """Float32 zeros for leaves that keep a residual, MaskedNode elsewhere."""

    def leaf_init(param):
        if keep_residual and _compressed(param, min_size):
            return jnp.zeros(np.shape(param), jnp.float32)
        return optax.MaskedNode()

    return jax.tree.map(leaf_init, params)


def state_nbytes(tree: Any) -> int:
    """Returns the bytes actually held by the array leaves of a pytree.

    Use it to report memory measured on a real state (e.g. an optimizer
    state) rather than computed from a formula. Works on arrays,
    ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``, without
    allocating anything) and PRNG key arrays; non-array leaves (Python
    numbers, None, MaskedNode) count as 0. For an array sharded or
    replicated over several devices, this is the global array's size, i.e.
    ``n_devices`` times one device's copy for a pmapped state.

    Args:
      tree: any pytree, e.g. an optax state.

    Returns:
      The total number of bytes of its array leaves.
    """

    def leaf_nbytes(leaf):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
            return int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize
        return 0

    return sum(leaf_nbytes(leaf) for leaf in jax.tree.leaves(tree))


_HLO_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip
_HLO_ALL_REDUCE = re.compile(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(")
_HLO_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def all_reduce_nbytes(compiled: Any) -> int:
    """Returns the bytes reduced by all all-reduce ops of compiled HLO.

    Counts each all-reduce instruction's buffer once (its result shape,
    equal to its operand shape), per instruction in the text, not per
    execution: an all-reduce inside a loop body counts once. A ring
    all-reduce moves about twice that per device, the same factor for every
    dtype, so ratios between programs are ratios of bytes on the wire.
    Other collectives (all-gather, reduce-scatter) are not counted.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()`` (or ``jax.pmap``), or
        the text of its ``as_text()``.

    Returns:
      The sum over all-reduce ops of the number of bytes of their buffers.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    total = 0
    for match in _HLO_ALL_REDUCE.finditer(text):
        for dtype, dims in _HLO_SHAPE.findall(match.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            if dtype not in _HLO_DTYPE_BYTES:
                raise ValueError(
                    f"all_reduce_nbytes: unknown HLO element type {dtype!r} in "
                    f"{match.group(0)!r}."
                )
            total += size * _HLO_DTYPE_BYTES[dtype]
    return total


# ---------------------------------------------------------------- ternarize


def _common_config(
    seed: Any, clip_sigma: Any, min_size: Any
) -> tuple[int, float | None, int]:
    return (
        _checks.prng_seed("seed", seed),
        _clip_sigma(clip_sigma),
        _checks.nonnegative_int("min_size", min_size),
    )


def ternarize(
    seed: int,
    *,
    stochastic: bool = True,
    clip_sigma: float | None = 2.5,
    error_feedback: bool = True,
    min_size: int = DEFAULT_MIN_SIZE,
) -> optax.GradientTransformation:
    """Replaces each update leaf by its ternary reconstruction.

    Each leaf with at least ``min_size`` elements becomes
    ``ternary_dequantize(*ternary_quantize(x, key, clip_sigma=clip_sigma))``
    (TernGrad's stochastic rounding, Wen et al., NeurIPS 2017, or TWN's
    threshold with ``stochastic=False``), in the update's dtype; smaller
    leaves pass through unchanged.

    With ``error_feedback`` (Karimireddy et al., ICML 2019), ``x`` is the
    update plus the previous residual, and the new residual, kept in
    float32 in the state, is the compressor's bias ``x - E[C(x)]``: the
    whole error ``x - C(x)`` for TWN, the clipping error ``x - clip(x)`` for
    TernGrad, whose rounding noise is unbiased and is not fed back (feeding
    it back costs accuracy, see the module docstring). After T steps
    ``sum(E[sent]) + residual = sum(updates)`` (exactly, without the
    expectation, for TWN): nothing is lost, only delayed. A step with a
    non-finite update sends NaN (see `ternary_quantize`) and leaves the
    residual unchanged, so one bad step does not poison the following ones.

    The PRNG key lives in the state and is split on every update: the
    transformation is pure, and a run is reproducible from ``seed``.

    Args:
      seed: an integer in [0, 2**32 - 1] seeding the stochastic rounding.
      stochastic: TernGrad's unbiased stochastic rounding if True, TWN's
        deterministic threshold if False.
      clip_sigma: TernGrad's clipping, in standard deviations (stochastic
        only); None disables it. Must be > 0.
      error_feedback: keep the compressor's bias and add it to the next
        update (costs one float32 buffer per compressed leaf; none for
        TernGrad with ``clip_sigma=None``, which is unbiased).
      min_size: leaves with fewer elements pass through uncompressed; 0
        compresses everything. Default 256: see ``DEFAULT_MIN_SIZE``.

    Returns:
      An ``optax.GradientTransformation`` with a `TernaryState`.
    """
    seed, clip_sigma, min_size = _common_config(seed, clip_sigma, min_size)
    stochastic = _checks.boolean("stochastic", stochastic)
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    keep_residual = _keeps_residual(error_feedback, stochastic, clip_sigma)

    def init_fn(params):
        return TernaryState(
            _seed_key(seed), _residual_init(params, min_size, keep_residual)
        )

    def update_fn(updates, state, params=None):
        del params
        _check_updates(updates, state.residual, "ternarize")
        key, leaf_keys = _split_per_leaf(state.key, updates)

        def compress(update, residual, leaf_key):
            if not _compressed(update, min_size):
                return update, residual
            x = update.astype(jnp.float32)
            if keep_residual:
                x = x + residual
            if stochastic:
                expected = _clip(x, clip_sigma)  # = E[sent]
                codes, scale = ternary_quantize(expected, leaf_key, clip_sigma=None)
                sent = ternary_dequantize(codes, scale)
            else:
                codes, scale = ternary_quantize(x)
                sent = expected = ternary_dequantize(codes, scale)
            if keep_residual:
                residual = jnp.where(jnp.isfinite(scale), x - expected, residual)
            return sent.astype(update.dtype), residual

        pairs = jax.tree.map(compress, updates, state.residual, leaf_keys)
        sent, residual = _unzip(updates, pairs)
        return sent, TernaryState(key, residual)

    return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------- mean across devices


def _packed_psum(codes: jax.Array, axis: Any, num_devices: int) -> jax.Array:
    """Sums flat int8 ternary codes over ``axis``; returns the int32 sums.

    Each device's code c in {-1, 0, 1} is sent as the digit c + 1 in {0, 1, 2}
    in a bit field of a uint32 word. The sum over n devices of one field is
    at most 2n, so fields of ``bit_length(2n)`` bits never carry into each
    other and one integer psum adds all fields at once, exactly. With 8
    devices that is 6 codes per 4 bytes (5.3 bits per code, 2/3 of an int8
    psum); up to 127 devices it is never more than the 8 bits of an int8
    psum, which would overflow beyond 127 devices anyway.
    """
    bits = (2 * num_devices).bit_length()
    per_word = 32 // bits
    if per_word < 2:  # more than 2**15 devices: plain int32 sums.
        return jax.lax.psum(codes.astype(jnp.int32), axis)
    size = codes.shape[0]
    digits = jnp.pad(codes, (0, -size % per_word)).astype(jnp.int32) + 1
    digits = digits.astype(jnp.uint32).reshape(-1, per_word)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    # The fields are disjoint, so summing them equals OR-ing them.
    words = jnp.sum(digits << shifts, axis=1, dtype=jnp.uint32)
    words = jax.lax.psum(words, axis)
    fields = (words[:, None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return fields.astype(jnp.int32).reshape(-1)[:size] - num_devices


def _device_share(
    weight: Any, axis: Any, num_devices: int, caller: str
) -> tuple[jax.Array, jax.Array]:
    """This device's share of a (weighted) mean, and whether any weight exists.

    ``1 / n`` without a weight; ``weight / psum(weight)`` with one, and 0
    (with ``has_weight`` False) when the total weight is 0.
    """
    if weight is None:
        return jnp.float32(1.0 / num_devices), jnp.bool_(True)
    if np.ndim(weight) != 0:
        raise ValueError(
            f"{caller}: `weight` must be a scalar per device, got shape "
            f"{np.shape(weight)}."
        )
    weight = jnp.asarray(weight, jnp.float32)
    total_weight = jax.lax.psum(weight, axis)
    has_weight = total_weight != 0
    safe_total = jnp.where(has_weight, total_weight, 1.0)
    return jnp.where(has_weight, weight / safe_total, 0.0), has_weight


def _pmax_stacked(values: list[jax.Array], axis: Any) -> list[jax.Array]:
    """pmax of several scalars in one all-reduce."""
    if not values:
        return []
    return list(jax.lax.pmax(jnp.stack(values), axis))


def _psum_codes(
    codes: dict[int, jax.Array], axis: Any, num_devices: int
) -> dict[int, jax.Array]:
    """Sums each leaf's int8 codes over devices in one packed psum."""
    if not codes:
        return {}
    flat = jnp.concatenate([c.reshape(-1) for c in codes.values()])
    sums = _packed_psum(flat, axis, num_devices)
    offsets = np.cumsum([0] + [c.size for c in codes.values()])
    return {
        i: sums[start:stop].reshape(c.shape)
        for (i, c), start, stop in zip(
            codes.items(), offsets[:-1], offsets[1:], strict=True
        )
    }


def ternary_average_across_devices(
    axis_name: str | tuple[str, ...],
    seed: int,
    *,
    error_feedback: bool = True,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
) -> optax.GradientTransformationExtraArgs:
    """The mean of the updates across devices, sent as ternary codes.

    Inside ``jax.pmap`` / ``jax.shard_map`` over ``axis_name``, each device
    computes its share ``x_d = p_d * update_d + residual_d`` of the mean
    (``p_d = 1 / n``, or ``weight_d / sum(weight)`` when ``weight=`` is
    passed), clips it (TernGrad, Wen et al., NeurIPS 2017), and the devices
    agree on one scale per leaf, ``s = pmax(max|clipped x_d|)``. Each device
    then draws TernGrad's unbiased codes against ``s`` with its own key; the
    codes are summed over devices by one integer psum, and the result
    ``sum_d codes_d * s`` is bitwise identical on every device. Its
    expectation is the (weighted) mean of the clipped inputs: exactly the
    mean with ``clip_sigma=None``.

    On the wire: one uint32 word carries several devices' ternary codes as
    bit fields wide enough that the psum cannot carry between them (6 codes
    per word with 8 devices, i.e. 1/6 of a float32 psum; at most 1 byte per
    code up to 127 devices, more beyond), plus one float32 pmax per
    compressed leaf for the scales. Leaves smaller than ``min_size`` are
    averaged in float32.

    With ``error_feedback`` (Karimireddy et al., ICML 2019) each device keeps
    its own residual in float32 for the next step: its clipping error
    ``x_d - clip(x_d)``, the bias of the compressor. The rounding noise is
    unbiased and not fed back (doing so costs accuracy; see the module
    docstring), so ``E[sum of results] + sum_d residual_d`` equals the sum
    over steps of the (weighted) means of the updates, and with
    ``clip_sigma=None`` no residual is kept at all. A non-finite update on
    any device makes that step's
    result NaN on every device and leaves the residuals unchanged. A zero
    total weight gives zeros and leaves the residuals unchanged.

    Args:
      axis_name: the pmap / shard_map axis (or tuple of axes) to average over.
      seed: an integer in [0, 2**32 - 1]; every device starts from the same key
        and folds in its axis index, so the rounding noise is independent
        across devices yet the state is identical everywhere.
      error_feedback: keep each device's clipping error for the next step.
      clip_sigma: TernGrad's clipping in standard deviations of each
        device's share; None disables it. Must be > 0.
      min_size: leaves with fewer elements are averaged in float32.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a `TernaryState`
      whose update accepts an optional scalar ``weight=`` (what this device
      saw, e.g. its number of examples; see DESIGN.md section 1) and ignores
      other extra arguments.
    """
    axis = _checks.axis_name("axis_name", axis_name)
    seed, clip_sigma, min_size = _common_config(seed, clip_sigma, min_size)
    caller = "ternary_average_across_devices"
    error_feedback = _checks.boolean("error_feedback", error_feedback)
    keep_residual = _keeps_residual(error_feedback, True, clip_sigma)

    def init_fn(params):
        return TernaryState(
            _seed_key(seed), _residual_init(params, min_size, keep_residual)
        )

    def update_fn(updates, state, params=None, *, weight=None, **extra_args):
        del params, extra_args
        _check_updates(updates, state.residual, caller)
        num_devices = _checks.bound_axis_size(axis, caller)
        share, has_weight = _device_share(weight, axis, num_devices, caller)
        key, leaf_keys = _split_per_leaf(state.key, updates)
        device_keys = [
            jax.random.fold_in(k, jax.lax.axis_index(axis))
            for k in jax.tree.leaves(leaf_keys)
        ]
        leaves, treedef = jax.tree.flatten(updates)
        residuals = jax.tree.flatten(state.residual, is_leaf=_is_masked)[0]
        means, new_residuals = list(leaves), list(residuals)
        compressed = [i for i, leaf in enumerate(leaves) if _compressed(leaf, min_size)]

        for i, leaf in enumerate(leaves):
            if i not in compressed:
                mean = jax.lax.psum(share * leaf.astype(jnp.float32), axis)
                means[i] = mean.astype(leaf.dtype)

        # This device's share of the mean, plus what it failed to send before.
        inputs = {i: share * leaves[i].astype(jnp.float32) for i in compressed}
        if keep_residual:
            inputs = {i: x + residuals[i] for i, x in inputs.items()}
        clipped = {i: _clip(x, clip_sigma) for i, x in inputs.items()}
        # One pmax for all leaves' scales. A non-finite input is marked +inf,
        # not NaN, because max is guaranteed to propagate inf to every device.
        local_scales = [
            jnp.where(
                jnp.all(jnp.isfinite(inputs[i])), jnp.max(jnp.abs(clipped[i])), jnp.inf
            )
            for i in compressed
        ]
        scales = dict(zip(compressed, _pmax_stacked(local_scales, axis), strict=True))
        codes = {
            i: _stochastic_codes(clipped[i], scales[i], device_keys[i])
            for i in compressed
        }
        code_sums = _psum_codes(codes, axis, num_devices)

        for i in compressed:
            finite = jnp.isfinite(scales[i])
            mean = jnp.where(
                finite, ternary_dequantize(code_sums[i], scales[i]), jnp.nan
            )
            means[i] = jnp.where(has_weight, mean, 0.0).astype(leaves[i].dtype)
            if keep_residual:
                new_residuals[i] = jnp.where(
                    finite & has_weight, inputs[i] - clipped[i], residuals[i]
                )

        residual_treedef = jax.tree.structure(state.residual, is_leaf=_is_masked)
        return (
            jax.tree.unflatten(treedef, means),
            TernaryState(key, jax.tree.unflatten(residual_treedef, new_residuals)),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ------------------------------------------------------------- accumulation


def _code_sum_dtype(max_codes: int) -> Any:
    """The smallest integer dtype that holds a sum of ``max_codes`` codes."""
    for limit, dtype in _CODE_SUM_DTYPES:
        if max_codes <= limit:
            return dtype
    raise ValueError(
        f"ternary_accumulate: `every_k` (or `max_every_k`) must be <= "
        f"{_CODE_SUM_DTYPES[-1][0]} so that a window's code sums fit in int16, "
        f"got {max_codes}. Beyond that an int32 code sum would take as much "
        "memory as a float32 accumulator: use MultiSteps instead."
    )


def _ternary_window_accumulator(
    seed: int,
    clip_sigma: float | None,
    min_size: int = DEFAULT_MIN_SIZE,
    code_sum_dtype: Any = jnp.int8,
) -> WindowAccumulator:
    """A `WindowAccumulator` storing ternary code sums and per-leaf scales.

    Each micro-step's weighted gradient ``v = w * g`` is clipped (TernGrad)
    and the window's scale grows to ``s' = max(s, max|clipped v|)``. When it
    grows, the code sums so far are stochastically rounded to the new scale
    (``S <- round(S * s / s')``, unbiased), then ``v``'s TernGrad codes
    against ``s'`` are added. Every step is unbiased given the past, so
    ``E[total()] = sum_i w_i clip(g_i)`` over the window, exactly
    ``sum_i w_i g_i`` with ``clip_sigma=None``: unlike the average-scale
    trick, a later, larger micro-batch is neither clipped to the first one's
    scale nor mis-weighted. ``|S| <= micro-steps added``, and sums saturate
    at the dtype's range rather than wrap.
    """

    def init(params):
        def code_sum_init(param):
            if _compressed(param, min_size):
                return jnp.zeros(np.shape(param), code_sum_dtype)
            return jnp.zeros(np.shape(param), jnp.float32)

        def scale_init(param):
            if _compressed(param, min_size):
                return jnp.zeros((), jnp.float32)
            return optax.MaskedNode()

        return TernaryAccumulatorState(
            _seed_key(seed),
            jax.tree.map(code_sum_init, params),
            jax.tree.map(scale_init, params),
        )

    def add(acc, grads, weight):
        _checks.floating_leaves(grads, "ternary_accumulate: gradients")
        _checks.same_structure(
            grads, acc.code_sums, "ternary_accumulate: gradients", "the parameters"
        )
        key, leaf_keys = _split_per_leaf(acc.key, grads)
        weight = jnp.asarray(weight, jnp.float32)

        def add_leaf(grad, code_sum, scale, leaf_key):
            value = weight * grad.astype(jnp.float32)
            if _is_masked(scale):
                return code_sum + value, scale
            value = _clip(value, clip_sigma)
            new_scale = _poison_if_nonfinite(
                value, jnp.maximum(scale, jnp.max(jnp.abs(value)))
            )
            ratio = jnp.where(
                new_scale > 0, scale / jnp.where(new_scale > 0, new_scale, 1), 0
            )
            # One draw serves both roundings: random bits dominate the cost of
            # a micro-step on CPU. Each rounding stays unbiased on its own, and
            # mirroring the draw where v > 0 makes the covariance of the two
            # terms <= 0 for either sign of v (the re-rounding adds +1 for
            # small draws, the code +1 for large ones or -1 for small ones),
            # so sharing the draw can only lower the variance of their sum.
            uniform = jax.random.uniform(leaf_key, value.shape)
            kept = _stochastic_round(code_sum.astype(jnp.float32) * ratio, uniform)
            mirrored = jnp.where(value > 0, 1.0 - uniform, uniform)
            new_sum = kept + _codes_from_uniform(value, new_scale, mirrored)
            limit = jnp.iinfo(code_sum_dtype).max
            new_sum = jnp.clip(new_sum, -limit, limit).astype(code_sum_dtype)
            # A NaN scale marks the window as poisoned until reset.
            new_sum = jnp.where(jnp.isfinite(new_scale), new_sum, 0).astype(
                code_sum_dtype
            )
            return new_sum, new_scale

        pairs = jax.tree.map(add_leaf, grads, acc.code_sums, acc.scales, leaf_keys)
        new_acc = TernaryAccumulatorState(key, *_unzip(grads, pairs))
        # A zero weight (a skipped micro-batch) must change nothing, even if
        # its gradients hold NaN (0 * NaN is NaN): a select, not a multiply.
        return jax.tree.map(
            lambda new, old: jnp.where(weight != 0, new, old), new_acc, acc
        )

    def total(acc):
        def leaf_total(code_sum, scale):
            if _is_masked(scale):
                return code_sum
            return ternary_dequantize(code_sum, scale)

        return jax.tree.map(leaf_total, acc.code_sums, acc.scales)

    def reset(acc):
        return TernaryAccumulatorState(
            acc.key,
            jax.tree.map(jnp.zeros_like, acc.code_sums),
            jax.tree.map(jnp.zeros_like, acc.scales),
        )

    return WindowAccumulator(init=init, add=add, total=total, reset=reset)


def ternary_accumulate(
    opt: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], jax.Array],
    *,
    seed: int = 0,
    clip_sigma: float | None = 2.5,
    min_size: int = DEFAULT_MIN_SIZE,
    max_every_k: int | None = None,
    use_grad_mean: bool = True,
    should_skip_update_fn: Callable[..., Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Gradient accumulation with a ternary accumulator (~1 byte per parameter).

    `MultiSteps` whose window sum is stored as integer sums of TernGrad codes
    (Wen et al., NeurIPS 2017) plus one float32 scale per leaf, instead of a
    float32 sum: about a quarter of the accumulator memory (int8 code sums,
    or int16 when a window can exceed 127 micro-steps).

    Guarantee: the emitted gradient is an unbiased estimate of the window's
    (weighted) mean of the clipped micro-batch gradients, exactly unbiased
    for the mean of the gradients with ``clip_sigma=None``. The window's
    scale is the running maximum of the micro-steps' scales; when it grows,
    the code sums so far are stochastically re-rounded to the new scale, so
    no micro-step is clipped to another's scale (the bias of storing codes
    with an average scale). Micro-batch weights (``update(..., weight=w)``)
    are supported: each micro-step ternarizes ``w * g`` against the window's
    scale, so a heavier micro-batch counts more, not more noisily. The
    price of the compression is variance: per element and micro-step at
    most ``s * |w g|`` (TernGrad's), plus ``s**2 / 4`` each time the scale
    grows. Leaves smaller than ``min_size`` accumulate exactly in float32.
    There is no error feedback: its residual would be a float32 buffer the
    size of the parameters, the memory saved here.

    Args:
      opt: the inner optimizer, run once per window.
      every_k: micro-steps per window: an int in [1, 32767], or a function of
        the gradient step as in `MultiSteps`.
      seed: an integer in [0, 2**32 - 1] seeding the stochastic rounding.
      clip_sigma: TernGrad's clipping of each micro-step, in standard
        deviations; None disables it. Must be > 0.
      min_size: leaves with fewer elements accumulate in float32.
      max_every_k: for a callable ``every_k``, the largest window it returns;
        it picks the code-sum dtype (int8 up to 127, else int16). Default
        for callables: 32767 (int16). Code sums saturate, never wrap, if a
        window is longer.
      use_grad_mean: as in `MultiSteps`.
      should_skip_update_fn: as in `MultiSteps`.

    Returns:
      ``MultiSteps(...).gradient_transformation()``; its ``acc_grads`` is a
      `TernaryAccumulatorState`.
    """
    if callable(every_k):
        limit = (
            _CODE_SUM_DTYPES[-1][0]
            if max_every_k is None
            else _checks.positive_int("max_every_k", max_every_k)
        )
    else:
        limit = _checks.positive_int("every_k", every_k)
        if max_every_k is not None:
            limit = max(limit, _checks.positive_int("max_every_k", max_every_k))
    seed, clip_sigma, min_size = _common_config(seed, clip_sigma, min_size)
    accumulator = _ternary_window_accumulator(
        seed, clip_sigma, min_size, _code_sum_dtype(limit)
    )
    return MultiSteps(
        opt,
        every_k,
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        window_accumulator=accumulator,
    ).gradient_transformation()
