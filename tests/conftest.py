"""Test configuration: every test run sees 8 emulated CPU devices.

XLA reads XLA_FLAGS once, when the backend starts, so the flag must be set
before anything imports jax.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

# 8 devices for the data-parallel tests. The rest make compiling cheaper:
# the tests run thousands of small programs, each compiled once, so compile
# time dominates the suite. LLVM's optimization level 0 (about a fifth
# less), none of its expensive passes (test_jit_sharding.py 66.5 s instead
# of 71.3 s), and XLA:CPU's older emitters for fused computations instead
# of its MLIR fusion emitters (the whole suite 353 s instead of 522 s;
# test_jit_sharding.py 49 s instead of 70 s). None changes what the tests
# read: fusion decisions, buffer assignment (the temporaries) and the
# collectives are XLA's HLO passes, the same with them; the only trace in
# the HLO is that a lone elementwise op is no longer wrapped in a fusion
# of its own. Subprocesses (notebook kernels, multi-process runs) inherit
# them. The benchmarks compile as users do, without them.
_DEVICES = "--xla_force_host_platform_device_count=8"
_COMPILE_FASTER = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _present(flag):
    return flag.split("=")[0] in os.environ.get("XLA_FLAGS", "")


def _with_flags(flags):
    added = [flag for flag in flags if not _present(flag)]
    return " ".join([os.environ.get("XLA_FLAGS", ""), *added]).strip()


def _xla_accepts(flags):
    """XLA aborts the process on a flag it does not know (a later jaxlib
    may drop one of these): try them in a child process first."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": _with_flags(flags), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
    )
    return probe.returncode == 0


def _accepted(flags):
    """All of ``flags`` if XLA takes them together, else each it takes."""
    if not flags or _xla_accepts(flags):
        return flags
    return [flag for flag in flags if _xla_accepts([flag])]


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = _with_flags([_DEVICES])
# The workers and subprocesses inherit the flags: only the first process
# (the xdist controller) finds any missing, and tries them.
os.environ["XLA_FLAGS"] = _with_flags(
    _accepted([flag for flag in _COMPILE_FASTER if not _present(flag)])
)

# One persistent compilation cache for the run, shared by the two workers
# and every process they start (notebook kernels, doc pages, multi-process
# runs): those each compiled the same small programs again (initializers,
# key splits), and read them back instead (the notebooks and doc pages took
# 84 s instead of 113 s on 2 cores). A fresh directory per run,
# made by the first process (the xdist controller, whose environment the
# workers inherit) and removed when it exits. The cache is keyed by the
# whole program, the flags and the jax version: a hit is the same program.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="gradaccum-jax-tests-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The longest tests, each a fresh kernel or process that trains a model or
# builds the site, run first. The two workers split the collected order in
# halves and steal from each other's queue when theirs runs dry; a
# minute-long notebook left near the end would keep one worker busy while
# the other idles. Started first, the short tests fill in around them.
_LONGEST_FIRST = (
    "test_transformer_lm.py::test_the_notebook_shows_what_the_example_claims",
    "test_notebooks.py::test_notebook_runs",
    "test_readme.py::test_docs_page_python_blocks_run_top_to_bottom",
    "test_readme.py::test_readme_python_blocks_run_top_to_bottom",
    "test_multiprocess.py::",
    "test_docs.py::",
    "test_types.py::",
)


def pytest_collection_modifyitems(items):
    # A stable sort: everything else keeps its order (module fixtures stay
    # shared within their module).
    items.sort(key=lambda item: not any(key in item.nodeid for key in _LONGEST_FIRST))
