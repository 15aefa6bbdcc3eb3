"""Which argument of the loss holds the PRNG key, so each micro-batch gets its own."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

_KEY_ARG = "key"


def _key_position(loss_fn: Callable[..., Any], name: str = _KEY_ARG) -> int | None:
    """Where ``loss_fn`` takes the argument ``name``: its position, -1, or None.

    Returns the positional index of a positional-or-keyword parameter called
    ``name``, -1 for a keyword-only one, and None when ``loss_fn`` has no such
    parameter (or its signature cannot be inspected, e.g. some builtins).
    """
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, parameter in enumerate(parameters):
        if parameter.name != name:
            continue
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return index
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            return -1
    return None


def _parameter_name(loss_fn: Callable[..., Any], position: int) -> str | None:
    """The name of ``loss_fn``'s positional-or-keyword parameter at
    ``position``, so a key passed by keyword is found too; None if hidden."""
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if position < len(parameters):
        parameter = parameters[position]
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return parameter.name
    return None


class KeySlot(NamedTuple):
    """Where the PRNG key sits in a call: a position in ``loss_fn``'s
    arguments (counting params and batch, as jax's argnums do) and/or a
    keyword name. Both None: the loss takes no key."""

    position: int | None
    name: str | None


def key_slot(loss_fn: Callable[..., Any], key_argnum: int | str | None) -> KeySlot:
    """Validates ``key_argnum`` and resolves it into a `KeySlot`.

    With ``key_argnum=None`` a parameter called ``key`` found by
    ``inspect.signature`` is still used, with a DeprecationWarning: a
    decorator without ``functools.wraps`` hides it and silently gives every
    micro-batch the same key.
    """
    if key_argnum is None:
        position = _key_position(loss_fn)
        if position is None:
            return KeySlot(None, None)
        warnings.warn(
            "microbatched_value_and_grad: found the PRNG key through the "
            "parameter name `key` of `loss_fn`'s signature; pass "
            "`key_argnum=` (its position, counting params as 0 and the batch "
            "as 1, or the keyword name) instead. A decorator without "
            "functools.wraps hides the name and every micro-batch would get "
            "the same key.",
            DeprecationWarning,
            stacklevel=3,
        )
        return KeySlot(position if position >= 0 else None, _KEY_ARG)
    if isinstance(key_argnum, str) and key_argnum.isidentifier():
        position = _key_position(loss_fn, key_argnum)
        return KeySlot(position if position and position >= 2 else None, key_argnum)
    if (
        isinstance(key_argnum, (int, np.integer))
        and not isinstance(key_argnum, bool)
        and key_argnum >= 2
    ):
        return KeySlot(int(key_argnum), _parameter_name(loss_fn, int(key_argnum)))
    raise ValueError(
        "`key_argnum` must be None, an integer >= 2 (the position of the "
        "PRNG key among loss_fn's arguments; 0 is params and 1 the batch) or "
        f"a keyword name (an identifier string), got {key_argnum!r}."
    )
