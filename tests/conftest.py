"""Test configuration: every test run sees 8 emulated CPU devices.

XLA reads XLA_FLAGS once, when the backend starts, so the flag must be set
before anything imports jax.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
    )
os.environ.setdefault("JAX_PLATFORMS", "cpu")
