"""`DiLoCoState`: one worker's inner state, the anchor and the outer states."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._diloco import _fragments
from gradaccum_jax._diloco._offload import to_host
from gradaccum_jax._diloco._sync import reduction_init, wide


class DiLoCoState(NamedTuple):
    """State of `diloco`, one worker's (stacked on a leading axis for many).

    Attributes:
      cycle_step: int32, the calls made since the start of the current
        ``sync_every``-step cycle, in ``[0, sync_every)``.
      inner_state: the inner optimizer's state; each worker keeps its own.
      anchor: the parameters as of the last sync (the outer parameters),
        in the params' dtypes; the same on every worker.
      outer_states: one outer optimizer state per fragment (a tuple), over
        a list of the fragment's pieces in float32 (the outer step is taken
        in float32 whatever the params' dtype), by increasing index of
        their leaf among the params' flat leaves: a whole leaf, or with
        ``fragment_axis`` the fragment's block of rows of a split leaf
        (rows ``[start, stop)`` of a scanned leaf's layers, so the pieces of
        different fragments may differ in shape by one row); the same on
        every worker.
      reduction_states: one ``outer_reduction`` state per fragment (a
        tuple), over the same lists: ``optax.EmptyState()`` for the default
        mean, a `gradaccum_jax.extend.CodecState` (PRNG counter and this
        worker's error-feedback residual) for a compressed mean.
      cycle_weights: float32 ``[fragments]``, the weight (e.g. tokens) this
        worker saw since each fragment's last sync.

    With ``diloco(offload_outer_state=True)`` the anchor, the outer
    states and the reduction states are in host memory (``pinned_host``).

    Every field is an array or a pytree of arrays, so the state goes
    through ``jax.jit``, ``pmap``, ``shard_map`` and a checkpoint round
    trip unchanged.
    """

    cycle_step: jax.Array
    inner_state: Any
    anchor: Any
    outer_states: tuple[Any, ...]
    reduction_states: tuple[Any, ...]
    cycle_weights: jax.Array


def init_state(
    params: Any,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    reduction: optax.GradientTransformation | None,
    fragments: tuple[_fragments.Fragment, ...],
    offload: bool = False,
) -> DiLoCoState:
    """A fresh state: the anchor is a copy of ``params``, nothing seen yet;
    with ``offload``, the anchor and the outer states in host memory."""
    leaves = jax.tree.leaves(params)
    outer_states, reduction_states = [], []
    for index, fragment in enumerate(fragments):
        pieces = [
            wide(piece)
            for piece in _fragments.cut(_fragments.take(leaves, fragment), fragment)
        ]
        outer_states.append(outer.init(pieces))
        try:
            reduction_states.append(reduction_init(reduction, pieces, index))
        except ValueError as error:
            raise ValueError(
                f"{error} (diloco's outer_reduction sees fragment {index} as a "
                f"list: {_positions(params, fragment, str(error))})"
            ) from error
    # A copy, not the params themselves: a donated train step would hand
    # the anchor's buffers to the new params otherwise.
    anchor = jax.tree.map(jnp.copy, params)
    if offload:
        anchor, outer_states, reduction_states = to_host(
            (anchor, outer_states, reduction_states)
        )
    return DiLoCoState(
        cycle_step=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params),
        anchor=anchor,
        outer_states=tuple(outer_states),
        reduction_states=tuple(reduction_states),
        cycle_weights=jnp.zeros([len(fragments)], jnp.float32),
    )


def _positions(params: Any, fragment: _fragments.Fragment, message: str) -> str:
    """Which params leaf each list position that ``message`` names stands
    for, in the list the fragment's reduction sees (its pieces, then the
    presence weight). A reduction names a leaf by its key path in what it
    was given, ``[k]`` in that list, which means nothing to the user: the
    list is diloco's, so diloco maps the positions back to the params."""
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    named = []
    for position in dict.fromkeys(
        int(p) for p in re.findall(r"leaf \[(\d+)\]", message)
    ):
        if position < len(fragment):
            piece = fragment[position]
            rows = (
                ""
                if piece.axis is None
                else f" rows {piece.start}:{piece.stop} of axis {piece.axis}"
            )
            named.append(f"[{position}] is params leaf {paths[piece.leaf]}{rows}")
        elif position == len(fragment):
            named.append(f"[{position}] is the scalar presence weight")
    return ", ".join(named) or "its pieces in the params' order, then a scalar"
