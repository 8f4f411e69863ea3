"""Process model 2 on the GPUs of one host: one process per GPU (jax.distributed), NVSHMEM
symmetric buffers and peer tables, the model-1 kernels. Each process runs
tests/gpu/process_group_worker.py, which checks its rank's outputs against the reference path."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "process_group_worker.py")
NUM_PROCESSES = 2
TIMEOUT_S = 420


def run_workers(extra=(), timeout_s=TIMEOUT_S, worker=WORKER, timeout_env="30"):
    """[(exit code, output)] of the launcher, which runs `worker` as 2 processes x 1 GPU with
    JAX_EP_TIMEOUT_S=timeout_env."""
    # This pytest process already holds most of both GPUs (XLA preallocates for the other tests):
    # the workers allocate on demand.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_EP_TIMEOUT_S=timeout_env)
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    command = [sys.executable, "-m", "jax_ep.launch", "--nproc", str(NUM_PROCESSES), "--timeout",
               str(timeout_s - 20), worker, *extra]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not finish within {timeout_s} s")
    out = done.stdout + done.stderr
    return [(done.returncode, "\n".join(line for line in out.splitlines()
                                        if line.startswith(f"[p{p}]")))
            for p in range(NUM_PROCESSES)]


def test_process_per_gpu_matches_reference(cuda_backend):
    if len(jax.local_devices(backend="gpu")) < NUM_PROCESSES:
        pytest.skip(f"needs {NUM_PROCESSES} GPUs")
    results = run_workers()
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-6000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        assert "process_group_worker OK" in out, f"process {p}: no OK line"


def test_remote_smoke_puts_and_signals(cuda_backend):
    """The NVSHMEM device put/signal transport alone (the worker's --remote): remote_smoke's rows
    bit-exact on every process, single calls and a scan replayed as CUDA graphs."""
    if len(jax.local_devices(backend="gpu")) < NUM_PROCESSES:
        pytest.skip(f"needs {NUM_PROCESSES} GPUs")
    results = run_workers(("--remote",), timeout_s=240)
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-3000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        assert "remote_smoke OK" in out and "process_group_worker OK" in out, out[-3000:]


def test_bootstrap_without_a_process_fails_in_bounded_time_naming_it(cuda_backend):
    """Process 1 leaves before the NVSHMEM bootstrap: process 0 raises TimeoutError naming it
    (runtime.BOOTSTRAP_TIMEOUT_S, set to 10 s by the worker) instead of waiting forever."""
    if len(jax.local_devices(backend="gpu")) < NUM_PROCESSES:
        pytest.skip(f"needs {NUM_PROCESSES} GPUs")
    (rc, out), _ = run_workers(("--absent", "1"), timeout_s=120)
    print(out[-3000:])
    assert rc == 0 and "absent process named" in out, out[-3000:]
