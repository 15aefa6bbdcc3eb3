"""The codec protocol: what a compressed cross-device sum asks of a codec.

A codec turns each device's tensor into what goes over the wire and back
into the cross-device sum, inside a map over the devices (``jax.pmap``,
``jax.shard_map`` or the window's own map over its per-device terms). The
code that plugs a codec in (`_codecs._mean`) does what every codec shares:
the weights and shares of a weighted mean, the leaves too small to compress
(summed exactly in float32, with the total weight, in one all-reduce), the
error-feedback residual, a non-finite device, a zero total weight, and the
state's random counter. A codec only sums what it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._compression import _blocks, _random
from gradaccum_jax._compression._auto_splits import AutoSplits
from gradaccum_jax._compression._leaves import shape_is_compressed


class Wire(NamedTuple):
    """Where a codec runs: the devices it sums over and how its leaves lie.

    Attributes:
      axis: the bound mapped axis (or tuple of axes) the sum runs over.
      num_devices: the number of devices over ``axis``.
      device: int32, this device's index over ``axis``.
      splits: per leaf, how this device's input is a block of a leaf split
        over other manual mesh axes (``_compression._blocks.Split``, ``()``:
        whole). A codec computes what depends on the whole leaf (a scale, a
        Gram matrix) with collectives over those axes and codes the block.
      leaves: per input, its index among all the leaves of the tree (the
        leaf number of its random stream).
      error_feedback: whether the caller keeps ``inputs - sent`` for the
        next call (see `CodecSum.sent`).
      report_sq_excess: whether the caller wants `CodecSum.sq_excess`.
    """

    axis: Any
    num_devices: int
    device: jax.Array
    splits: list[_blocks.Split]
    leaves: tuple[int, ...]
    error_feedback: bool
    report_sq_excess: bool = False


class CodecSum(NamedTuple):
    """What a codec returns for one sum over the devices.

    Attributes:
      sums: per leaf, the estimate of the sum over the devices of their
        inputs, float32, bitwise the same on every device of ``axis``; or
        a function ``sum(after)`` that makes it, for a sum made from much
        smaller parts (PowerSGD's ``P Q^T``). The caller calls it once it
        has kept the error-feedback residual, with ``after`` that new
        residual (None where none is kept), and the function makes the
        sum from `made_after` its parts: XLA then makes the sum after the
        residual, in buffers that ``sent`` held (made before, the sum,
        ``sent`` and the residual's input are live at once).
      sent: per leaf, this device's input as the others received it (its
        share of ``sums``): the error-feedback residual is ``inputs -
        sent``. A codec whose rounding is unbiased and would not be helped
        by feeding its noise back may return its expectation instead.
      finite: per leaf, a bool scalar, the same on every device: False when
        any device's input held a NaN or an infinity (found in a collective
        the codec runs anyway: a non-finite scale marked +inf, a NaN sum).
      state: the codec's new per-device state.
      sq_excess: a float32 scalar, ``E|sums|^2 - |exact sums|^2`` over the
        codec's random draws, the same on every device, when
        ``wire.report_sq_excess`` and the codec knows it; else None.
    """

    sums: Sequence[jax.Array | Callable[[jax.Array | None], jax.Array]]
    sent: list[jax.Array]
    finite: list[jax.Array]
    state: Any
    sq_excess: jax.Array | None = None


class Codec(NamedTuple):
    """A compressed cross-device sum (`gradaccum_jax.codecs` builds them).

    Attributes:
      name: what the codec is, for messages (``"topk(density=0.01, bits=2)"``).
      compresses: ``compresses(shape) -> bool``, static: whether a leaf of
        this shape is coded; the others are summed exactly in float32.
      init: ``init(shapes, key) -> state``: the codec's own per-device state
        for the coded leaves, given as ``jax.ShapeDtypeStruct`` (whole leaf
        shapes) in order, e.g. PowerSGD's warm-started ``Q``; ``key`` is
        the ``uint32[2]`` counter of the caller's seed. ``()`` if none.
      sum: ``sum(inputs, state, key, wire) -> CodecSum``: ``inputs`` are
        this device's float32 inputs of the coded leaves (blocks, as
        ``wire.splits`` says), ``key`` the ``uint32[2]`` counter of this
        call (the same on every device: draw per device with
        ``_compression._random.stream(key, leaf, wire.device)``).
      reports_sq_excess: whether ``sum`` fills `CodecSum.sq_excess` when
        asked.
      keeps_residual: False for a codec whose `CodecSum.sent` always equals
        its inputs (nothing for error feedback to keep: no residual array).
    """

    name: str
    compresses: Callable[[tuple[int, ...]], bool]
    init: Callable[[list[jax.ShapeDtypeStruct], jax.Array], Any]
    sum: Callable[[list[jax.Array], Any, jax.Array, Wire], CodecSum]
    reports_sq_excess: bool = False
    keeps_residual: bool = True

    def __repr__(self) -> str:
        return self.name


def checked_sum(
    codec: Codec,
    inputs: list[jax.Array],
    state: Any,
    key: jax.Array,
    wire: Wire,
    deferred: bool = False,
) -> CodecSum:
    """``codec.sum(inputs, state, key, wire)``, refused with a ValueError
    naming the codec where it breaks the contract of `CodecSum`: a sum and
    a sent value per input, each shaped as its input, one bool scalar per
    input in ``finite``. (A user's codec that returned too few sums met a
    bare IndexError; a flattened sum came back silently as the mean.)

    A sum given as a function stays one with ``deferred`` (the caller
    calls it after keeping the residual), else it is made here: arrays
    alone leave a map over the devices or their blocks.
    """
    result = codec.sum(inputs, state, key, wire)
    if not isinstance(result, CodecSum):
        raise ValueError(
            f"The codec {codec.name}: its sum returned a "
            f"{type(result).__name__}, not a gradaccum_jax.extend.CodecSum."
        )
    for field in ("sums", "sent", "finite"):
        values = list(getattr(result, field))
        if len(values) != len(inputs):
            raise ValueError(
                f"The codec {codec.name}: its sum returned {len(values)} "
                f"`{field}` for {len(inputs)} inputs; CodecSum.{field} holds "
                "one per input, in the inputs' order."
            )
        for j, (value, x) in enumerate(zip(values, inputs, strict=True)):
            if callable(value):
                if field != "sums":
                    raise ValueError(
                        f"The codec {codec.name}: CodecSum.{field}[{j}] is a "
                        "function; only a sum may be made later."
                    )
                value = jax.eval_shape(lambda value=value: value(None))
            expected = () if field == "finite" else np.shape(x)
            if np.shape(value) != expected:
                raise ValueError(
                    f"The codec {codec.name}: CodecSum.{field}[{j}] has shape "
                    f"{np.shape(value)}, but input {j} (updates leaf "
                    f"[{wire.leaves[j]}] in flattened order, shape {np.shape(x)} "
                    "on this device) needs "
                    + ("a bool scalar." if field == "finite" else f"shape {expected}.")
                )
    return result if deferred else made_now(result)


def made_now(result: CodecSum) -> CodecSum:
    """``result`` with every sum given as a function made now (not after
    the residual, see `CodecSum.sums`): arrays alone leave a map over the
    devices or a ``lax.cond``."""
    return result._replace(
        sums=[total(None) if callable(total) else total for total in result.sums]
    )


def made_after(x: jax.Array, after: jax.Array | None) -> jax.Array:
    """``x``, the same floats, made by XLA after ``after`` (an array, or
    None: ``x`` itself), for a sum made by a function (`CodecSum.sums`).

    Example: a codec whose sum is the product of two gathered factors
    returns ``lambda after: p @ made_after(q, after).T`` as its sum.

    >>> import jax.numpy as jnp
    >>> from gradaccum_jax.extend import made_after
    >>> q, residual = jnp.array([1.0, -0.0, 2.0]), jnp.array([jnp.nan, 3.0])
    >>> made_after(q, residual)  # a NaN in ``after`` changes nothing
    Array([ 1., -0.,  2.], dtype=float32)

    Args:
      x: a floating array (a factor of the sum).
      after: the array to make ``x`` after (the new residual), or None.

    Returns:
      ``x``'s values, bitwise, computed after ``after``.
    """
    if after is None:
        return x
    return x * (1.0 + zero_from(after)).astype(x.dtype)


def zero_from(tie: jax.Array) -> jax.Array:
    """A float32 0 that XLA computes from ``tie`` (an array): it orders what
    uses it after ``tie``, and keeps apart values that would be one.
    ``min(tie != tie, 0)`` is 0 whatever ``tie`` holds (a NaN included),
    but XLA does not fold it."""
    first = tie.reshape(-1)[0]
    return jnp.minimum((first != first).astype(jnp.float32), 0.0)


def at_least(min_size: int) -> Callable[[tuple[int, ...]], bool]:
    """`Codec.compresses` for a codec of every leaf of at least ``min_size``
    elements (and of at least one), the ternary functions' rule."""
    return functools.partial(shape_is_compressed, min_size=min_size)


def no_state(shapes: list[jax.ShapeDtypeStruct], key: jax.Array) -> tuple:
    """`Codec.init` for a codec that keeps no state of its own."""
    del shapes, key
    return ()


def as_rows(x: jax.Array, width: int, rows: int | None = None) -> jax.Array:
    """``x`` flat, padded with zeros to ``rows`` rows of ``width`` elements
    (default: the fewest that hold it), the blocks or chunks a codec codes."""
    rows = -(-x.size // width) if rows is None else rows
    return jnp.pad(x.reshape(-1), (0, rows * width - x.size)).reshape(rows, width)


def from_rows(rows: jax.Array, like: jax.Array) -> jax.Array:
    """`as_rows` undone: the first elements, shaped like ``like``."""
    return rows.reshape(-1)[: like.size].reshape(like.shape)


class CodecState(NamedTuple):
    """The state of `gradaccum_jax.compressed_average_across_devices`.

    The same NamedTuple, stacked on a leading device axis, is the per-device
    part of `gradaccum_jax.compressed_window_reduction`'s state.

    Attributes:
      key: ``uint32[2] = (seed, step)``, the counter of the codec's random
        draws, advanced on every call; the same on every device.
      residual: per leaf, float32: what this device has not sent yet (error
        feedback), added to its next input; a ``NoResidual`` (its shape, no
        array) for leaves that keep none.
      codec: the codec's own state (`Codec.init`), ``()`` if none.
      auto_splits: how ``init`` saw the params split over Auto mesh axes,
        per leaf (a static node of the tree, no array: the states from
        ``init`` and ``update`` have one tree definition).
    """

    key: jax.Array
    residual: optax.Updates
    codec: Any = ()
    auto_splits: AutoSplits = AutoSplits()

    def with_own_stream(self, index: int) -> CodecState:
        """This state drawing from a random stream of its own for ``index``."""
        return self._replace(key=_random.derive(self.key, index))
