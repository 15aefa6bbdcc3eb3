"""Two processes on loopback train like one process with 8 devices.

The test launches 2 Python processes (``tests/_multiprocess_worker.py``),
each with 4 CPU devices, joined by ``jax.distributed.initialize`` with gloo
CPU collectives, and runs a data-parallel train step with accumulation and
cross-device averaging (``MultiSteps(chain(average_across_devices, adam))``
with ``weight=``, and the ternary mean) over the 8 global devices. This
process runs the same `train` over its own 8 devices (tests/conftest.py).

Results agree to float32 rounding, not bitwise: gloo's all-reduce adds the 8
devices' floats in a different order than XLA:CPU's in-process all-reduce.
Integer collectives (the ternary code sums, the weights) and pmax are
exact.

Every wait is bounded: the coordinator, heartbeats and shutdown time out
after WORKER_TIMEOUT_S seconds and the children are killed after
LAUNCH_TIMEOUT_S, so a hung peer fails the test instead of hanging CI.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import _multiprocess_worker as worker
import jax
import numpy as np
import pytest

WORKER = pathlib.Path(worker.__file__).resolve()
REPO_ROOT = WORKER.parent.parent
NUM_PROCESSES = 2
WORKER_TIMEOUT_S = 40
LAUNCH_TIMEOUT_S = 55


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Replace (not append to) the 8-device flag conftest.py set for us.
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
    )
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH"), str(REPO_ROOT)) if p
    )
    return env


def _logs(log_dir: pathlib.Path) -> str:
    parts = []
    for i in range(NUM_PROCESSES):
        text = (log_dir / f"process{i}.log").read_text(errors="replace")
        # gloo prints one "connected to N peer ranks" line per device.
        text = "\n".join(line for line in text.splitlines() if "[Gloo]" not in line)
        parts.append(f"----- process {i} (last 3000 characters) -----\n{text[-3000:]}")
    return "\n".join(parts)


def _launch(kind: str, out_dir: pathlib.Path) -> None:
    """Runs the workers; raises AssertionError with their logs on failure."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = _child_env()
    processes, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            log = open(out_dir / f"process{i}.log", "w")  # noqa: SIM115
            logs.append(log)
            command = [
                sys.executable,
                str(WORKER),
                f"--process-id={i}",
                f"--num-processes={NUM_PROCESSES}",
                f"--coordinator={coordinator}",
                f"--out={out_dir}",
                f"--kind={kind}",
                f"--timeout={WORKER_TIMEOUT_S}",
            ]
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        hung = [p.pid for p in processes if p.poll() is None]
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for log in logs:
            log.close()
    codes = [p.returncode for p in processes]
    assert not hung and codes == [0] * NUM_PROCESSES, (
        f"workers for {kind!r} failed: exit codes {codes}, killed after "
        f"{LAUNCH_TIMEOUT_S} s: {hung or 'none'}\n{_logs(out_dir)}"
    )


@functools.cache
def _single_process(kind: str) -> dict[str, np.ndarray]:
    return worker.train(jax.devices()[: worker.NUM_DEVICES], kind)


# Largest |multi-process - single-process| of a float leaf, relative to the
# leaf's largest magnitude. Measured: adam 2.1e-7 (adam's nu; params 1.9e-7),
# ternary 1.6e-7 (the 16-element bias, averaged in float32; the ternary `w`
# is bitwise equal, its code sums being integers).
TOLERANCE = {"adam": 1e-6, "ternary": 1e-6}


@pytest.mark.parametrize("kind", worker.KINDS)
def test_two_processes_match_one_process_with_8_devices(kind, tmp_path):
    assert jax.device_count() >= worker.NUM_DEVICES, "conftest.py gives 8 devices"
    expected = _single_process(kind)

    _launch(kind, tmp_path)

    for i in range(NUM_PROCESSES):
        with np.load(tmp_path / f"{kind}_process{i}.npz") as saved:
            got = {key: saved[key] for key in saved.files}
        assert sorted(got) == sorted(expected)
        for name in ("[0]['b']", "[0]['w']"):  # replicas bitwise in sync
            for device in range(1, worker.NUM_DEVICES):
                np.testing.assert_array_equal(got[name][device], got[name][0])
        for name, want in expected.items():
            have = got[name]
            assert (have.shape, have.dtype) == (want.shape, want.dtype), name
            if not np.issubdtype(want.dtype, np.floating):
                np.testing.assert_array_equal(have, want, err_msg=f"{kind} {name}")
                continue
            scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
            error = float(np.max(np.abs(have - want), initial=0.0)) / scale
            assert error <= TOLERANCE[kind], (kind, i, name, error)


@pytest.mark.parametrize("kind", worker.KINDS)
def test_replicas_stay_in_sync_and_adam_matches_big_batch(kind):
    """The single-process run is itself right: replicas never diverge, and
    with adam each window applies the big batch's mean gradient."""
    result = _single_process(kind)
    for name in ("[0]['b']", "[0]['w']"):
        replicas = result[name]
        for device in range(1, worker.NUM_DEVICES):
            np.testing.assert_array_equal(replicas[device], replicas[0])
    np.testing.assert_array_equal(result["[1].gradient_step"], 2)
    np.testing.assert_array_equal(result["[1].mini_step"], 1)
    if kind == "adam":
        reference = worker.big_batch_reference(kind)
        for name, want in reference.items():
            np.testing.assert_allclose(result[name][0], want, rtol=0, atol=1e-7)
