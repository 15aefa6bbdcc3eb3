"""Test configuration: every test run sees 8 emulated CPU devices.

XLA reads XLA_FLAGS once, when the backend starts, so the flag must be set
before anything imports jax.
"""

import os

# 8 devices for the data-parallel tests. LLVM's optimization level 0: the
# tests run thousands of small programs, each compiled once, so compile time
# dominates the suite (about a fifth less with it); XLA's HLO passes (fusion,
# buffer assignment, collectives), which the tests read, are unchanged.
# Subprocesses (notebook kernels, multi-process runs) inherit both.
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
