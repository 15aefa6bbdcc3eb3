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


# The slowest modules first (each runs notebooks, subprocesses, a docs
# build or a long optax suite): with two workers, a long test that starts
# last leaves the other worker idle at the end of the run.
_SLOW_MODULES = (
    "test_notebooks.py",
    "test_readme.py",
    "test_optax_compat.py",
    "test_multiprocess.py",
    "test_docs.py",
    "test_demo.py",
    "test_packaging.py",
    "test_types.py",
    "test_examples.py",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in _SLOW_MODULES)
