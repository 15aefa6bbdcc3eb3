"""Which argument of the loss holds the PRNG key, so each micro-batch gets its own."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

_KEY_ARG = "key"
# Parameters a call can fill without *args or **kwargs.
_NAMED = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


def _parameters(loss_fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``loss_fn``'s parameters, or None when its signature cannot be read
    (some builtins)."""
    try:
        return list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _has(parameters: list[inspect.Parameter] | None, kind: Any) -> bool:
    """Whether ``loss_fn`` may take arguments of ``kind`` (``*args`` or
    ``**kwargs``) that its signature does not name; True if it is unknown."""
    return parameters is None or any(p.kind is kind for p in parameters)


class KeySlot(NamedTuple):
    """Where the PRNG key sits in a call: a position in ``loss_fn``'s
    arguments (counting params and batch, as jax's argnums do) and/or a
    keyword name. Both None: the loss takes no key.

    ``hidden``: the signature does not say how the key would be spelled the
    other way (its position when only its name is known, or its name when
    only its position is), yet lets a call pass it so (``*args``,
    ``**kwargs``), as a decorator without ``functools.wraps`` does.
    """

    position: int | None
    name: str | None
    hidden: bool = False

    def locate(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[int | None, str | None]:
        """Where this call's key is: ``(index into args, None)``,
        ``(None, keyword)``, or ``(None, None)`` when the call passes none.

        Raises a ValueError when the key may be among arguments the
        signature hides: every micro-batch would silently get the same key.
        """
        if self.name is not None and self.name in kwargs:
            return None, self.name
        if self.position is not None and self.position - 2 < len(args):
            return self.position - 2, None
        if self.hidden and self.position is None and args:
            raise ValueError(
                f"microbatched_value_and_grad: `key_argnum`={self.name!r} names "
                "the PRNG key, but `loss_fn`'s signature does not show at which "
                "position it is, and this call passes no "
                f"`{self.name}=` keyword but {len(args)} positional argument(s) "
                "after the batch: the key may be one of them, and every "
                f"micro-batch would get the same one. Pass it as `{self.name}=`, "
                "or give `key_argnum` its position (2 for the argument right "
                "after the batch)."
            )
        if self.hidden and self.name is None and kwargs:
            raise ValueError(
                f"microbatched_value_and_grad: `key_argnum`={self.position} is the "
                "position of the PRNG key, but this call passes no argument "
                f"there, and keyword argument(s) {sorted(kwargs)} whose "
                "positions `loss_fn`'s signature does not show: the key may be "
                "one of them, and every micro-batch would get the same one. "
                "Pass it by position, or give `key_argnum` its keyword name."
            )
        return None, None


def _named_slot(loss_fn: Callable[..., Any], name: str) -> KeySlot | None:
    """The slot of the parameter ``name`` (its position is None for a
    keyword-only one), or None when the signature shows no such parameter."""
    for index, parameter in enumerate(_parameters(loss_fn) or ()):
        if parameter.name == name and parameter.kind in _NAMED:
            keyword_only = parameter.kind is inspect.Parameter.KEYWORD_ONLY
            return KeySlot(None if keyword_only or index < 2 else index, name)
    return None


def _positional_slot(loss_fn: Callable[..., Any], position: int) -> KeySlot:
    """The slot of the argument at ``position``, with its name when the
    signature shows one, so a key passed by keyword is found too."""
    parameters = _parameters(loss_fn)
    if parameters is not None and position < len(parameters):
        parameter = parameters[position]
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return KeySlot(position, parameter.name)
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            return KeySlot(position, None)
    return KeySlot(position, None, _has(parameters, inspect.Parameter.VAR_KEYWORD))


def key_slot(loss_fn: Callable[..., Any], key_argnum: int | str | None) -> KeySlot:
    """Validates ``key_argnum`` and resolves it into a `KeySlot`.

    With ``key_argnum=None`` a parameter called ``key`` found by
    ``inspect.signature`` is still used, with a DeprecationWarning: a
    decorator without ``functools.wraps`` hides it and silently gives every
    micro-batch the same key.
    """
    if key_argnum is None:
        slot = _named_slot(loss_fn, _KEY_ARG)
        if slot is None:
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
        return slot
    if isinstance(key_argnum, str) and key_argnum.isidentifier():
        slot = _named_slot(loss_fn, key_argnum)
        if slot is not None:
            return slot
        var_positional = inspect.Parameter.VAR_POSITIONAL
        return KeySlot(None, key_argnum, _has(_parameters(loss_fn), var_positional))
    if (
        isinstance(key_argnum, (int, np.integer))
        and not isinstance(key_argnum, bool)
        and key_argnum >= 2
    ):
        return _positional_slot(loss_fn, int(key_argnum))
    raise ValueError(
        "`key_argnum` must be None, an integer >= 2 (the position of the "
        "PRNG key among loss_fn's arguments; 0 is params and 1 the batch) or "
        f"a keyword name (an identifier string), got {key_argnum!r}."
    )
