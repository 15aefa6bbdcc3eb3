"""Emulated CPU devices: the one way a benchmark asks for them.

XLA reads ``XLA_FLAGS`` once, when its CPU backend starts: a benchmark on
several emulated devices sets them before jax computes anything
(`emulate`, in this process) or starts a process of its own with them
(`child_env`). Both pin the CPU platform: on a one-GPU machine jax would
otherwise pick the GPU, one device.
"""

from __future__ import annotations

import os

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(count: int, *extra: str) -> str:
    """``XLA_FLAGS`` for ``count`` CPU devices: the flags already set, less
    an earlier device count, then ``extra``."""
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith(_COUNT_FLAG)
    ]
    return " ".join([*kept, f"{_COUNT_FLAG}={count}", *extra])


def emulate(count: int) -> None:
    """This process on ``count`` emulated CPU devices: call it before jax
    starts its backend (its first computation or ``jax.devices()``)."""
    os.environ["XLA_FLAGS"] = xla_flags(count)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def child_env(count: int, *extra: str) -> dict[str, str]:
    """The environment of a child process on ``count`` emulated CPU
    devices (``extra`` XLA flags after the count)."""
    return {**os.environ, "XLA_FLAGS": xla_flags(count, *extra), "JAX_PLATFORMS": "cpu"}


def machine() -> str:
    """The machine the figures come from, in words (plot titles, tables)."""
    import jax

    return f"{jax.devices()[0].platform.upper()}, {os.cpu_count()} cores"
