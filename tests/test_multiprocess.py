"""Two processes on loopback train like one process with 8 devices.

The test launches 2 Python processes (``tests/_multiprocess_worker.py``),
each with 4 CPU devices, joined by ``jax.distributed.initialize`` with gloo
CPU collectives, and runs a data-parallel train step with accumulation and
cross-device averaging (``MultiSteps(chain(average_across_devices, adam))``
with ``weight=``, and the ternary mean) over the 8 global devices. This
process runs the same `train` over its own 8 devices (tests/conftest.py).

The same holds on the ``jax.jit`` path (``kind="jit"``): one mesh over the
8 global devices (Explicit and Auto), replicated parameters, global batches
sharded over the mesh, gradients from `local_value_and_grad` left unreduced
by ``MultiSteps(..., unreduced_axes="data")`` and checkpointed through
``reduce_window``. A preemption test kills one of the two processes with
SIGKILL in the middle of a window, restarts both from the last checkpoint,
and must end bitwise where the uninterrupted run ends.

Results agree to float32 rounding, not bitwise: gloo's all-reduce adds the 8
devices' floats in a different order than XLA:CPU's in-process all-reduce.
Integer collectives (the ternary code sums, the weights) and pmax are
exact.

Every wait is bounded: the coordinator, heartbeats and shutdown time out
after WORKER_TIMEOUT_S seconds and the children are killed after
LAUNCH_TIMEOUT_S, so a hung peer fails the test instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import re
import signal
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
WORKER_TIMEOUT_S = 60
# Generous: a launch takes 5-10 s on an idle machine, but 55 s once timed
# out on a loaded one.
LAUNCH_TIMEOUT_S = 90


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


@contextlib.contextmanager
def _workers(kind: str, out_dir: pathlib.Path, *extra: str):
    """Starts the workers; on leaving, kills any still running."""
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
                *extra,
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
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for log in logs:
            log.close()


def _launch(kind: str, out_dir: pathlib.Path, *extra: str) -> None:
    """Runs the workers; raises AssertionError with their logs on failure."""
    with _workers(kind, out_dir, *extra) as processes:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
        hung = [p.pid for p in processes if p.poll() is None]
    codes = [p.returncode for p in processes]
    assert not hung and codes == [0] * NUM_PROCESSES, (
        f"workers for {kind!r} failed: exit codes {codes}, killed after "
        f"{LAUNCH_TIMEOUT_S} s: {hung or 'none'}\n{_logs(out_dir)}"
    )


def _results(out_dir: pathlib.Path, kind: str, process: int) -> dict[str, np.ndarray]:
    with np.load(out_dir / f"{kind}_process{process}.npz") as saved:
        return {key: saved[key] for key in saved.files}


def _relative_error(have: np.ndarray, want: np.ndarray) -> float:
    """Largest |have - want| relative to the largest |want|."""
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    return float(np.max(np.abs(have - want), initial=0.0)) / scale


def _assert_results_match(got, expected, tolerance, context):
    """Same leaves, shapes and dtypes; integers equal, floats within ``tolerance``."""
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        have = got[name]
        assert (have.shape, have.dtype) == (want.shape, want.dtype), name
        if not np.issubdtype(want.dtype, np.floating):
            np.testing.assert_array_equal(have, want, err_msg=name)
            continue
        error = _relative_error(have, want)
        assert error <= tolerance, (*context, name, error)


@functools.cache
def _single_process(kind: str) -> dict[str, np.ndarray]:
    return worker.train(jax.devices()[: worker.NUM_DEVICES], kind)


# Largest |multi-process - single-process| of a float leaf, relative to the
# leaf's largest magnitude. Measured: adam 2.1e-7 (adam's nu; params 1.9e-7),
# ternary 1.6e-7 (the 16-element bias, averaged in float32; the ternary `w`
# is bitwise equal, its code sums being integers), top-k 1.9e-7 (w's
# residual; `w` itself bitwise equal: the payloads are gathered, and every
# device adds them up in the devices' order, whatever the process); top-k
# through the owners 1.5e-7 (the bias; `w` bitwise equal: an all-to-all
# between the processes, each owner adding in the devices' order).
TOLERANCE = {
    "adam": 1e-6,
    "ternary": 1e-6,
    "topk": 1e-6,
    "topk-reduce-scatter": 1e-6,
}


@pytest.mark.slow  # two processes per kind, about 40 s of a plain pytest in all
@pytest.mark.parametrize("kind", worker.KINDS)
def test_two_processes_match_one_process_with_8_devices(kind, tmp_path):
    assert jax.device_count() >= worker.NUM_DEVICES, "conftest.py gives 8 devices"
    expected = _single_process(kind)

    _launch(kind, tmp_path)

    for i in range(NUM_PROCESSES):
        got = _results(tmp_path, kind, i)
        for name in ("[0]['b']", "[0]['w']"):  # replicas bitwise in sync
            for device in range(1, worker.NUM_DEVICES):
                np.testing.assert_array_equal(got[name][device], got[name][0])
        _assert_results_match(got, expected, TOLERANCE[kind], context=(kind, i))


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


# --- DiLoCo, workers stacked under jax.jit ------------------------------------


@functools.cache
def _single_process_diloco(kind: str) -> dict[str, np.ndarray]:
    return worker.train_diloco(jax.devices()[: worker.NUM_DEVICES], kind)


@pytest.mark.slow  # two processes per kind
@pytest.mark.parametrize("kind", worker.DILOCO_KINDS)
def test_diloco_two_processes_match_one_process_with_8_devices(tmp_path, kind):
    """DiLoCo's stacked workers, fragments and weighted outer mean agree
    across 2 processes x 4 devices and one process with 8 (float32 rounding:
    gloo sums the outer gradients in another order), with the float32 mean
    and with top-k outer gradients whose unsent part each worker half keeps
    (its weight summed over the processes too)."""
    expected = _single_process_diloco(kind)
    # Mid-cycle (7 steps of a 4-step cycle): the workers differ, the
    # anchors agree, and both fragments have synced once.
    w = expected["[0]['w']"]
    assert np.abs(w[1] - w[0]).max() > 0
    anchor = expected["[1].anchor['w']"]
    np.testing.assert_array_equal(anchor, np.broadcast_to(anchor[0], anchor.shape))
    np.testing.assert_array_equal(expected["[1].cycle_step"], 3)

    if kind == "diloco-topk-keep":
        # w's fragment keeps a residual per worker: half of what was not sent.
        residual = expected["[1].reduction_states[0].residual[0]"]
        assert np.abs(residual).max() > 0

    _launch(kind, tmp_path)

    for i in range(NUM_PROCESSES):
        got = _results(tmp_path, kind, i)
        # Measured: 1.2e-7 (the outer momentum), params 1.0e-7.
        _assert_results_match(got, expected, 1e-6, context=(i,))


# --- the jax.jit path ---------------------------------------------------------


@pytest.fixture(scope="module")
def jit_run(tmp_path_factory) -> pathlib.Path:
    """One uninterrupted two-process jit run (both meshes), with checkpoints."""
    out_dir = tmp_path_factory.mktemp("jit")
    _launch("jit", out_dir, f"--checkpoint-dir={out_dir / 'checkpoints'}")
    return out_dir


@functools.cache
def _single_process_jit(mesh_kind: str) -> dict[str, np.ndarray]:
    return worker.train_jit(jax.devices()[: worker.NUM_DEVICES], mesh_kind)


# Largest relative |multi-process - single-process| of a float leaf (see
# _relative_error), the same on both meshes. Measured: 2.1e-7 (adam's nu;
# params 2.0e-7, the reduced window 1.1e-7); the window weight is exact.
JIT_TOLERANCE = 1e-6


@pytest.mark.parametrize("mesh_kind", worker.JIT_MESHES)
def test_jit_two_processes_match_one_process_with_8_devices(jit_run, mesh_kind):
    expected = _single_process_jit(mesh_kind)
    # Ends mid-window, after 3 windows of EVERY_K = 3, and emitted 3 times.
    np.testing.assert_array_equal(expected["[1].mini_step"], 1)
    np.testing.assert_array_equal(expected["[1].gradient_step"], 3)
    assert sorted(os.listdir(jit_run / "checkpoints" / mesh_kind)) == [
        "ckpt_4.npz",
        "ckpt_8.npz",
    ]
    for i in range(NUM_PROCESSES):
        got = {
            key.removeprefix(f"{mesh_kind}:"): value
            for key, value in _results(jit_run, "jit", i).items()
            if key.startswith(f"{mesh_kind}:")
        }
        _assert_results_match(got, expected, JIT_TOLERANCE, context=(mesh_kind, i))


# The preempted run is killed after this many micro-steps: mid-window
# (EVERY_K = 3), 3 micro-steps after the last checkpoint (micro-step 4,
# itself mid-window), which the restarted run must redo.
KILLED_AFTER = 7


def _wait_until_stopped(processes, out_dir: pathlib.Path) -> None:
    """Waits (bounded) until every worker wrote its ``stopped<id>`` marker."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    markers = [out_dir / f"stopped{i}" for i in range(NUM_PROCESSES)]
    while not all(marker.exists() for marker in markers):
        failed = [p.returncode for p in processes if p.poll() is not None]
        assert not failed and time.monotonic() < deadline, (
            f"workers did not reach micro-step {KILLED_AFTER} within "
            f"{LAUNCH_TIMEOUT_S} s (exit codes of finished ones: {failed})\n"
            f"{_logs(out_dir)}"
        )
        time.sleep(0.1)


@pytest.mark.slow  # a killed and a resumed process
def test_jit_run_killed_mid_window_resumes_bitwise(jit_run, tmp_path):
    """SIGKILL one process mid-window, restart both from the last checkpoint:
    the final parameters and state equal the uninterrupted run's bitwise."""
    full_checkpoints = jit_run / "checkpoints" / "explicit"
    checkpoints = tmp_path / "checkpoints"
    preempted, resumed = tmp_path / "preempted", tmp_path / "resumed"
    preempted.mkdir()
    resumed.mkdir()

    with _workers(
        "jit-explicit",
        preempted,
        f"--checkpoint-dir={checkpoints}",
        f"--stop-after={KILLED_AFTER}",
    ) as processes:
        _wait_until_stopped(processes, preempted)
        victim = processes[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        assert victim.returncode == -signal.SIGKILL
        # Leaving the block kills the survivor, as a scheduler restarting
        # the job would: it is waiting for a peer that is gone.

    # Only the mid-window checkpoint of micro-step 4 was written: the
    # uninterrupted run's, bit for bit.
    directory = str(checkpoints / "explicit")
    assert sorted(os.listdir(directory)) == ["ckpt_4.npz"]
    saved = worker.load_checkpoint(directory, 4)
    np.testing.assert_array_equal(saved["[1].mini_step"], 1)
    _assert_bitwise_equal(saved, worker.load_checkpoint(str(full_checkpoints), 4))

    # ... and both processes, restarted, resume from it.
    _launch("jit-explicit", resumed, f"--checkpoint-dir={checkpoints}", "--resume")
    for i in range(NUM_PROCESSES):
        log = (resumed / f"process{i}.log").read_text(errors="replace")
        assert "resuming from micro-step 4" in log
    # The checkpoint it wrote after micro-step 8, and its final state too.
    _assert_bitwise_equal(
        worker.load_checkpoint(directory, 8),
        worker.load_checkpoint(str(full_checkpoints), 8),
    )
    expected = {
        key: value
        for key, value in _results(jit_run, "jit", 0).items()
        if key.startswith("explicit:")
    }
    for i in range(NUM_PROCESSES):
        _assert_bitwise_equal(_results(resumed, "jit-explicit", i), expected)


def _assert_bitwise_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]):
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
