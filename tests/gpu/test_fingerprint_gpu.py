"""The config fingerprint (cuda/fingerprint.h) in process model 2: 2 processes x 1 GPU, each tracing
its own program (tests/gpu/fingerprint_worker.py). When the processes' EP calls do not match (another
hidden size, another capacity, another op at the same point), both get an error naming the op, their
rank and the field with both values, well before the spin timeout; a process one call behind makes
the other's discovery time out saying so. Never a hang, never wrong rows."""

from __future__ import annotations

import os

import jax
import pytest
from test_process_group_gpu import NUM_PROCESSES, run_workers

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fingerprint_worker.py")


def run_case(case: str, timeout_env: str = "30"):
    if len(jax.local_devices(backend="gpu")) < NUM_PROCESSES:
        pytest.skip(f"needs {NUM_PROCESSES} GPUs")
    results = run_workers((case,), timeout_s=240, worker=WORKER, timeout_env=timeout_env)
    for p, (rc, out) in enumerate(results):
        print(f"---- process {p} (rc {rc})\n{out[-4000:]}")
    for p, (rc, out) in enumerate(results):
        assert rc == 0, f"process {p} failed (rc {rc}):\n{out[-4000:]}"
        assert f"fingerprint_worker OK {case} process {p}" in out, f"process {p}: no OK line"


@pytest.mark.parametrize("case", ["hidden", "capacity", "op"])
def test_mismatched_calls_fail_on_both_processes_naming_op_rank_and_field(cuda_backend, case):
    """hidden 256 vs 512, capacity 128 vs 192, dispatch vs ll_dispatch: both processes' records are
    kind 'mismatch' with that field, their own value and the peer's, and the message names the op,
    the rank, the peer process, the field and both values, in less than half of JAX_EP_TIMEOUT_S."""
    run_case(case)


def test_a_process_one_call_behind_is_named_by_the_timeout(cuda_backend):
    """Process 1 runs its dispatch twice, process 0 once: process 0's call returns, process 1's
    second call times out after JAX_EP_TIMEOUT_S (5 s here) saying rank 0 is 1 call behind."""
    run_case("behind", timeout_env="5")
