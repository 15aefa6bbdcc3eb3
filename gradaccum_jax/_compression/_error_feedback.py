"""Error feedback: a compressor keeps what it has not sent and sends it later.

Error feedback (Karimireddy et al., "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019) keeps the compressor's error in
the state and adds it to the next input, so whatever one step loses is sent
by a later one: ``E[sum of sent] + residual = sum of inputs``. One
mechanism serves `gradaccum_jax.ternarize` and every codec's mean or window
sum (`gradaccum_jax._codecs._mean`).

What is kept is the compressor's *bias*, ``x - E[C(x)]``: the whole error
``x - C(x)`` of a deterministic compressor (TWN's threshold, nearest codes,
top-k, PowerSGD), only the clipping error ``x - clip(x)`` of TernGrad's
stochastic rounding. Its rounding noise is zero-mean and independent across
steps, so it averages out without help; fed back, it would enter the next
step's scale, and a larger scale makes more noise (on load_digits,
data-parallel on 8 devices, it cost test accuracy; on constant inputs the
running mean drifted away). TernGrad's rounding error is not contractive
(``E|C(x) - x|^2`` is about ``|x|^2`` or more), which the convergence theory
of error feedback requires. A compressor whose sent value is its input in
expectation (TernGrad without clipping) keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import _tree
from gradaccum_jax._compression._leaves import (
    NoResidual,
    keeps_no_array,
    slots,
    with_slots,
)


def keeps_residual(error_feedback: bool, biased: bool) -> bool:
    """Whether a residual is kept: with error feedback, for a compressor
    whose sent value is not its input in expectation."""
    return error_feedback and biased


def residual_init(
    params: Any, coded: Callable[[Any], bool], keep: bool, dtype: Any = jnp.float32
) -> Any:
    """Zeros of ``dtype`` (float32, or bfloat16 to halve the residual's
    bytes) for the leaves that keep a residual (``keep``, and
    ``coded(leaf)``), a `NoResidual` (the leaf's shape, no array) elsewhere."""

    def leaf_init(param):
        if keep and coded(param):
            return _tree.zeros_like(param, dtype)
        return NoResidual(tuple(np.shape(param)))

    return jax.tree.map(leaf_init, params)


def check_grown(
    updates: Any, residual: Any, coded: Callable[[Any], bool], caller: str, coder: str
) -> None:
    """Raises, naming the leaf, if a leaf is coded where the state keeps no
    residual for it: the state was initialized with other params (a small
    leaf that grew past ``min_size`` would have no residual to use)."""
    leaves = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, leaf), slot in zip(leaves, slots(residual), strict=True):
        if coded(leaf) and keeps_no_array(slot):
            raise ValueError(
                f"{caller}: updates leaf {jax.tree_util.keystr(path)} has shape "
                f"{np.shape(leaf)}, which {coder} compresses, but the state was "
                "initialized with a leaf it does not compress there (no "
                "residual): initialize the state with the parameters the "
                "updates come from."
            )


def check_dtype(updates: Any, residual: Any, dtype: Any, caller: str) -> None:
    """Raises, naming the leaf, if a residual is not of ``dtype``: a state
    made (or restored) with another ``residual_dtype``."""
    leaves = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, _), slot in zip(leaves, slots(residual), strict=True):
        if not keeps_no_array(slot) and slot.dtype != dtype:
            raise ValueError(
                f"{caller}: the state's residual for leaf "
                f"{jax.tree_util.keystr(path)} is {slot.dtype}, but "
                f"residual_dtype is {jnp.dtype(dtype).name}: initialize the "
                "state with this transformation, or pass the residual_dtype "
                "it was made with."
            )


def fed_back(
    x: jax.Array,
    sent: jax.Array,
    ok: jax.Array,
    residual: jax.Array,
    bits: jax.Array | None = None,
) -> jax.Array:
    """The residual after sending ``sent`` (``E[C(x)]``) for the input ``x``
    (the update plus the previous residual; ``residual`` shaped like ``x``
    or with leading unit axes): ``x - sent`` where ``ok`` (the
    step sent finite codes, and had weight), else the previous residual, so
    one bad step does not poison the following ones.

    A bfloat16 residual is rounded stochastically with ``bits`` (32 random
    bits per element, `_random.bits`): unbiased, so the rounding errors of
    successive steps average out instead of piling up. Rounded to nearest,
    a steady input rounds the same way every step, and the running mean
    keeps that bias.
    """
    # ``residual`` may be a device's row of a stacked state (leading unit
    # axes): the select reads it in its own shape, so that XLA writes the
    # new residual into its buffer. Read through a reshape, the old
    # residual cannot share the result's buffer, and XLA computes the new
    # one aside and copies it over (a buffer the leaf's size).
    new = jnp.where(
        ok, (x - sent).reshape(residual.shape), residual.astype(jnp.float32)
    )
    if residual.dtype == jnp.float32:
        return new
    if bits is None:  # a caller's mistake, not a user's
        raise TypeError("fed_back: a bfloat16 residual is rounded with `bits`")
    return bfloat16_stochastic(new, bits.reshape(residual.shape))


def bfloat16_stochastic(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to bfloat16 up or down with probabilities that
    make the rounding unbiased: 16 random bits added below the 16 kept,
    then cut (bfloat16 is float32's upper half)."""
    word = jax.lax.bitcast_convert_type(x, jnp.uint32) + (bits >> 16)
    kept = jax.lax.bitcast_convert_type(word & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), kept, x).astype(jnp.bfloat16)


def keeps_a_residual(state: Any) -> bool:
    """Whether a reduction's ``state`` (a `CodecState`, a `TernaryState`)
    keeps an error-feedback residual for some leaf."""
    residual = getattr(state, "residual", None)
    return residual is not None and not all(map(keeps_no_array, slots(residual)))


def take_residual(state: Any, fraction: Any) -> tuple[list[Any], Any]:
    """``fraction`` of each leaf's residual in ``state``, in the devices'
    share units (None for a leaf that keeps none), and ``state`` keeping
    the rest: the two add up to the residual, so nothing unsent is lost."""
    residuals = slots(state.residual)
    taken = [None if keeps_no_array(r) else fraction * r for r in residuals]
    rest = [r if t is None else r - t for r, t in zip(residuals, taken, strict=True)]
    return taken, state._replace(residual=with_slots(state.residual, rest))
